"""Attention sinks against a plain rolling window: perplexity of SmolLM2-135M-Instruct on a long
text read in flat memory (Xiao et al., 2023, section 4.1).

The text is the standard library's docstrings (``qkv.data.text.stdlib_corpus``, on every
machine), ``--tokens`` of it. Three runs, each token predicted once:

* ``sinks``: a cache of the first 4 positions and the last ``--recent`` (positions re-based);
* ``rolling``: the last ``--recent + 4`` positions only (no sinks; positions re-based);
* ``windows``: the text cut into pieces of ``--recent + 4`` tokens, each read afresh with a
  full cache (every token sees only the earlier tokens of its piece): the full-cache baseline
  on the window's length.

The text is fed ``--chunk`` tokens per forward (a chunk's queries see the cache and the
chunk). Prints perplexity over the whole text and per quarter, the CPU and threads.

    python -m benchmarks.sinks [--tokens 20000] [--recent 1020] [--chunk 64]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import qkv.pretrained
from qkv.data.text import stdlib_corpus


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(T,)`` negative log-likelihoods of ``targets (T,)`` under ``logits (T, V)``."""
    return -logits.float().log_softmax(-1).gather(1, targets[:, None])[:, 0]


@torch.no_grad()
def streamed(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Per-token NLL (tokens 1..N-1) reading ``ids (N,)`` through ``cache`` chunk by chunk."""
    out, previous = [], None
    for start in range(0, ids.shape[0], chunk):
        piece = ids[start : start + chunk]
        logits = model(piece[None], cache=cache)[0]  # (T, V)
        if previous is not None:
            out.append(nll(previous[None], piece[:1]))
        out.append(nll(logits[:-1], piece[1:]))
        previous = logits[-1]
    return torch.cat(out)


@torch.no_grad()
def windows(model, ids: torch.Tensor, size: int, chunk: int) -> torch.Tensor:
    """Per-token NLL with the text cut into pieces of ``size`` read afresh (full caches)."""
    out = []
    for start in range(0, ids.shape[0], size):
        piece = ids[start : start + size]
        got = streamed(model, piece, model.new_cache(), chunk)
        out.append(got if start == 0 else torch.cat([torch.full((1,), float("nan")), got]))
    return torch.cat(out)


def perplexity(values: torch.Tensor) -> float:
    values = values[~values.isnan()]
    return math.exp(float(values.mean()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--recent", type=int, default=1020)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    bundle = qkv.pretrained.load("SmolLM2-135M-Instruct")
    model = bundle.model
    text = stdlib_corpus(max_chars=args.tokens * 8, kind="docstrings")
    ids = torch.tensor(bundle.tokenizer.encode(text)[: args.tokens])
    size = args.recent + 4
    runs = {
        "sinks": lambda: streamed(model, ids, model.new_cache(recent=args.recent, sinks=4),
                                  args.chunk),
        "rolling": lambda: streamed(model, ids, model.new_cache(recent=size, sinks=0),
                                    args.chunk),
        "windows": lambda: windows(model, ids, size, args.chunk),
    }
    print(f"SmolLM2-135M-Instruct, {ids.shape[0]} tokens of stdlib docstrings, cache "
          f"{size} positions, chunks of {args.chunk}; CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    results = {}
    for name, run in runs.items():
        start = time.perf_counter()
        values = run()
        quarters = [perplexity(q) for q in values.chunk(4)]
        results[name] = {"perplexity": perplexity(values), "quarters": quarters,
                         "seconds": time.perf_counter() - start}  # fmt: skip
        print(f"{name:8s} perplexity {results[name]['perplexity']:9.2f}   by quarter "
              + " ".join(f"{q:9.2f}" for q in quarters)
              + f"   ({results[name]['seconds']:.0f} s)")  # fmt: skip
    ratio = results["sinks"]["perplexity"] / results["windows"]["perplexity"]
    print(f"sinks / windows: {ratio:.3f}; rolling / windows: "
          f"{results['rolling']['perplexity'] / results['windows']['perplexity']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
