"""qkv's linear layers on MKL (``F.linear``) against oneDNN: what ``qkv.nn.linear``'s rule rests on.

Usage::

    .venv/bin/python benchmarks/linear_kernels.py            # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/linear_kernels.py --quick    # 1 round, short runs

SmolLM2-135M-Instruct in float32, eager, in one process, rounds alternating the settings of
``qkv.nn.linear.KERNEL``: ``"blas"`` (every call on MKL, as ``nn.Linear``), ``"auto"`` (the
default: oneDNN for a prompt's rows, and for one row where :data:`qkv.nn.linear.ONE_ROW`
says so on this CPU) and ``"onednn"`` (every eligible call on oneDNN, one row included).
Per setting: a 512-token and a 32-token prompt through the model (prompt tokens/s) and
``greedy`` over a 32-token prompt then 128 tokens ((32 + 128) / s), min and median of the
rounds; and one-row F.linear against oneDNN over the model's own matrices (GB/s of weights).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import qkv.pretrained
from common import machine_line
from qkv.generate import greedy
from qkv.nn import linear as linear_mod

SETTINGS = ("blas", "auto", "onednn")


def one_round(model: torch.nn.Module, ids: torch.Tensor, new: int) -> dict[str, float]:
    out = {}
    with torch.inference_mode():
        for n in (512, 32):
            start = time.perf_counter()
            model(ids[:, :n])
            out[f"pp{n}"] = n / (time.perf_counter() - start)
        start = time.perf_counter()
        greedy(model, ids[:, :32].tolist(), max_new_tokens=new, eos_id=None)
        out[f"pg32+{new}"] = (32 + new) / (time.perf_counter() - start)
    return out


def gemv_bandwidth(model: torch.nn.Module, repeats: int) -> dict[str, float]:
    """GB/s of weights read by one-row products over every linear weight of ``model``."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    size = sum(w.numel() * w.element_size() for w in weights)
    kernels = {"MKL (F.linear)": lambda x, w: F.linear(x, w),
               "oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none",
                                                                        [], "")}  # fmt: skip
    out = {}
    with torch.inference_mode():
        for name, fn in kernels.items():
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for w in weights:
                    fn(rows[w.shape[1]], w)
                best = min(best, time.perf_counter() - start)
            out[name] = size / best / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 3)
    new = 16 if args.quick else 128
    print(machine_line())
    print(f"qkv.nn.linear.ONE_ROW on this CPU: {linear_mod.ONE_ROW}")
    model = qkv.pretrained.load("SmolLM2-135M-Instruct").model
    ids = torch.randint(0, model.config.vocab_size, (1, 512),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    try:
        one_round(model, ids, 4)  # warm-up, untimed
        for _ in range(rounds):
            for setting in SETTINGS:
                linear_mod.KERNEL = setting
                runs[setting].append(one_round(model, ids, new))
    finally:
        linear_mod.KERNEL = "auto"
    tests = list(runs["blas"][0])
    print(f"SmolLM2-135M-Instruct float32 eager, {args.threads} threads, tokens/s, "
          f"min | median of {rounds} alternating rounds")  # fmt: skip
    print(f"{'KERNEL':<10}" + "".join(f"{t:>20}" for t in tests))
    for setting, rows in runs.items():
        cells = [f"{min(r[t] for r in rows):.1f} | {statistics.median(r[t] for r in rows):.1f}"
                 for t in tests]  # fmt: skip
        print(f"{setting:<10}" + "".join(f"{c:>20}" for c in cells))
    for name, gbs in gemv_bandwidth(model, 3 if args.quick else 7).items():
        print(f"one-row products over the model's matrices, {name}: {gbs:.1f} GB/s (best)")


if __name__ == "__main__":
    main()
