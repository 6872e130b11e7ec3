"""Triton kernels of block-sparse programmable attention: :func:`qkv.flex_attention` with a
:class:`~qkv.attention.flex_blocks.BlockMask` (and no ``score_mod``) on a GPU.

A program owns one query tile of one ``(b, h)`` and visits only the key tiles its block mask
marks visible, read from tables built once per block mask (:mod:`qkv.attention.flex_triton`):
``KV_COUNT``/``KV_IDX`` (visited key tiles per query tile, in order), ``Q_COUNT``/``Q_IDX``
(visiting query tiles per key tile, for ``dK``/``dV``), and ``SLOT`` (per tile: -1 when full,
else the index of its ``BLOCK_M × BLOCK_N`` keep tile in ``KEEP``, ``mask_mod`` evaluated
once, on partial tiles only). Full tiles evaluate no mask. The tables may be shared by every
batch row or head (a block mask built with ``B`` or ``H`` None): ``BB``/``HB`` are 1 when they
vary over it, 0 when not, and ``HT`` is the tables' head count.

Two ready score mods run inside the kernels (``SCORE_MOD``): ALiBi with fixed slopes
(:func:`qkv.attention.score_mods.alibi`) and soft-capping
(:func:`qkv.attention.score_mods.soft_cap`); any other ``score_mod`` keeps the tile loop.

Shapes: ``q (B, H, T, D)``, ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``; ``lse (B, H, T)``
float32 natural log; ``dQ``, ``dK``, ``dV`` contiguous. Scores in base 2 inside, as in
:mod:`qkv.attention.triton_kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qkv.attention.triton_kernels import finish_rows, load_tile, matmul, poisoned_rows


@triton.jit
def _tanh(x):
    """``tanh(x)`` from one exp (the interpreter has no libdevice): absolute error ~1e-7."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _tile(q, k, h, i, j, rows_ok, cols_ok, slot, KEEP, SLOPES, offset, cap, scale,
          SCORE_MOD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Base-2 scores of one tile after the score mod (``SCORE_MOD`` 1: ALiBi
    ``-slope_h·|i + offset - j|``, 2: soft-cap ``cap·tanh(s / cap)``), ``-inf`` where the
    block mask (or the edges) hide a key; and ``d mod / d s`` (soft-cap: ``1 - tanh²``;
    meaningless otherwise)."""
    s = matmul(q, tl.trans(k), PRECISION, UPCAST) * scale  # natural units
    dmod = s
    if SCORE_MOD == 1:
        distance = tl.abs(i[:, None] + offset - j[None, :]).to(tl.float32)
        s = s - tl.load(SLOPES + h) * distance
    if SCORE_MOD == 2:
        t = _tanh(s / cap)
        s = cap * t
        dmod = 1.0 - t * t
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    at = KEEP + tl.maximum(slot, 0).to(tl.int64) * (BLOCK_M * BLOCK_N) + r[:, None] * BLOCK_N
    partial = (tl.zeros([BLOCK_M, BLOCK_N], tl.int32) + slot) >= 0
    keep = tl.load(at + c[None, :], mask=partial & rows_ok[:, None], other=1) != 0
    visible = rows_ok[:, None] & cols_ok[None, :] & keep
    return tl.where(visible, s * 1.4426950408889634, float("-inf")), dmod


@triton.jit
def flex_forward(
    Q, K, V, O, L, KV_COUNT, KV_IDX, SLOT, KEEP, SLOPES,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot,
    H, G, T, S, D, DV, nQ, nK, BB, HB, HT, scale, offset, cap,
    SCORE_MOD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Output rows and lse of one query tile of one ``(b, h)``."""
    qb = tl.program_id(0)
    b = (tl.program_id(1) // H).to(tl.int64)
    h = (tl.program_id(1) % H).to(tl.int64)
    hkv = h // G
    i = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = i < T
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q + b * sqb + h * sqh, i, rows_ok, sqt, D, d, True, EVEN_D)
    poisoned = poisoned_rows(q)
    plane = (b * BB) * HT + h * HB
    row = plane * nQ + qb
    count = tl.load(KV_COUNT + row)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n in range(0, count):
        kb = tl.load(KV_IDX + row * nK + n)
        slot = tl.load(SLOT + row * nK + kb)
        j = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_ok = j < S
        k = load_tile(K + b * skb + hkv * skh, j, cols_ok, sks, D, d, True, EVEN_D)
        v = load_tile(V + b * svb + hkv * svh, j, cols_ok, svs, DV, dv, True, EVEN_D)
        s, _ = _tile(q, k, h, i, j, rows_ok, cols_ok, slot, KEEP, SLOPES, offset, cap, scale,
                     SCORE_MOD, PRECISION, UPCAST, BLOCK_M, BLOCK_N)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + matmul(p.to(v.dtype), v, PRECISION, UPCAST)
        m = m_new
    out, lse = finish_rows(acc, l, m, poisoned)
    o_at = O + b * sob + h * soh + i[:, None].to(tl.int64) * sot + dv[None, :]
    tl.store(o_at, out.to(O.dtype.element_ty), mask=rows_ok[:, None] & (dv[None, :] < DV))
    tl.store(L + (b * H + h) * T + i, lse, mask=rows_ok)


@triton.jit
def flex_backward_dq(
    Q, K, V, DO, LSE, DELTA, DQ, KV_COUNT, KV_IDX, SLOT, KEEP, SLOPES,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
    H, G, T, S, D, DV, nQ, nK, BB, HB, HT, scale, offset, cap,
    SCORE_MOD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``dQ`` of one query tile (``LSE`` is ``+inf`` on dead rows)."""
    qb = tl.program_id(0)
    b = (tl.program_id(1) // H).to(tl.int64)
    h = (tl.program_id(1) % H).to(tl.int64)
    hkv = h // G
    i = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = i < T
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q + b * sqb + h * sqh, i, rows_ok, sqt, D, d, True, EVEN_D)
    do = load_tile(DO + b * sdb + h * sdh, i, rows_ok, sdt, DV, dv, True, EVEN_D)
    at = (b * H + h) * T + i
    lse = tl.load(LSE + at, mask=rows_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + at, mask=rows_ok, other=0.0)
    row = ((b * BB) * HT + h * HB) * nQ + qb
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n in range(0, tl.load(KV_COUNT + row)):
        kb = tl.load(KV_IDX + row * nK + n)
        slot = tl.load(SLOT + row * nK + kb)
        j = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_ok = j < S
        k = load_tile(K + b * skb + hkv * skh, j, cols_ok, sks, D, d, True, EVEN_D)
        v = load_tile(V + b * svb + hkv * svh, j, cols_ok, svs, DV, dv, True, EVEN_D)
        s, dmod = _tile(q, k, h, i, j, rows_ok, cols_ok, slot, KEEP, SLOPES, offset, cap,
                           scale, SCORE_MOD, PRECISION, UPCAST, BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s - lse[:, None])
        ds = p * (matmul(do, tl.trans(v), PRECISION, UPCAST) - delta[:, None])
        if SCORE_MOD == 2:
            ds = ds * dmod  # through the soft-cap
        dq += matmul(ds.to(k.dtype), k, PRECISION, UPCAST)
    tl.store(DQ + at[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows_ok[:, None] & (d[None, :] < D))


@triton.jit
def flex_backward_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV_, Q_COUNT, Q_IDX, SLOT, KEEP, SLOPES,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
    H, G, T, S, D, DV, nQ, nK, BB, HB, HT, scale, offset, cap,
    SCORE_MOD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``dK`` and ``dV`` of one key tile, summed over the query heads of its group."""
    kb = tl.program_id(0)
    Hkv = H // G
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hkv = (tl.program_id(1) % Hkv).to(tl.int64)
    j = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = j < S
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k = load_tile(K + b * skb + hkv * skh, j, cols_ok, sks, D, d, True, EVEN_D)
    v = load_tile(V + b * svb + hkv * svh, j, cols_ok, svs, DV, dv, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dvacc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        h = hkv * G + g
        plane = (b * BB) * HT + h * HB
        column = plane * nK + kb
        for n in range(0, tl.load(Q_COUNT + column)):
            qb = tl.load(Q_IDX + column * nQ + n)
            slot = tl.load(SLOT + (plane * nQ + qb) * nK + kb)
            i = qb * BLOCK_M + tl.arange(0, BLOCK_M)
            rows_ok = i < T
            q = load_tile(Q + b * sqb + h * sqh, i, rows_ok, sqt, D, d, True, EVEN_D)
            do = load_tile(DO + b * sdb + h * sdh, i, rows_ok, sdt, DV, dv, True, EVEN_D)
            at = (b * H + h) * T + i
            lse = tl.load(LSE + at, mask=rows_ok, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + at, mask=rows_ok, other=0.0)
            s, dmod = _tile(q, k, h, i, j, rows_ok, cols_ok, slot, KEEP, SLOPES, offset,
                               cap, scale, SCORE_MOD, PRECISION, UPCAST, BLOCK_M, BLOCK_N)
            p = tl.math.exp2(s - lse[:, None])
            dvacc += matmul(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
            ds = p * (matmul(do, tl.trans(v), PRECISION, UPCAST) - delta[:, None])
            if SCORE_MOD == 2:
                ds = ds * dmod
            dk += matmul(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    at = (b * Hkv + hkv) * S + j
    tl.store(DK + at[:, None] * D + d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=cols_ok[:, None] & (d[None, :] < D))
    tl.store(DV_ + at[:, None] * DV + dv[None, :], dvacc.to(DV_.dtype.element_ty),
             mask=cols_ok[:, None] & (dv[None, :] < DV))
