"""Tiling for the flash backend: which (query block, key block) tiles to visit, and how big.

A tile wholly above the causal diagonal, or wholly left of a sliding window, holds no visible
key and is skipped; a tile the diagonal or the window edge crosses is *partial* and gets its
mask built; every other tile is computed unmasked. Block sizes come from :data:`BLOCKS`,
measured on the development machine (see ``benchmarks/flash_blocks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCKS", "BlockPlan", "RowPlan", "block_sizes", "plan_blocks"]


@dataclass(frozen=True)
class BlockPlan:
    """One tile: queries ``[i0, i1)`` against keys ``[j0, j1)``; ``index`` is the key block."""

    i0: int
    i1: int
    j0: int
    j1: int
    index: int
    partial: bool
    alibi_shift: int


@dataclass(frozen=True)
class RowPlan:
    """One query block ``[i0, i1)`` and the tiles it must visit, left to right."""

    i0: int
    i1: int
    tiles: tuple[BlockPlan, ...]


def plan_blocks(
    T: int,
    S: int,
    bq: int,
    bk: int,
    causal: int | None,
    window: int | None,
    *,
    alibi_shift: int = 0,
) -> list[RowPlan]:
    """Tiles to compute for a ``T×S`` problem with the causal shift and window given.

    Query ``i`` sees key ``j`` iff ``j <= i + causal`` and ``j > i + causal - window`` (each
    condition only when set).
    """
    rows = []
    for i0 in range(0, T, bq):
        i1 = min(T, i0 + bq)
        tiles = []
        for index, j0 in enumerate(range(0, S, bk)):
            j1 = min(S, j0 + bk)
            partial = False
            if causal is not None:
                if j0 > i1 - 1 + causal:
                    continue  # every key of the tile is after every query's diagonal
                if window is not None and j1 - 1 <= i0 + causal - window:
                    continue  # every key is older than every query's window
                below = j1 - 1 <= i0 + causal
                inside = window is None or j0 > i1 - 1 + causal - window
                partial = not (below and inside)
            tiles.append(BlockPlan(i0, i1, j0, j1, index, partial, alibi_shift))
        rows.append(RowPlan(i0, i1, tuple(tiles)))
    return rows


# Measured best (bq, bk) on a 2-core AMD EPYC (1 MiB L2 per core, 32 MiB L3), B·H = 8,
# D = 64, by benchmarks/flash_blocks.py; keyed by dtype family.
BLOCKS = {
    "float32": (256, 512),
    "bfloat16": (256, 512),
    "float64": (128, 256),
}


# Decode path: at most this many queries use one query block against key blocks this long.
DECODE_ROWS = 16
DECODE_KEYS = 8192


def block_sizes(T: int, S: int, D: int, dtype: torch.dtype) -> tuple[int, int]:
    """Query and key block sizes for a problem; never larger than the problem itself."""
    family = {torch.float64: "float64", torch.float32: "float32"}.get(dtype, "bfloat16")
    bq, bk = BLOCKS[family]
    if T <= DECODE_ROWS:
        # Decoding (a few queries against a long cache): one query block and key blocks long
        # enough that the per-tile Python overhead vanishes; a tile is then only
        # (B, H, T, DECODE_KEYS) scores.
        return max(1, T), max(1, min(DECODE_KEYS, S))
    # Wide heads make each tile's matmuls heavier relative to its softmax: smaller tiles keep
    # the working set of q, k and v blocks in cache.
    if D > 128:
        bq, bk = bq // 2, bk // 2
    return max(1, min(bq, T)), max(1, min(bk, S))
