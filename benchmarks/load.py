"""How much qkv slows down when another process keeps one core busy, beside torch's kernels.

    python benchmarks/load.py [--T 4096] [--repeats 5] [--threads 2] [--out FILE.json]

Each call is timed twice in one run: on a quiet machine, then with one busy process beside it
(:func:`qkv.bench.measure.busy_core`: a Python loop, the load of a browser tab or a data loader
on a two-core machine). Its *slowdown* is loaded / quiet (minimum over ``--repeats``); the
number that matters is qkv's slowdown over the reference's on the same call (at most 1.5 is the
project's target). Calls, B=1, H=8, D=64, float32:

* flex: document (8 documents), sliding window 256, prefix-LM (T/4), soft-cap 30 + causal at
  ``--T``; the reference is ``torch.compile(flex_attention)``.
* flash forward, causal, T=2048: qkv's ``flash`` backend against torch's SDPA kernel.
* decode: one query against 4096 cached keys: qkv ``auto`` against torch's SDPA kernel.

Every line names the CPU, its instruction set, the threads and the date; a timing whose repeats
spread (median/min > 1.5) is marked "unstable" (something else ran).
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as tf

import qkv
from common import busy_core, machine_info, machine_line, time_interleaved, unstable

CAP = 30.0


def _flex_cases(T: int, compiled) -> dict[str, tuple[Callable, Callable]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, T, 64, generator=g) for _ in range(3))
    docs = torch.arange(T) // (T // 8)
    mods = {
        "flex document": (None, lambda b, h, i, j: docs[i] == docs[j]),
        "flex window256": (None, lambda b, h, i, j: (i >= j) & (i - j < 256)),
        "flex prefix-lm": (None, lambda b, h, i, j: (j < T // 4) | (i >= j)),
        "flex softcap": (lambda s, b, h, i, j: CAP * torch.tanh(s / CAP),
                         lambda b, h, i, j: i >= j),
    }
    cases = {}
    for name, (score, mask) in mods.items():
        ours = qkv.create_block_mask(mask, None, None, T, T)
        theirs = tf.create_block_mask(mask, None, None, T, T, device="cpu")
        cases[name] = (
            lambda score=score, ours=ours: qkv.flex_attention(q, k, v, score, ours),
            lambda score=score, theirs=theirs: compiled(q, k, v, score, theirs),
        )
    return cases


def _kernel_cases() -> dict[str, tuple[Callable, Callable]]:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 2048, 64, generator=g) for _ in range(3))
    q1, kc, vc = (torch.randn(1, 8, n, 64, generator=g) for n in (1, 4096, 4096))
    return {
        "flash fwd causal T=2048": (
            lambda: qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend="flash"),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "decode S=4096": (
            lambda: qkv.scaled_dot_product_attention(q1, kc, vc),
            lambda: F.scaled_dot_product_attention(q1, kc, vc)),
    }


def _times(fns: dict[str, Callable], repeats: int) -> dict[str, list[float]]:
    """Interleaved timings (seconds per call) after one warm-up call each."""
    runs = time_interleaved(fns, warmup=1, repeats=repeats)
    return {name: times for name, (times, _) in runs.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096, help="length of the flex calls")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    compiled = torch.compile(tf.flex_attention, dynamic=False)
    cases = {**_flex_cases(a.T, compiled), **_kernel_cases()}
    info = machine_info()
    print(f"slowdown under one busy core, {machine_line(info)}; min of {a.repeats} runs, ms")
    print(f"{'call':26}{'qkv quiet':>10}{'loaded':>9}{'ref quiet':>10}{'loaded':>9}"
          f"{'qkv x':>7}{'ref x':>7}{'qkv/ref':>9}")
    rows = []
    with torch.no_grad():
        for name, (ours, ref) in cases.items():
            quiet = _times({"qkv": ours, "ref": ref}, a.repeats)
            with busy_core():
                loaded = _times({"qkv": ours, "ref": ref}, a.repeats)
            row = _row(name, quiet, loaded)
            rows.append(row)
            flags = [k for k in ("qkv quiet", "ref quiet") if row["unstable"][k]]
            print(f"{name:26}{row['qkv_quiet_ms']:10.1f}{row['qkv_loaded_ms']:9.1f}"
                  f"{row['ref_quiet_ms']:10.1f}{row['ref_loaded_ms']:9.1f}"
                  f"{row['qkv_slowdown']:7.2f}{row['ref_slowdown']:7.2f}{row['ratio']:9.2f}"
                  + (f"  unstable ({', '.join(flags)}): another process was running"
                     if flags else ""), flush=True)  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": info, "args": vars(a), "rows": rows}, f, indent=1)


def _row(name: str, quiet: dict, loaded: dict) -> dict:
    ms = {f"{who}_{when}_ms": min(times[who]) * 1e3
          for when, times in (("quiet", quiet), ("loaded", loaded)) for who in ("qkv", "ref")}
    qkv_x = ms["qkv_loaded_ms"] / ms["qkv_quiet_ms"]
    ref_x = ms["ref_loaded_ms"] / ms["ref_quiet_ms"]
    return {"call": name, **ms, "qkv_slowdown": qkv_x, "ref_slowdown": ref_x,
            "ratio": qkv_x / ref_x,
            "median_ms": {f"{who} {when}": statistics.median(t[who]) * 1e3
                          for when, t in (("quiet", quiet), ("loaded", loaded))
                          for who in ("qkv", "ref")},
            "unstable": {f"{who} quiet": unstable(quiet[who]) for who in ("qkv", "ref")}}


if __name__ == "__main__":
    main()
