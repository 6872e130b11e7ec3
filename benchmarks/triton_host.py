"""The host time of a triton-backend decoding step, measured without a GPU.

    python benchmarks/triton_host.py [--calls 3000]

On a GPU a decoding step's kernels take microseconds, so the host's work decides its latency
(an H200 run measured qkv's triton path at 98 us a call against 16 us for torch's SDPA,
docs/gpu.md). Two parts of it run the same on any CPU, and this script times them:

1. **qkv's own work** for ``qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True,
   backend="triton")`` (validation, dispatch, tiles and splits, the output buffers), with the
   two Triton launches replaced by no-ops (a child process with ``TRITON_INTERPRET=1``, so
   the backend accepts CPU tensors), beside torch's SDPA on a tiny CPU call (the floor of
   one Python call into torch).
2. **Triton's own JIT work per launch** (binding and specialising the arguments, the cache
   lookup, the launch metadata), each kernel compiled once for a stand-in sm_90 driver
   (:mod:`qkv.bench.triton_static`) and its launcher replaced by a no-op, beside qkv's kept
   launch of the same compiled kernel (:mod:`qkv.attention.triton.fast`, what qkv's launches
   take from the second on).

What neither includes: the C launcher and the CUDA driver (a few microseconds a launch) and
CUDA's allocator. Shapes: one decoding step of the GPU benchmark, B=4, H=32 over Hkv=8,
D=128, S=4096, bfloat16 for the compile, float32 on the CPU path.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

B, H, HKV, S, D = 4, 32, 8, 4096, 128


def _per_call_us(fn, n: int) -> float:
    for _ in range(min(200, n)):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _qkv_host(n: int) -> None:
    """(child, TRITON_INTERPRET=1) qkv's host work a triton call, launches stubbed."""
    import torch
    import torch.nn.functional as F

    import qkv
    from qkv.attention.triton import kernels as triton_kernels

    torch.set_num_threads(1)

    class _NoLaunch:  # a kernel whose launch does nothing (qkv's launch code still runs)
        def __init__(self, kernel):
            self.__name__ = kernel.__name__

        def __getitem__(self, grid):
            return lambda *args, **options: None

    for name in ("attention_forward", "merge_splits"):
        setattr(triton_kernels, name, _NoLaunch(getattr(triton_kernels, name)))
    q = torch.randn(B, H, 1, D)
    k, v = (torch.randn(B, HKV, S, D) for _ in range(2))
    tiny_q, tiny_k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 4, 8)
    floor = _per_call_us(lambda: F.scaled_dot_product_attention(tiny_q, tiny_k, tiny_k,
                                                                enable_gqa=True), n)
    host = _per_call_us(lambda: qkv.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, backend="triton"), n)
    print(f"  torch SDPA, a tiny CPU call (the floor of a call into torch) {floor:8.1f} us")
    print(f"  qkv triton call, its 2 launches stubbed (qkv's own host work)  {host:8.1f} us")


def _triton_jit(n: int) -> None:
    """Triton's JIT work per launch of the decoding step's kernels (stand-in sm_90)."""
    import torch

    from qkv.attention.backends.triton_kernel import _Spec
    from qkv.attention.triton import fast as triton_fast
    from qkv.attention.triton import launch as triton_launch
    from qkv.attention.triton import plan as triton_plan
    from qkv.bench.triton_static import launches_recorded

    launches = []

    def record(kernel, grid, args, options):
        kernel.warmup(*args, grid=grid, **options)  # compiled once, here
        launches.append((kernel, grid, args, options))

    launch, sms = triton_launch._launch, triton_plan.gpu_multiprocessors
    with launches_recorded(90):  # every compiled kernel's launch a no-op
        triton_launch._launch = record
        triton_plan.gpu_multiprocessors = lambda device: 132
        try:
            q = torch.empty(B, H, 1, D, dtype=torch.bfloat16)
            k, v = (torch.empty(B, HKV, S, D, dtype=torch.bfloat16) for _ in range(2))
            triton_launch.forward(q, k, v, None, None, None,
                                  _Spec(D ** -0.5, None, None, 0, 0.0))
        finally:
            triton_launch._launch = launch
            triton_plan.gpu_multiprocessors = sms
        for kernel, grid, args, options in launches:
            us = _per_call_us(lambda k=kernel, g=grid, a=args, o=options: k[g](*a, **o), n)
            fast = _per_call_us(lambda k=kernel, g=grid, a=args, o=options:
                                triton_fast.launch(k, g, a, o), n)
            print(f"  Triton JIT, {kernel.__name__} ({len(args)} arguments){'':12} "
                  f"{us:8.1f} us a launch; qkv's kept launch (triton_fast) {fast:5.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _qkv_host(a.calls)
        return 0
    import torch

    from qkv.bench.measure import machine_line

    print(f"{machine_line()}; one thread\ndecoding step q ({B}, {H}, 1, {D}), k/v ({B}, {HKV}, "
          f"{S}, {D})")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    child = subprocess.run([sys.executable, __file__, "--child", "--calls", str(a.calls)],
                           env=env, capture_output=True, text=True)
    print(child.stdout, end="")
    if child.returncode:
        print(child.stderr[-2000:], file=sys.stderr)
        return child.returncode
    torch.set_num_threads(1)
    _triton_jit(a.calls)
    return 0


if __name__ == "__main__":
    if "--child" not in sys.argv:
        os.environ.pop("TRITON_INTERPRET", None)  # (the JIT part compiles)
    sys.exit(main())
