"""The host time one attention call costs beyond its kernels: decoding-size calls (one query,
a short cache) where the kernels take microseconds, so the wall time per call is the Python
and launch overhead. Prints microseconds per call of torch's SDPA and of qkv's (auto and the
named backends) side by side, then, with --profile, the functions qkv's calls spend it in.

    python benchmarks/call_overhead.py [--device cuda] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import qkv
from qkv.bench.measure import machine_line


def per_call_us(fn, device: torch.device, n: int) -> float:
    for _ in range(20):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    B, H, Hkv, S, D = 4, 32, 8, 256, 128  # one decoding step of a GQA model
    q = torch.randn(B, H, 1, D, device=dev, dtype=dtype)
    k, v = (torch.randn(B, Hkv, S, D, device=dev, dtype=dtype) for _ in range(2))
    gpu = f"{torch.cuda.get_device_name()}; " if dev.type == "cuda" else ""
    print(f"{gpu}{machine_line()}\nq {tuple(q.shape)} k {tuple(k.shape)} {dtype}")
    calls = {"torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    for backend in ["auto", *qkv.attention.backends.PREFERENCE]:
        def fn(b=backend):
            return qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=b)

        try:
            fn()
        except qkv.attention.errors.AttentionArgumentError as e:
            print(f"  qkv {backend}: not run here ({str(e).split(': ', 1)[-1]})")
            continue
        calls[f"qkv {backend}"] = fn
    for name, fn in calls.items():
        print(f"  {name:14s} {per_call_us(fn, dev, args.calls):8.1f} us/call")
    if args.profile:
        for name, fn in calls.items():
            if name.startswith("qkv"):
                prof = cProfile.Profile()
                prof.runcall(lambda fn=fn: [fn() for _ in range(args.calls)])
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
                print(f"--- {name}: top functions by own time over {args.calls} calls")
                print("\n".join(out.getvalue().splitlines()[6:22]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
