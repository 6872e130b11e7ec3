"""Does ``qkv train --from`` teach a pretrained model? LoRA on SmolLM2-135M-Instruct, before and
after, on a task built offline.

The task: write a date given in one of the many formats of ``qkv.data.dates`` ("the 22nd of
November, 2009", "8/9/09", "MON, 20 SEP 1965") as ISO 8601 (``2009-11-22``), the reply alone.
A short system message says so. ``--train`` conversations for training and ``--held``
different dates (no date text in both) held out. Two-digit years follow the task's pivot
(``expand_two_digit_year``), which the model can only learn from the data.

Measured, before and after fine-tuning:

* held-out accuracy: the greedy reply (``bundle.generate``, at most 12 new tokens), stripped,
  equals the ISO date exactly;
* the model on unrelated text: perplexity of ``--text-tokens`` of the standard library's
  docstrings (``qkv.data.text.stdlib_corpus``) in windows of 512 tokens, to show how much the
  rest of its behaviour moved.

Training is the command line itself, in a subprocess:
``qkv train --from SmolLM2-135M-Instruct --chat train.jsonl --lora-rank 8 ...``.
Prints the CPU, the threads and the table; writes ``benchmarks/results/finetune_evidence.json``.

    python -m benchmarks.finetune_evidence [--steps 60] [--batch-size 4] [--lr 5e-4]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import qkv.pretrained
from qkv.data.dates import date_pair
from qkv.data.text import stdlib_corpus
from qkv.train import evaluate_lm

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "Reply with the date only, as YYYY-MM-DD."
RESULTS = Path(__file__).parent / "results" / "finetune_evidence.json"


def conversations(n_train: int, n_held: int, seed: int) -> tuple[list, list]:
    """``(train, held)`` lists of ``(date text, iso)``, no date text in both."""
    rng = random.Random(seed)
    seen: set[str] = set()
    pairs = []
    while len(pairs) < n_train + n_held:
        text, iso = date_pair(rng)
        if text not in seen:
            seen.add(text)
            pairs.append((text, iso))
    return pairs[:n_train], pairs[n_train:]


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def accuracy(bundle, held: list) -> tuple[float, list]:
    """Share of held-out dates answered exactly; a few examples of the replies."""
    right, shown = 0, []
    for text, iso in held:
        reply = bundle.generate(messages(text), max_new_tokens=12).strip()
        right += reply == iso
        if len(shown) < 4:
            shown.append((text, iso, reply))
    return right / len(held), shown


def text_perplexity(bundle, tokens: int) -> float:
    ids = bundle.tokenizer.encode(stdlib_corpus()[: tokens * 6], add_special_tokens=False)
    ids = torch.tensor(ids[: tokens + 1])
    return evaluate_lm(bundle.model, ids, block_size=512, batch_size=4)["perplexity"]


def measure(bundle, held: list, tokens: int) -> dict:
    start = time.perf_counter()
    acc, shown = accuracy(bundle, held)
    ppl = text_perplexity(bundle, tokens)
    return {"accuracy": acc, "text_perplexity": ppl, "examples": shown,
            "seconds": time.perf_counter() - start}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--held", type=int, default=100)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--text-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    train, held = conversations(args.train, args.held, seed=0)
    work = Path(tempfile.mkdtemp(prefix="qkv-finetune-"))
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [*messages(t), {"role": "assistant",
                                                                    "content": iso}]}) + "\n"
                            for t, iso in train), encoding="utf-8")  # fmt: skip
    before = measure(qkv.pretrained.load(MODEL), held, args.text_tokens)
    cmd = [sys.executable, "-m", "qkv", "train", "--from", MODEL, "--chat", str(data),
           "--lora-rank", str(args.rank), "--steps", str(args.steps), "--batch-size",
           str(args.batch_size), "--lr", str(args.lr), "--eval-every", str(args.steps),
           "--threads", str(args.threads), "--out", str(work / "run")]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    train_seconds = time.perf_counter() - start
    after = measure(qkv.pretrained.load(work / "run" / "model"), held, args.text_tokens)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"\n{MODEL}, LoRA r={args.rank} on attention, {args.steps} steps x {args.batch_size} "
          f"packed rows of 512 tokens, lr {args.lr:g}; {len(train)} training conversations, "
          f"{len(held)} held out")  # fmt: skip
    print(f"CPU {platform.processor() or platform.machine()} ({cpu}), {args.threads} threads; "
          f"training {train_seconds:.0f} s (the command, load to save)")  # fmt: skip
    print(f"{'':28}{'before':>10}{'after':>10}")
    print(f"{'held-out exact answers':28}{before['accuracy']:>10.1%}{after['accuracy']:>10.1%}")
    print(f"{'stdlib text perplexity':28}{before['text_perplexity']:>10.2f}"
          f"{after['text_perplexity']:>10.2f}")  # fmt: skip
    for label, run in (("before", before), ("after", after)):
        for text, iso, reply in run["examples"]:
            print(f"  {label}: {text!r} -> {reply!r} (want {iso})")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "cpu": cpu, "train_seconds":
                                   train_seconds, "before": before, "after": after},
                                  indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
