"""Sweep the flash backend's block sizes on this machine (a script, not a test).

Prints forward time (min of repeats) for each (bq, bk) and dtype at B=1, H=8, D=64, beside
torch's kernel, so the table in ``qkv/attention/flash_blocks.py`` comes from a measurement.

    python benchmarks/flash_blocks.py --T 1024 4096 --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from qkv.attention.backends import flash
from qkv.attention.call import make_call


def best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    print(f"threads={torch.get_num_threads()}  B=1 H=8 D=64  causal={args.causal}")
    for name in args.dtype:
        dtype = getattr(torch, name)
        for T in args.T:
            q, k, v = (torch.randn(1, 8, T, 64, dtype=dtype) for _ in range(3))
            def fused(q=q, k=k, v=v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)

            ref = best_time(fused, args.repeats)
            print(f"\n{name} T={T}: torch {ref * 1e3:.1f} ms")
            call = make_call(q, k, v, None, 0.0, args.causal, None, False, False)
            for bq in args.blocks:
                row = []
                for bk in args.blocks:
                    def blockwise(call=call, bq=bq, bk=bk):
                        return flash.attend(call, block_q=bq, block_k=bk)

                    t = best_time(blockwise, args.repeats)
                    row.append(f"{bk}:{t * 1e3:7.1f} ({ref / t:.2f}x)")
                print(f"  bq={bq:5d}  " + "  ".join(row))


if __name__ == "__main__":
    main()
