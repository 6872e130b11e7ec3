"""Flash tiling and ``qkv.explain``'s cost model in closed form: equal to tile enumeration.

The oracle is the enumeration ``plan_blocks`` used to be (every key block of every query
block tested against the causal diagonal and the window), kept here as the definition. The
closed forms must agree with it exactly over shapes, causal shifts and windows, and
``qkv.explain`` must answer at ``T = S = 10**9`` at once.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.attention.flash_blocks import (
    BlockPlan,
    RowPlan,
    block_sizes,
    key_block_range,
    plan_blocks,
    visited_pairs,
)


def enumerated_plan(T, S, bq, bk, causal, window, alibi_shift=0):
    """Every tile of the ``T×S`` grid, kept when a key in it may be visible (the old plan)."""
    rows = []
    for i0 in range(0, T, bq):
        i1 = min(T, i0 + bq)
        tiles = []
        for index, j0 in enumerate(range(0, S, bk)):
            j1 = min(S, j0 + bk)
            partial = False
            if causal is not None:
                if j0 > i1 - 1 + causal:
                    continue
                if window is not None and j1 - 1 <= i0 + causal - window:
                    continue
                below = j1 - 1 <= i0 + causal
                inside = window is None or j0 > i1 - 1 + causal - window
                partial = not (below and inside)
            tiles.append(BlockPlan(i0, i1, j0, j1, index, partial, alibi_shift))
        rows.append(RowPlan(i0, i1, tuple(tiles)))
    return rows


def enumerated_pairs(T, S, bq, bk, causal, window):
    plan = enumerated_plan(T, S, bq, bk, causal, window)
    return sum((t.i1 - t.i0) * (t.j1 - t.j0) for row in plan for t in row.tiles)


LENGTHS = [0, 1, 5, 17, 33]
BLOCKS = [(1, 1), (4, 4), (5, 3), (16, 7)]
WINDOWS = [None, 1, 2, 7, 40]


def _shifts(S):
    return [None, *range(-S - 2, S + 3, 3)]


@pytest.mark.parametrize(("bq", "bk"), BLOCKS)
@pytest.mark.parametrize("S", LENGTHS)
@pytest.mark.parametrize("T", LENGTHS)
def test_plan_and_pairs_equal_the_enumeration(T, S, bq, bk):
    for causal in _shifts(S):
        for window in [None] if causal is None else WINDOWS:
            case = (T, S, bq, bk, causal, window)
            expected = enumerated_plan(*case, alibi_shift=3)
            assert plan_blocks(*case, alibi_shift=3) == expected, case
            brute = sum((t.i1 - t.i0) * (t.j1 - t.j0) for r in expected for t in r.tiles)
            got = visited_pairs(*case)
            assert got == brute, f"{case}: closed form {got}, enumeration {brute}"


@settings(max_examples=150, deadline=None)
@given(
    T=st.integers(0, 300),
    S=st.integers(0, 300),
    bq=st.integers(1, 40),
    bk=st.integers(1, 40),
    causal=st.one_of(st.none(), st.integers(-320, 320)),
    window=st.one_of(st.none(), st.integers(1, 320)),
)
def test_pairs_equal_the_enumeration_at_random(T, S, bq, bk, causal, window):
    window = None if causal is None else window
    case = (T, S, bq, bk, causal, window)
    assert visited_pairs(*case) == enumerated_pairs(*case), case


def _rows_oracle(T, S, bq, bk, causal, window):
    """O(query blocks) oracle in NumPy: each full block's key range from its own formula."""
    full = T // bq
    i0 = np.arange(full, dtype=np.int64) * bq
    i1 = i0 + bq
    blocks = -(-S // bk)
    hi = np.minimum(blocks, np.floor_divide(i1 - 1 + causal, bk) + 1)
    lo = np.zeros_like(hi)
    empty = hi <= 0
    if window is not None:
        edge = i0 + causal - window
        lo = np.maximum(0, np.floor_divide(edge + 1, bk))
        empty |= edge >= S - 1
    ends = np.minimum(S, hi * bk)
    pairs = np.where(empty, 0, bq * (ends - lo * bk))
    total = int(pairs.sum(dtype=np.int64))
    if full * bq < T:
        lo_, hi_ = key_block_range(full * bq, T, S, bk, causal, window)
        total += (T - full * bq) * max(0, min(S, hi_ * bk) - lo_ * bk) if hi_ > lo_ else 0
    return total


@pytest.mark.parametrize(
    ("T", "S", "bq", "bk", "causal", "window"),
    [
        (10**6 + 3, 10**6, 256, 512, 0, None),
        (10**6, 3 * 10**6 + 17, 256, 512, 2 * 10**6, None),
        (10**6 + 255, 10**6 + 511, 256, 512, 511, 4096),
        (777_777, 10**6, 128, 256, -5000, 1),
        (10**6, 10**6, 7, 13, 3, 100_003),
    ],
)
def test_pairs_at_large_sizes_equal_a_per_block_sum(T, S, bq, bk, causal, window):
    """Big sizes, where enumerating tiles is out of reach: a vectorised per-block sum."""
    expected = _rows_oracle(T, S, bq, bk, causal, window)
    assert visited_pairs(T, S, bq, bk, causal, window) == expected


def _zero_inputs(B, H, Hkv, T, S, D, dtype=torch.float32):
    zero = torch.zeros((), dtype=dtype)
    return zero.expand(B, H, T, D), zero.expand(B, Hkv, S, D), zero.expand(B, Hkv, S, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("T", "S", "is_causal", "window"),
    [
        (40, 40, True, None),
        (17, 300, "bottom-right", None),
        (300, 17, "bottom-right", None),
        (600, 700, True, None),
        (600, 700, "bottom-right", 64),
        (513, 1025, True, 1),
        (5, 9000, "bottom-right", 300),
        (700, 700, False, None),
    ],
)
def test_explain_flops_equal_the_enumeration(T, S, is_causal, window, dtype):
    """``explain``'s flash FLOPs count exactly the pairs in the tiles the kernel visits."""
    B, H, Hkv, D = 2, 4, 2, 16
    e = qkv.explain(*_zero_inputs(B, H, Hkv, T, S, D, dtype), is_causal=is_causal,
                    enable_gqa=True, window=window)
    causal = None if is_causal is False else 0 if is_causal is True else S - T
    bq, bk = block_sizes(T, S, D, dtype)
    pairs = enumerated_pairs(T, S, bq, bk, causal, window)
    assert e.costs["flash"].flops == B * H * pairs * 2 * (D + D), (e.costs["flash"], pairs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(is_causal=True),
        dict(is_causal="bottom-right", window=4096),
        dict(need_weights=True),
        dict(is_causal=True, dtype=torch.bfloat16, Hkv=2),
    ],
    ids=["causal", "window", "weights", "bf16-gqa"],
)
def test_explain_at_a_billion_tokens_returns_at_once(kwargs):
    """No tile is listed: T = S = 10**9 is answered as fast as T = S = 10 (was: never)."""
    kwargs = dict(kwargs)
    dtype, Hkv = kwargs.pop("dtype", torch.float32), kwargs.pop("Hkv", 8)
    n = 10**9
    q, k, v = _zero_inputs(1, 8, Hkv, n, n, 64, dtype)
    start = time.perf_counter()
    e = qkv.explain(q, k, v, enable_gqa=Hkv != 8, **kwargs)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"qkv.explain at T=S=1e9 took {elapsed:.2f} s"
    flops = e.costs["flash"].flops
    if kwargs.get("is_causal") is True:
        bq, bk = block_sizes(n, n, 64, dtype)
        assert flops == 8 * _rows_oracle(n, n, bq, bk, 0, None) * 2 * 128
        assert flops < 8 * n * n * 2 * 128  # the tiles above the diagonal are skipped
    assert e.costs["math"].flops == 8 * n * n * 2 * 128


def test_plan_lists_only_the_visited_tiles():
    """A window of one block: every query block lists at most two tiles, none skipped."""
    plan = plan_blocks(10**5, 10**5, 256, 256, causal=0, window=256)
    assert max(len(r.tiles) for r in plan) == 2
    assert sum(len(r.tiles) for r in plan) == 2 * len(plan) - 1
    for r, row in itertools.islice(enumerate(plan), 3):
        assert [t.index for t in row.tiles] == list(range(max(0, r - 1), r + 1))
