"""Weight-only quantisation of SmolLM2-135M-Instruct: accuracy against float32, and speed.

Usage::

    .venv/bin/python benchmarks/quantize.py            # 10 prompts x 32 tokens, ~4 minutes
    .venv/bin/python benchmarks/quantize.py --quick    # 3 prompts x 8 tokens

For ``int8`` and ``int4`` (``qkv.pretrained.load(..., quantize=)``), each through both kernels
of :mod:`qkv.nn.quantized` (``packed``: torch's fused CPU kernels in bfloat16; ``float``:
dequantise and multiply in float32), against the float32 model:

* perplexity on a held-out text (``--text``; default the GPL-3 text Debian ships in
  ``/usr/share/common-licenses``, else CPython's ``LICENSE.txt``), windows of 512 tokens;
* teacher-forced agreement: along float32's greedy continuation of every prompt, at how many
  positions the quantised model's argmax differs, and float32's top-1 margin (top-1 minus
  top-2 logit) at each of those, beside the median over positions of the largest logit error
  (a difference where the margin exceeds the error would be a fault, not rounding);
* free-running: how many greedy continuations differ at all, and their mean shared prefix;
* greedy tokens/s of every variant, alternating rounds, min and median (``--threads``);
* ``--rows``: instead, the model's forward over M = 1 to 512 tokens through each variant,
  best of 3 in ms (what ``PACKED_ROWS``, the ``"auto"`` rule, rests on).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import qkv.pretrained
from common import machine_line
from qkv.generate import greedy
from qkv.nn.quantized import Int4Linear, Int8Linear

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "The capital of Australia is",
    "Once upon a time, in a small village,",
    "To make a good cup of tea, first",
    "The three laws of thermodynamics state that",
    "In 1969, the Apollo 11 mission",
    "A transformer model computes attention by",
    "The best way to learn a new language is",
]
VARIANTS = {"float32": (None, None), "int8 packed": ("int8", "packed"),
            "int8 float": ("int8", "float"), "int4 packed": ("int4", "packed"),
            "int4 float": ("int4", "float")}  # fmt: skip
WINDOW = 512
NEVER = 49151  # EOS off: the last id, an unused byte piece (none of the prompts makes it)


def default_text() -> Path:
    gpl = Path("/usr/share/common-licenses/GPL-3")
    return gpl if gpl.exists() else Path(sys.base_prefix) / "lib" / (
        f"python{sys.version_info.major}.{sys.version_info.minor}") / "LICENSE.txt"


def set_kernel(model: torch.nn.Module, kernel: str | None) -> torch.nn.Module:
    """Every quantised linear of ``model`` on ``kernel`` (None: leave them)."""
    for m in model.modules():
        if kernel is not None and isinstance(m, Int8Linear | Int4Linear):
            m.kernel = kernel
    return model


def perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    """exp(mean next-token cross-entropy) over non-overlapping windows of WINDOW tokens."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, WINDOW):
            window = torch.tensor([ids[start:start + WINDOW + 1]])  # (1, <= WINDOW + 1)
            logits = model(window[:, :-1])[0]  # (T, V)
            loss = torch.nn.functional.cross_entropy(logits.float(), window[0, 1:],
                                                     reduction="sum")  # fmt: skip
            total, count = total + loss.item(), count + window.shape[1] - 1
    return float(torch.tensor(total / count).exp())


def teacher_forced(model, want, full, prompt_lens) -> tuple[int, int, list[float], float]:
    """Argmax differences along float32's continuations: (differ, positions, margins, err)."""
    differ, positions, margins, errs = 0, 0, [], []
    with torch.inference_mode():
        for ids, ref, p in zip(full, want, prompt_lens, strict=True):
            got = model(ids)[0][p - 1:-1]  # (new, V): the logits that chose each new token
            ref = ref[p - 1:-1]
            top = ref.topk(2, dim=-1).values  # (new, 2)
            moved = got.argmax(-1) != ref.argmax(-1)
            differ, positions = differ + int(moved.sum()), positions + len(moved)
            margins += (top[:, 0] - top[:, 1])[moved].tolist()
            errs += (got - ref).abs().amax(-1).tolist()
    return differ, positions, margins, statistics.median(errs)


def rows_sweep(loaded: dict, repeats: int) -> None:
    """Forward ms over M tokens of every variant, best of ``repeats`` (alternating)."""
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 8, 16, 32, 64, 128, 512):
        ids = torch.randint(0, NEVER, (1, rows), generator=gen)
        best = dict.fromkeys(VARIANTS, float("inf"))
        with torch.inference_mode():
            for r in range(repeats + 1):  # the first round warms up
                for name, (mode, kernel) in VARIANTS.items():
                    model = set_kernel(loaded[mode].model, kernel)
                    start = time.perf_counter()
                    model(ids)
                    if r:
                        best[name] = min(best[name], time.perf_counter() - start)
        print(f"M={rows:<4d}" + "".join(f"  {n} {1e3 * t:7.1f}" for n, t in best.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text", type=Path, default=default_text())
    parser.add_argument("--text-tokens", type=int, default=2048)
    parser.add_argument("--rows", action="store_true", help="only the forward-by-M sweep")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = PROMPTS[:3] if args.quick else PROMPTS
    new = 8 if args.quick else 32
    loaded = {mode: qkv.pretrained.load("SmolLM2-135M-Instruct", quantize=mode)
              for mode in (None, "int8", "int4")}  # fmt: skip
    if args.rows:
        print(machine_line())
        print("SmolLM2-135M-Instruct forward over M tokens, ms (best of "
              f"{args.repeats}, {args.threads} threads)")
        rows_sweep(loaded, args.repeats)
        return
    tok = loaded[None].tokenizer
    ids = [tok.encode(p) for p in prompts]
    text = tok.encode(args.text.read_text())[: (512 if args.quick else args.text_tokens) + 1]
    base = loaded[None].model
    conts = [greedy(base, [i], max_new_tokens=new, eos_id=NEVER)[0].tolist() for i in ids]
    full = [torch.tensor([i + c]) for i, c in zip(ids, conts, strict=True)]
    with torch.inference_mode():
        want = [base(f)[0] for f in full]
    print(machine_line())
    print(f"SmolLM2-135M-Instruct, {len(prompts)} prompts, {new} greedy tokens; perplexity on "
          f"{len(text) - 1} tokens of {args.text}")
    ppl0 = perplexity(base, text)
    print(f"float32: perplexity {ppl0:.3f}")
    for name, (mode, kernel) in VARIANTS.items():
        if mode is None:
            continue
        model = set_kernel(loaded[mode].model, kernel)
        ppl = perplexity(model, text)
        differ, positions, margins, err = teacher_forced(model, want, full, [len(i) for i in ids])
        free = [greedy(model, [i], max_new_tokens=new, eos_id=NEVER)[0].tolist() for i in ids]
        shared = [next((k for k, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), new)
                  for x, y in zip(conts, free, strict=True)]  # fmt: skip
        above = sum(m > err for m in margins)
        print(f"{name}: perplexity {ppl:.3f} ({100 * (ppl / ppl0 - 1):+.2f}%); teacher-forced "
              f"argmax differs at {differ}/{positions} positions, float32 margin there max "
              f"{max(margins, default=0):.3f} (median max |logit err| {err:.3f}; {above} "
              f"above it); free-running: {sum(s < new for s in shared)}/{len(ids)} "
              f"continuations differ, mean shared prefix {statistics.mean(shared):.1f}/{new}")
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, (mode, kernel) in VARIANTS.items():
            model = set_kernel(loaded[mode].model, kernel)
            start = time.perf_counter()
            greedy(model, [ids[0]], max_new_tokens=new, eos_id=NEVER)
            times[name].append(new / (time.perf_counter() - start))
    for name, t in times.items():
        print(f"{name}: {max(t):.1f} new tokens/s best, {statistics.median(t):.1f} median "
              f"(eager, {args.threads} threads)")


if __name__ == "__main__":
    main()
