"""Prompt-lookup decoding against greedy search: SmolLM2-135M-Instruct asked to repeat a
paragraph, where most of the answer is in the prompt.

Both decode ``--tokens`` new tokens of the same chat prompt (the paragraph, then "Repeat the
paragraph above exactly."), alternating greedy and prompt lookup ``--repeats`` times; the best
time of each gives tokens/s. Prints both rates, the speed-up, the acceptance rate (accepted /
drafted draft tokens), the forwards each made, whether the tokens are identical, the CPU
instruction set and the thread count.

    python benchmarks/prompt_lookup.py [--tokens 128] [--repeats 3] [--ngram 3] [--draft 10]
"""

from __future__ import annotations

import argparse
import time

import torch

import qkv.pretrained
from common import machine_line
from qkv.generate import greedy, prompt_lookup, strip

PARAGRAPH = (
    "The lighthouse on the northern cape was built in 1874 from granite quarried two miles "
    "inland. For ninety years a keeper climbed its 132 steps every evening to light the lamp, "
    "wind the clockwork that turned the lens, and write the weather in a leather logbook. In "
    "1964 the light was automated, the keeper's cottage became a small museum, and the "
    "logbooks, now kept in the town library, are read by historians studying the storms of "
    "the North Sea."
)


def timed(fn):
    """``(seconds, result)`` of one call."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--draft", type=int, default=10)
    args = parser.parse_args()

    bundle = qkv.pretrained.load("SmolLM2-135M-Instruct")
    model, eos = bundle.model.eval(), bundle.eos_id
    ids = bundle.prompt_ids(f"{PARAGRAPH}\n\nRepeat the paragraph above exactly.")
    n = args.tokens

    def run_greedy() -> list[int]:
        return strip(greedy(model, [ids], max_new_tokens=n, eos_id=eos), eos)[0]

    def run_lookup():
        return prompt_lookup(model, ids, max_new_tokens=n, ngram=args.ngram, draft=args.draft,
                             eos_id=eos)  # fmt: skip

    run_greedy(), run_lookup()  # warm-up
    greedy_s, lookup_s = [], []
    for _ in range(args.repeats):  # alternating, so a disturbance hits both
        seconds, tokens = timed(run_greedy)
        greedy_s.append(seconds)
        seconds, result = timed(run_lookup)
        lookup_s.append(seconds)

    same = result.tokens == tokens
    print(f"SmolLM2-135M-Instruct, prompt {len(ids)} tokens, {len(tokens)} new tokens "
          f"(max {n}), ngram={args.ngram}, draft={args.draft}, best of {args.repeats}")  # fmt: skip
    print(f"greedy:        {len(tokens) / min(greedy_s):7.1f} tokens/s  (one forward a token)")
    print(f"prompt lookup: {len(result.tokens) / min(lookup_s):7.1f} tokens/s  "
          f"({result.forwards} forwards)")  # fmt: skip
    print(f"speed-up: {min(greedy_s) / min(lookup_s):.2f}x  acceptance: {result.acceptance:.1%} "
          f"({result.accepted} of {result.drafted} drafted)  identical tokens: {same}")  # fmt: skip
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    print(machine_line())
    print("output:", repr(bundle.tokenizer.decode(result.tokens)[:200]))


if __name__ == "__main__":
    main()
