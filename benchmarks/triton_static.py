"""The triton backend's kernels as compiled for a GPU, on a machine without one.

    python -m benchmarks.triton_static [--arch 90] [--sms 132] [--cases decode,flex] [--json F]

Runs qkv's launch code for the GPU benchmark's shapes (benchmarks/gpu.py: B=4, H=16, D=128,
bfloat16; decoding H=32 over Hkv=8; paged decoding 8 sequences of 4096 positions in pages of
16) on CPU tensors, compiles every launch with Triton's own JIT for ``sm_<arch>`` and
prints, per kernel: tiles, warps, stages, registers, spilled bytes, shared memory, whether the
loads are pipelined, programs per multiprocessor, the two largest loop bodies in machine
instructions (and how many of them read or write spilled registers) and the grid. Nothing is
timed: see :mod:`qkv.bench.triton_static`. Needs triton; TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch

B, H, D = 4, 16, 128
BF16 = torch.bfloat16


def _dense(T, causal, bwd, alibi=False, window=None, Hq=H, Hkv=H, S=None, dropout_p=0.0):
    from qkv.attention.backends.triton_kernel import _Spec
    from qkv.attention.triton import launch as L

    S = S or T

    def call():
        q = torch.empty(B, Hq, T, D, dtype=BF16)
        k, v = (torch.empty(B, Hkv, S, D, dtype=BF16) for _ in range(2))
        slopes = torch.ones(Hq) if alibi else None
        spec = _Spec(scale=D ** -0.5, causal=0 if causal else None, window=window,
                     alibi_shift=0, dropout_p=dropout_p)
        # dropout as on a GPU: the Philox state (seed, threshold), the mask made in the kernels
        keep = torch.tensor([1234, round(dropout_p * 2**16)]) if dropout_p else None
        out, lse = L.forward(q, k, v, None, slopes, keep, spec)
        if bwd:
            L.backward(q, k, v, out, lse, torch.empty_like(out), None, None, slopes, keep, spec)
    return call


def _document(bwd, T=16384, docs=8):
    import qkv
    from qkv.attention.flex import triton_path as flex_triton
    from qkv.attention.triton import launch as L

    def call():
        doc = torch.arange(T) // (T // docs)
        bm = qkv.create_block_mask(lambda b, h, i, j: doc[i] == doc[j], None, None, T, T)
        q, k, v = (torch.empty(2, H, T, D, dtype=BF16) for _ in range(3))
        tab, mod = flex_triton.tables(bm, q.device), flex_triton.ScoreMod()
        out, lse = L.flex_forward(q, k, v, tab, bm, D ** -0.5, mod)
        if bwd:
            L.flex_backward(q, k, v, out, lse, torch.empty_like(out), None, tab, bm,
                            D ** -0.5, mod)
    return call


def _paged(B=8, S=4096, page=16):
    from qkv.attention.triton import launch as L

    def call():
        q = torch.empty(B, 32, 1, D, dtype=BF16)
        k_pool, v_pool = (torch.empty(B * S // page, 8, page, D, dtype=BF16) for _ in range(2))
        tables = torch.arange(B * S // page).reshape(B, S // page)
        L.paged_forward(q, k_pool, v_pool, tables, torch.full((B, 1), S - 1), D ** -0.5)
    return call


CASES = {
    "dense": lambda: _dense(4096, False, True),
    "causal": lambda: _dense(4096, True, True),
    "alibi": lambda: _dense(4096, True, False, alibi=True),
    "window": lambda: _dense(4096, True, False, window=1024),
    "dropout": lambda: _dense(4096, True, True, dropout_p=0.1),
    "decode": lambda: _dense(1, False, False, Hq=32, Hkv=8, S=32768),
    "flex": lambda: _document(True),
    "paged": _paged,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import triton

    from qkv.bench.triton_static import compiled_launches

    print(f"sm_{a.arch}, {a.sms} multiprocessors; triton {triton.__version__}, torch "
          f"{torch.__version__}; B={B} H={H} D={D} bf16 (decode: H=32 Hkv=8 S=32768)")
    print(f"{'case':8} {'kernel':28} {'tiles':>9} {'w':>2} {'st':>2} {'regs':>4} "
          f"{'spill B':>7} {'smem KiB':>8} {'pipe':>4} {'prog/SM':>7}  {'loops':16} grid")
    rows = []
    for name in a.cases.split(","):
        for c in compiled_launches(CASES[name](), a.arch, a.sms):
            o = c.options
            tiles = f"{o.get('BLOCK_M', o.get('BLOCK_R', ''))}x{o.get('BLOCK_N', '')}"
            print(f"{name:8} {c.kernel:28} {tiles:>9} {c.warps:>2} {o['num_stages']:>2} "
                  f"{c.registers:>4} {c.spill_bytes:>7} {c.shared_bytes / 1024:>8.1f} "
                  f"{'yes' if c.pipelined else 'no':>4} {c.programs_per_sm():>7}  "
                  f"{_loops(c.loops):16} {c.grid}")
            rows.append(dict(case=name, kernel=c.kernel, grid=c.grid, options=o,
                             registers=c.registers, spill_bytes=c.spill_bytes,
                             shared_bytes=c.shared_bytes, pipelined=c.pipelined,
                             programs_per_sm=c.programs_per_sm(), loops=c.loops))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _loops(loops) -> str:
    """The two largest loop bodies: ``instructions(local loads and stores)``."""
    return " ".join(f"{n}({local})" for n, local in loops[:2]) or "-"


if __name__ == "__main__":
    sys.exit(main())
