"""What a Triton launch runs with: tile sizes, key splits, and the launch plans kept for a
call's shapes (:func:`kept`), for :mod:`qkv.attention.triton.launch`.

Tiles are chosen for the GPU (an H100/H200 first) from what compiled well for sm_90
(``benchmarks/triton_static.py``) and what a GPU measured (``benchmarks/triton_tiles.py``);
under Triton's interpreter (CPU tensors, the test suite) every kernel takes 16×16 tiles so
small shapes still cross tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from qkv.attention.triton import interpreting

__all__ = ["Plan", "Tiles", "dropout_kind", "flex_tiles", "gpu_multiprocessors", "kept",
           "merge_launch", "pow2", "precision", "split_keys", "splits", "tile_options", "tiles",
           "width_flags"]


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch options of one kernel."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    resident: int = 2  # programs a multiprocessor holds at once (what key splits fill)


def pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


def tiles(kind: str, rows: int, width: int, dtype: torch.dtype, extras: bool = False,
          dropout: bool = False) -> Tiles:
    """Tiles for ``kind`` (``"forward"``, ``"backward"`` or ``"paged"``) of ``rows`` packed
    query rows and head width ``width`` (the larger of ``D`` and ``Dv``, padded to a power of
    two); ``extras``: the kernel also reads a mask or ALiBi slopes, or computes dropout's
    mask, each tile; ``dropout``: it computes dropout's mask.

    Interpreted (CPU) runs take 16×16 tiles, so small test shapes still cross tiles. On a GPU,
    wider heads and float32 (twice the bytes a tile) take smaller tiles to fit shared memory.
    """
    if interpreting():
        return Tiles(16, 16, 1, 1)
    width = pow2(width)
    wide = width > 128 or dtype == torch.float32
    if kind == "paged":
        # Each key row's address comes from its page: more registers than a dense tile
        # (sm_90, a decoding step: 64 keys, 4 warps and 3 stages took 175 registers, 2
        # programs a multiprocessor; 2 stages 158, 3 programs; benchmarks/triton_static.py).
        if rows <= 16:
            return Tiles(pow2(rows), 32 if wide else 64, 4, 2, 3)
        return Tiles(64, 32 if wide else 64, 4, 2)
    if kind == "forward":
        # Measured on an H200 (benchmarks/triton_tiles.py, bf16, D = 128, T = 4096, the
        # edge/inner kernels): 128×128 tiles with 8 warps 1.15 ms, 128×64/8 1.25, 64×64/4 1.27.
        # With a mask or ALiBi, 128×128 tiles overflow shared memory (a (T, S) bool mask:
        # 262,144 of 232,448 bytes) or registers (ALiBi 1.91 ms against 1.15 with 64×64/4).
        # Dropout's Philox tile needs registers of its own: 64×64 with it spilled 136 bytes
        # and held one program a multiprocessor, 64×32 spills none and holds two (sm_90,
        # T = 4096, benchmarks/triton_static.py; unmeasured on a GPU).
        m, n, warps = ((64, 32, 4) if wide or dropout else (64, 64, 4) if extras
                       else (128, 128, 8) if width > 64 else (128, 64, 4))
        if rows < m:  # decoding: the group's rows in one tile
            # 64 keys a tile and 4 warps, as a decoding step streams keys: 104 registers and
            # 70 KiB of shared memory, so 3 programs a multiprocessor, where 128 keys with 8
            # warps held one (sm_90, benchmarks/triton_static.py; unmeasured on a GPU).
            return Tiles(pow2(rows), min(n, 64), 4, 2 if wide else 3, 2 if wide else 3)
        return Tiles(m, n, warps, 2 if wide else 3)
    if wide:
        return Tiles(32, 32, 4, 2)
    # With a mask, ALiBi or dropout each score, 64×64 tiles spill in dK/dV (sm_90, T = 4096,
    # causal: ALiBi 376 bytes a thread, dropout 432); 64 queries × 32 keys spill nothing with
    # ALiBi, 24 bytes with dropout, none in dQ (benchmarks/triton_static.py; unmeasured on a
    # GPU). Plain calls keep the 64×64 the H200 tile sweep chose.
    return Tiles(64, 32, 4, 2) if extras else Tiles(64, 64, 4, 2)


def precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not interpreting() and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def dropout_kind(keep: Tensor | None) -> int:
    """The kernels' ``DROPOUT``: 0 none, 1 a drawn keep mask ``(B, H, T, S)`` bool, 2 the
    counter-based mask of a ``(2,)`` int64 state (:func:`qkv.attention.dropout.dropout_state`)."""
    if keep is None:
        return 0
    return 1 if keep.dtype == torch.bool else 2


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gpu_multiprocessors(device: torch.device) -> int | None:
    """The GPU's multiprocessor count; None for CPU tensors (the interpreter)."""
    return None if device.type == "cpu" else _multiprocessors(device.index or 0)


def splits(q: Tensor, programs: int, S: int, block_n: int, per_sm: int = 2) -> int:
    """Key splits for a launch of ``programs`` programs: enough for ``per_sm`` programs on
    every multiprocessor (the most that fit at once: no second, partial wave), with at least
    256 keys (4 tiles under the interpreter) in each."""
    sms = gpu_multiprocessors(q.device)
    units = 4 if sms is None else per_sm * sms
    least = 4 * block_n if sms is None else 256
    return max(1, min(units // programs or 1, S // least))


class Plan(NamedTuple):
    """What a forward or paged launch passes besides the call's tensors, strides and scalars:
    worked out once for its shapes and flags (:func:`kept`)."""

    grid: tuple[int, int, int]
    splits: int
    split_len: int
    options: dict  # the kernel's constexprs and launch options
    merge_grid: tuple[int]  # the merge of the splits (unused with one)
    merge_options: dict


# (shapes, dtype, device, flags, and what else decides a plan) -> Plan
_PLANS: dict[tuple, Plan] = {}
_PLANS_MAX = 64


def kept(key: tuple, make) -> Plan:
    """The plan kept for ``key``, else ``make()``, kept. The layers of a decoding step call
    with the same shapes: about 3 µs of host time a call less. What else decides a plan is
    part of the key: the interpreter, TF32, and the functions :func:`tiles` and
    ``gpu_multiprocessors``, so replacing them (the tile sweep, the stand-in GPU of
    :mod:`qkv.bench.triton_static`) takes effect."""
    key = (*key, interpreting(), torch.backends.cuda.matmul.allow_tf32, tiles,
           gpu_multiprocessors)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = make()
    return plan


def width_flags(dtype: torch.dtype, D: int, Dv: int) -> dict:
    """The constexprs every kernel takes for ``D``/``Dv``-wide heads in ``dtype``: the
    padded widths, whether they are the heads' own (``EVEN_D``), the multiply's precision,
    and ``UPCAST`` (bfloat16 under the interpreter)."""
    block_d, block_dv = pow2(D), pow2(Dv)
    return dict(PRECISION=precision(dtype), UPCAST=interpreting() and dtype == torch.bfloat16,
                BLOCK_D=block_d, BLOCK_DV=block_dv, EVEN_D=block_d == D and block_dv == Dv)


def tile_options(t: Tiles) -> dict:
    return dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages)


def merge_launch(rows: int, Dv: int) -> tuple[tuple[int], dict]:
    """Grid and options of the merge of ``rows`` rows' key splits: 4 rows a program, 16 splits
    a load (a decoding step's few rows over more programs, its splits read at once: a
    (16, 4, 128) float32 tile is 64 registers a thread)."""
    block = 4
    return (-(-rows // block),), dict(BLOCK_R=block, BLOCK_DV=pow2(Dv), BLOCK_S=16,
                                      num_warps=4, num_stages=3)


def split_keys(S: int, n: int, block_n: int) -> tuple[int, int]:
    """``(splits, keys a split)``: ``n`` splits of ``S`` keys, each a whole number of tiles."""
    split_len = -(-S // n)  # ceil
    split_len = -(-split_len // block_n) * block_n
    return -(-S // split_len), split_len


def flex_tiles(kind: str, block_size: tuple[int, int], width: int,
               dtype: torch.dtype, dropout: bool = False) -> Tiles:
    """Tiles of the flex kernel ``kind`` (``"forward"``, ``"dq"`` or ``"dkdv"``) for a block
    mask of ``block_size`` ``(bq, bk)`` and head width ``width`` (the larger of ``D`` and
    ``Dv``): each side at most its block (which it divides: both are powers of two).

    On a GPU these are torch's own choices for its flex kernels on Hopper (bf16/fp16: the
    forward 128 × 64 with 8 warps and 3 stages, the backward 64-row query tiles against
    128-key tiles for dK/dV and 128 × 64 for dQ), which hold no spilled registers where
    128 × 128 spilled 1 KiB a thread in dK/dV (``python -m benchmarks.triton_static``).
    With dropout, ``dK``/``dV`` takes 32-row query tiles: its Philox tile, computed and
    transposed each step, spilled 496 bytes a thread at 64 rows, 160 at 32 (document mask,
    T = 1024). Interpreted (CPU) runs take 16 × 16, so small block masks still cross tiles.
    """
    bq, bk = block_size
    if interpreting():
        m, n, warps, stages = 16, 16, 1, 1
    else:
        width = pow2(width)
        if dtype == torch.float32 or width > 128:
            m, n, warps, stages = (32, 32, 4, 2) if kind == "forward" else (32, 32, 4, 1)
        elif kind == "forward":
            m, n, warps, stages = (128, 64, 8, 3) if width > 64 else (128, 128, 4, 3)
        else:
            m, n, warps, stages = {"dq": (128, 64, 8, 3),
                                   "dkdv": (32 if dropout else 64, 128, 8, 3)}[kind]
    return Tiles(min(m, bq), min(n, bk), warps, stages)
