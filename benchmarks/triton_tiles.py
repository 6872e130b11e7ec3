"""Sweep the triton backend's tile sizes on a GPU, beside torch's flash SDPA in the same run.

    python benchmarks/triton_tiles.py [--T 4096] [--D 128] [--out tiles.json] [--flex]

For B=4, H=16, T=S, bfloat16, causal and not: the forward of each (BLOCK_M, BLOCK_N, warps,
stages) in FORWARD and the backward of each in BACKWARD, timed with
``triton.testing.do_bench`` (median ms), with TFLOP/s and the ratio to torch's flash kernel.
What it prints is what :func:`qkv.attention.triton.plan.tiles` is chosen from.

``--dry-run``: every config once on CPU tensors in Triton's interpreter, tiny shapes, no
timing worth the name: what the test suite runs, so the sweep's own code cannot rot between
GPU sessions.

``--flex``: block-sparse ``qkv.flex_attention`` instead (B=2, T=16384, a document mask of 8
documents, 128 × 128 blocks), each FLEX_FORWARD config's forward and each FLEX_BACKWARD
pair's forward+backward: what :func:`qkv.attention.triton.plan.flex_tiles` is chosen from
(benchmarks/gpu.py's document case times the chosen one beside compiled flex).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

FORWARD = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
           (128, 64, 4, 3)]
BACKWARD = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2), (32, 64, 4, 2),
            (64, 32, 4, 2)]
# Flex: (BLOCK_M, BLOCK_N, warps, stages) of the forward; ((dQ tiles), (dK/dV tiles), warps,
# stages) of the backward. The first of each is flex_tiles' choice; (128, 128) was the last
# measured (H200: forward 1.68 ms, forward+backward 8.16 ms).
FLEX_FORWARD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                (128, 128, 8, 2)]
FLEX_BACKWARD = [((128, 64), (64, 128), 8, 3), ((128, 128), (128, 128), 8, 2),
                 ((64, 64), (64, 64), 4, 3), ((128, 64), (64, 128), 8, 2),
                 ((64, 64), (64, 64), 8, 2), ((128, 32), (32, 128), 8, 3)]


DRY = "--dry-run" in sys.argv
if DRY:  # before triton is imported: the kernels run in its interpreter, on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"


def _bench(fn) -> float:
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=40))


def _device() -> tuple[torch.device, str]:
    """The device and its name (the CPU under --dry-run)."""
    if DRY:
        return torch.device("cpu"), "CPU (--dry-run: Triton's interpreter)"
    return torch.device("cuda"), torch.cuda.get_device_name()


def _flex_sweep(D: int) -> list[dict]:
    """Time each FLEX_FORWARD and FLEX_BACKWARD config on the document mask; the records."""
    import qkv
    from qkv.attention.triton import plan as triton_plan
    from qkv.attention.triton.plan import Tiles

    dev, name = _device()
    B, H, T = (1, 2, 256) if DRY else (2, 16, 16384)
    doc = torch.arange(T, device=dev) // (T // 8)
    bm = qkv.create_block_mask(lambda b, h, i, j: doc[i] == doc[j], None, None, T, T,
                               device=dev)
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    chosen, records = triton_plan.flex_tiles, []
    opts = {"backend": "triton"}  # the kernels or an error: never the tile loop
    print(f"{name}  flex, document x8, B={B} H={H} T=S={T} D={D} bf16")
    runs = [("forward", c) for c in FLEX_FORWARD] + [("fwd+bwd", c) for c in FLEX_BACKWARD]
    for kind, c in runs:
        def forced(which, block_size, width, dtype, *rest, _k=kind, _c=c):
            if _k == "forward":
                return Tiles(*_c) if which == "forward" else chosen(which, block_size, width,
                                                                     dtype, *rest)
            if which == "forward":
                return chosen(which, block_size, width, dtype, *rest)
            return Tiles(*(_c[0] if which == "dq" else _c[1]), _c[2], _c[3])

        triton_plan.flex_tiles = forced
        try:
            if kind == "forward":
                ms = _bench(lambda: qkv.flex_attention(q, k, v, block_mask=bm,
                                                       kernel_options=opts))
            else:
                x = [t.clone().requires_grad_() for t in (q, k, v)]
                ms = _bench(lambda x=x: torch.autograd.grad(
                    qkv.flex_attention(*x, block_mask=bm, kernel_options=opts), x, do))
            note = f"{ms:.3f} ms"
        except Exception as e:  # a config that does not fit
            ms, note = None, f"{type(e).__name__}: {str(e)[:80]}"
        finally:
            triton_plan.flex_tiles = chosen
        print(f"  {kind:8s} {c}: {note}")
        records.append(dict(kind=kind, tiles=c, ms=ms))
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--out", default=None)
    p.add_argument("--flex", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreted, tiny shapes")
    a = p.parse_args(argv)
    if a.dry_run:
        a.T, a.D = 64, 32
    if a.flex:
        records = _flex_sweep(a.D)
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(dict(device=_device()[1], records=records), f, indent=1)
            os.replace(a.out + ".tmp", a.out)
        return 0
    import qkv
    from qkv.attention.triton import plan as triton_plan
    from qkv.attention.triton.plan import Tiles

    B, H, T, D = (1, 2, a.T, a.D) if DRY else (4, 16, a.T, a.D)
    dev, name = _device()
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    records = []
    chosen = triton_plan.tiles
    print(f"{name}  B={B} H={H} T=S={T} D={D} bf16")
    for causal in (False, True):
        flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        ref_f = _bench(lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c))
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        ins = (qg, kg, vg)
        ref_b = _bench(lambda o=out, i=ins: torch.autograd.grad(o, i, do, retain_graph=True))
        print(f"causal={causal}: torch flash fwd {ref_f:.3f} ms ({flops / ref_f / 1e9:.0f} "
              f"TFLOP/s), bwd {ref_b:.3f} ms")
        for kind, configs, ref in (("forward", FORWARD, ref_f), ("backward", BACKWARD, ref_b)):
            for m, n, w, s in configs:
                forced = Tiles(m, n, w, s)

                def tiles(which, rows, width, dtype, *rest, _f=forced, _k=kind):
                    # (*rest: the extras/dropout flags launches pass, which a forced tile
                    # ignores)
                    return _f if which == _k else chosen(which, rows, width, dtype, *rest)

                triton_plan.tiles = tiles
                try:
                    if kind == "forward":
                        ms = _bench(lambda c=causal: qkv.scaled_dot_product_attention(
                            q, k, v, is_causal=c, backend="triton"))
                    else:
                        o = qkv.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                             backend="triton")
                        ms = _bench(lambda o=o, i=ins: torch.autograd.grad(
                            o, i, do, retain_graph=True))
                    note = f"{ms:.3f} ms  x{ref / ms:.2f} of torch"
                except Exception as e:  # a config that does not fit shared memory
                    ms, note = None, f"{type(e).__name__}: {str(e)[:80]}"
                finally:
                    triton_plan.tiles = chosen
                print(f"  {kind:8s} causal={causal!s:5s} {m:3d}x{n:<3d} w{w} s{s}: {note}")
                records.append(dict(kind=kind, causal=causal, tiles=[m, n, w, s], ms=ms,
                                    torch_ms=ref))
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(device=name, T=T, D=D, records=records), f, indent=1)
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
