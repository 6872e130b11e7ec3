"""The Triton kernel of paged attention (:class:`qkv.nn.PagedKVCache` on a GPU): queries
attend over their sequence's pages read in place through its block table, with no gather of
the cache (Kwon et al., 2023, "PagedAttention"; the split over keys as in flash-decoding).

A program owns one tile of packed query rows (the ``G`` query heads of a key/value head, each
with the batch row's ``T`` new queries, as in :mod:`qkv.attention.triton.kernels`) of one
sequence ``b`` and one split of its keys. Key ``j`` of sequence ``b`` lives in page
``TABLE[b, j // P]`` at offset ``j % P``; each key tile's rows are read from their own pages.
Query ``t`` of sequence ``b`` sits at position ``POS[b, t]`` and sees the keys ``j <= POS[b,
t]`` (causal, its own sequence only). Each split writes its output rows and lse; the splits
are merged by :func:`qkv.attention.triton.kernels.merge_splits`.

Shapes: ``q (B, H, T, D)``; pools ``(N, Hkv, P, D)`` and ``(N, Hkv, P, Dv)`` (``N`` pages of
``P`` positions); ``TABLE (B, W)`` int64 page ids; ``POS (B, T)`` int64 positions; scores in
base 2 inside.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qkv.attention.triton.kernels import (
    finish_rows,
    load_tile,
    matmul,
    packed_rows,
    poisoned_rows,
    softmax_step,
    store_rows,
)


@triton.jit
def _page_rows(POOL, TABLE, b, hkv, j, ok, W, snp, snh, snt, cols, width, P: tl.constexpr,
               EVEN_D: tl.constexpr):
    """Keys (or values) ``j`` of sequence ``b``, head ``hkv``: each row from its page (``P``
    a constant: its page and offset a shift and a mask for a power of two, where a runtime
    ``P`` divided 64-bit integers in a subroutine, each key of each tile)."""
    page = tl.load(TABLE + b * W + j // P, mask=ok, other=0)
    at = (POOL + page[:, None] * snp + hkv * snh + (j % P)[:, None].to(tl.int64) * snt
          + cols[None, :])
    if EVEN_D:
        return tl.load(at, mask=ok[:, None], other=0.0)
    return tl.load(at, mask=ok[:, None] & (cols[None, :] < width), other=0.0)


@triton.jit
def paged_forward(
    Q, K_POOL, V_POOL, TABLE, POS, O, L,
    sqb, sqh, sqt, skn, skh, skt, svn, svh, svt, sob, soh, sot, slb, slh, so_split, sl_split,
    H, G, T, D, DV, W, split_len, scale,
    P: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Output rows (normalised) and their lse for one tile of packed rows and one key split."""
    scale = scale * 1.4426950408889634  # base 2 from here on
    Hkv = H // G
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hkv = (tl.program_id(1) % Hkv).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    h, t, rows_ok, _, _ = packed_rows(tl.program_id(0), hkv, G, T, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q + b * sqb + h[:, None] * sqh, t, rows_ok, sqt, D, d, True, EVEN_D)
    poisoned = poisoned_rows(q)
    pos = tl.load(POS + b * T + t, mask=rows_ok, other=-1)  # (BLOCK_M,): -1 sees nothing
    lo = split * split_len
    hi = tl.minimum(tl.max(pos, 0) + 1, lo + split_len)  # keys any row of the tile sees
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        ok = j < hi
        k = _page_rows(K_POOL, TABLE, b, hkv, j, ok, W, skn, skh, skt, d, D, P, EVEN_D)
        v = _page_rows(V_POOL, TABLE, b, hkv, j, ok, W, svn, svh, svt, dv, DV, P, EVEN_D)
        s = matmul(q, tl.trans(k), PRECISION, UPCAST) * scale
        s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
        m, l, acc = softmax_step(m, l, acc, s, v, s, 1.0, PRECISION, UPCAST, 0)
    out, lse = finish_rows(acc, l, m, poisoned)
    store_rows(O + split * so_split + b * sob, L + split * sl_split + b * slb, out, lse, h, t,
               rows_ok, soh, sot, slh, dv, DV)
