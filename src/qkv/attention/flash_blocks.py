"""Tiling for the flash backend: which (query block, key block) tiles to visit, and how big.

A tile wholly above the causal diagonal, or wholly left of a sliding window, holds no visible
key and is skipped; a tile the diagonal or the window edge crosses is *partial* and gets its
mask built; every other tile is computed unmasked. Block sizes come from :data:`BLOCKS`,
measured on the development machine (see ``benchmarks/flash_blocks.py``).

The key blocks a query block visits are one contiguous range, found in closed form
(:func:`key_block_range`), so a plan costs O(query blocks) before its tiles are listed, and
:func:`visited_pairs` (what ``qkv.explain`` predicts FLOPs from) is closed-form in every
size: ``T = S = 10⁹`` costs the same as ``T = S = 10``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BLOCKS",
    "BlockPlan",
    "RowPlan",
    "block_sizes",
    "key_block_range",
    "plan_blocks",
    "visited_pairs",
]


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


def key_block_range(
    i0: int, i1: int, S: int, bk: int, causal: int | None, window: int | None
) -> tuple[int, int]:
    """Key blocks ``[lo, hi)`` that queries ``[i0, i1)`` visit (``lo >= hi``: none), in O(1).

    Query ``i`` sees key ``j`` iff ``j <= i + causal`` and ``j > i + causal - window`` (each
    condition only when set). Key block ``c`` covers keys ``[c·bk, min(S, (c+1)·bk))``; it is
    visited unless every key in it is after the last query's diagonal
    (``c·bk > i1 - 1 + causal``) or older than the first query's window
    (``min(S, (c+1)·bk) - 1 <= i0 + causal - window``).
    """
    blocks = -(-S // bk)
    if causal is None:
        return 0, blocks
    # c·bk <= i1 - 1 + causal  <=>  c <= floor((i1 - 1 + causal) / bk)
    hi = min(blocks, (i1 - 1 + causal) // bk + 1)
    lo = 0
    if window is not None:
        edge = i0 + causal - window  # keys j <= edge are outside every query's window
        if edge >= S - 1:
            return blocks, blocks  # even the last key is too old
        # (c+1)·bk - 1 > edge  <=>  c >= floor((edge + 1) / bk)   (c < blocks - 1: no clip)
        lo = max(0, (edge + 1) // bk)
    return lo, max(lo, hi)


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
    condition only when set). Each query block's key range comes from
    :func:`key_block_range`, so only visited tiles are ever listed.
    """
    rows = []
    for i0 in range(0, T, bq):
        i1 = min(T, i0 + bq)
        lo, hi = key_block_range(i0, i1, S, bk, causal, window)
        tiles = []
        for index in range(lo, hi):
            j0, j1 = index * bk, min(S, (index + 1) * bk)
            partial = False
            if causal is not None:
                below = j1 - 1 <= i0 + causal
                inside = window is None or j0 > i1 - 1 + causal - window
                partial = not (below and inside)
            tiles.append(BlockPlan(i0, i1, j0, j1, index, partial, alibi_shift))
        rows.append(RowPlan(i0, i1, tuple(tiles)))
    return rows


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``Σ_{r=0}^{n-1} floor((a·r + b) / m)`` for ``m >= 1``, in O(log m) steps.

    The classic Euclid-like reduction (as in AtCoder's ``floor_sum``), extended to negative
    ``a`` and ``b`` by taking their floor quotients out first.
    """
    total = 0
    while n > 0:
        if a < 0 or a >= m:
            total += (a // m) * n * (n - 1) // 2
            a %= m
        if b < 0 or b >= m:
            total += (b // m) * n
            b %= m
        y_max = a * n + b
        if y_max < m:
            break
        n, b, m, a = y_max // m, y_max % m, a, m
    return total


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _sum_clamped_floor(r0: int, r1: int, a: int, b: int, m: int, low: int, high: int) -> int:
    """``Σ_{r=r0}^{r1-1} clamp(floor((a·r + b) / m), low, high)`` for ``a, m >= 1``.

    The floor is nondecreasing in ``r``, so the rows split into three runs: clamped to
    ``low``, unclamped (:func:`_floor_sum`) and clamped to ``high``.
    """
    if r1 <= r0:
        return 0
    first_mid = min(r1, max(r0, _ceil_div(low * m - b, a)))  # first r with floor >= low
    first_high = min(r1, max(first_mid, _ceil_div((high + 1) * m - b, a)))  # floor > high
    mid = _floor_sum(first_high - first_mid, m, a, a * first_mid + b)
    return low * (first_mid - r0) + mid + high * (r1 - first_high)


def visited_pairs(
    T: int, S: int, bq: int, bk: int, causal: int | None, window: int | None
) -> int:
    """(query, key) pairs inside the tiles :func:`plan_blocks` lists, in closed form.

    Equal to ``sum((t.i1 - t.i0) * (t.j1 - t.j0) for row in plan for t in row.tiles)``
    without listing a tile or a query block: O(log) in ``T`` and ``S``. A full query block
    ``r`` (``bq`` rows from ``i0 = r·bq``) visits keys ``[lo·bk, min(S, hi·bk))`` with ``lo``
    and ``hi`` floors of linear functions of ``r`` (:func:`key_block_range`), clamped to the
    key blocks; their sums over ``r`` are floor sums. The last, shorter query block is added
    on its own.
    """
    if T <= 0 or S <= 0:
        return 0
    if causal is None:
        return T * S
    blocks = -(-S // bk)
    full = T // bq  # query blocks of bq rows; a last one of T - full·bq rows follows if any
    # Query blocks with a visible tile: the diagonal reaches key 0 (i1 - 1 + causal >= 0)
    # and, with a window, its edge is before the last key (i0 + causal - window < S - 1).
    first = max(0, _ceil_div(1 - bq - causal, bq))
    stop = full if window is None else min(full, max(0, _ceil_div(S - 1 - causal + window, bq)))
    total = 0
    if stop > first:
        # hi(r) = min(blocks, floor((r·bq + bq - 1 + causal) / bk) + 1): keys end at hi·bk,
        # or at S when hi = blocks (the last key block may be short).
        his = _sum_clamped_floor(first, stop, bq, bq - 1 + causal, bk, 0, blocks - 1)
        ends = bk * (his + (stop - first))
        clipped = stop - max(first, _ceil_div((blocks - 1) * bk - (bq - 1 + causal), bq))
        ends -= (blocks * bk - S) * max(0, clipped)
        starts = 0
        if window is not None:
            # lo(r) = max(0, floor((r·bq + causal - window + 1) / bk)); never past the last
            # block for r < stop.
            starts = bk * _sum_clamped_floor(
                first, stop, bq, causal - window + 1, bk, 0, blocks - 1
            )
        total += bq * (ends - starts)
    if full * bq < T:  # the last, shorter query block
        lo, hi = key_block_range(full * bq, T, S, bk, causal, window)
        if hi > lo:
            total += (T - full * bq) * (min(S, hi * bk) - lo * bk)
    return total


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
