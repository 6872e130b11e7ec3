"""Weight-only quantisation of SmolLM2-135M-Instruct: accuracy against float32, and speed.

Usage::

    .venv/bin/python benchmarks/quantize.py            # 10 prompts x 32 tokens, ~2 minutes
    .venv/bin/python benchmarks/quantize.py --quick    # 3 prompts x 8 tokens

For ``int8`` and ``int4`` (``qkv.pretrained.load(..., quantize=)``), against the float32 model
on the same prompts: the logit error over every prompt position (max absolute, and the
relative Frobenius error), how often the greedy next token after the prompt differs, how
many of the prompts' greedy continuations differ at all and the mean length of the prefix
they share; then greedy tokens/s of each, alternating rounds, min and median
(``--threads``, default torch's).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import qkv.pretrained
from qkv.generate import greedy

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = PROMPTS[:3] if args.quick else PROMPTS
    new = 8 if args.quick else 32
    bundles = {mode: qkv.pretrained.load("SmolLM2-135M-Instruct", quantize=mode)
               for mode in (None, "int8", "int4")}  # fmt: skip
    tok = bundles[None].tokenizer
    ids = [tok.encode(p) for p in prompts]
    outputs = {mode: [greedy(b.model, [i], max_new_tokens=new, eos_id=None)[0].tolist()
                      for i in ids] for mode, b in bundles.items()}  # fmt: skip
    print(f"SmolLM2-135M-Instruct, {len(prompts)} prompts, {new} greedy tokens, "
          f"{args.threads} threads")
    for mode in ("int8", "int4"):
        max_err, rel, first = 0.0, [], 0
        for i in ids:
            x = torch.tensor([i])
            with torch.inference_mode():
                want, got = bundles[None].model(x), bundles[mode].model(x)
            max_err = max(max_err, (got - want).abs().max().item())
            rel.append(((got - want).norm() / want.norm()).item())
            first += int(got[0, -1].argmax() != want[0, -1].argmax())
        shared = [next((k for k, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), new)
                  for x, y in zip(outputs[None], outputs[mode], strict=True)]  # fmt: skip
        changed = sum(s < new for s in shared)
        print(f"{mode}: logits max |err| {max_err:.3f}, relative {statistics.mean(rel):.4f}; "
              f"next token differs on {first}/{len(ids)} prompts; continuation differs on "
              f"{changed}/{len(ids)}, mean shared prefix {statistics.mean(shared):.1f}/{new}")
    times: dict[object, list[float]] = {mode: [] for mode in bundles}
    for _ in range(args.repeats):
        for mode, b in bundles.items():
            start = time.perf_counter()
            greedy(b.model, [ids[0]], max_new_tokens=new, eos_id=None)
            times[mode].append(new / (time.perf_counter() - start))
    for mode, t in times.items():
        print(f"{mode or 'float32'}: {max(t):.1f} tokens/s best, {statistics.median(t):.1f} "
              "median (eager)")


if __name__ == "__main__":
    main()
