"""Triton kernels of block-sparse programmable attention: :func:`qkv.flex_attention` with a
:class:`~qkv.attention.flex_blocks.BlockMask` (and no ``score_mod``) on a GPU.

A program owns one query tile of one ``(b, h)`` and visits only the key tiles its block mask
marks visible, read from tables built once per block mask (:mod:`qkv.attention.flex_triton`):
``KV_COUNT``/``KV_PART``/``KV_IDX`` (visited key tiles per query tile: the partial ones
first, then the full ones, each ascending), ``Q_COUNT``/``Q_PART``/``Q_IDX`` (the same for
query tiles per key tile, for ``dK``/``dV``), and ``SLOT`` (per tile: -1 when full, else the
index of its ``BLOCK_M × BLOCK_N`` keep tile in ``KEEP``, ``mask_mod`` evaluated once, on
partial tiles only). Each kernel runs two loops: partial tiles reading their keep tile, then
full tiles reading no mask. The tables may be shared by every
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
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Base-2 scores of one tile after the score mod (``SCORE_MOD`` 1: ALiBi
    ``-slope_h·|i + offset - j|``, 2: soft-cap ``cap·tanh(s / cap)``), ``-inf`` where the
    block mask (a partial tile, ``MASKED``: its keep tile ``slot``) or the edges hide a key;
    and ``d mod / d s`` (soft-cap: ``1 - tanh²``; meaningless otherwise)."""
    s = matmul(q, tl.trans(k), PRECISION, UPCAST) * scale  # natural units
    dmod = s
    if SCORE_MOD == 1:
        distance = tl.abs(i[:, None] + offset - j[None, :]).to(tl.float32)
        s = s - tl.load(SLOPES + h) * distance
    if SCORE_MOD == 2:
        t = _tanh(s / cap)
        s = cap * t
        dmod = 1.0 - t * t
    visible = rows_ok[:, None] & cols_ok[None, :]
    if MASKED:
        r = tl.arange(0, BLOCK_M)
        c = tl.arange(0, BLOCK_N)
        at = KEEP + slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + r[:, None] * BLOCK_N + c[None, :]
        visible = visible & (tl.load(at, mask=rows_ok[:, None], other=1) != 0)
    return tl.where(visible, s * 1.4426950408889634, float("-inf")), dmod


@triton.jit
def _key_tile(q, K, V, h, i, rows_ok, kb, slot, KEEP, SLOPES, sks, svs, S, D, DV, d, dv,
              offset, cap, scale, SCORE_MOD: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Key tile ``kb`` read for the query tile ``q``: ``(k, v, base-2 scores, d mod / d s)``."""
    j = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = j < S
    k = load_tile(K, j, cols_ok, sks, D, d, True, EVEN_D)
    v = load_tile(V, j, cols_ok, svs, DV, dv, True, EVEN_D)
    s, dmod = _tile(q, k, h, i, j, rows_ok, cols_ok, slot, KEEP, SLOPES, offset, cap, scale,
                    SCORE_MOD, PRECISION, UPCAST, BLOCK_M, BLOCK_N, MASKED)
    return k, v, s, dmod


@triton.jit
def _forward_step(q, K, V, m, l, acc, h, i, rows_ok, kb, slot, KEEP, SLOPES, sks, svs, S, D,
                  DV, d, dv, offset, cap, scale, SCORE_MOD: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One key tile ``kb`` of the online softmax: the updated ``(m, l, acc)``."""
    _, v, s, _ = _key_tile(q, K, V, h, i, rows_ok, kb, slot, KEEP, SLOPES, sks, svs, S, D, DV,
                           d, dv, offset, cap, scale, SCORE_MOD, PRECISION, UPCAST, EVEN_D,
                           BLOCK_M, BLOCK_N, MASKED)
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + matmul(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l, acc


@triton.jit
def flex_forward(
    Q, K, V, O, L, KV_COUNT, KV_PART, KV_IDX, SLOT, KEEP, SLOPES,
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
    K += b * skb + hkv * skh
    V += b * svb + hkv * svh
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    part = tl.load(KV_PART + row)
    for n in range(0, part):  # partial tiles: their keep tiles
        kb = tl.load(KV_IDX + row * nK + n)
        slot = tl.load(SLOT + row * nK + kb)
        m, l, acc = _forward_step(q, K, V, m, l, acc, h, i, rows_ok, kb, slot, KEEP, SLOPES,
                                  sks, svs, S, D, DV, d, dv, offset, cap, scale, SCORE_MOD,
                                  PRECISION, UPCAST, EVEN_D, BLOCK_M, BLOCK_N, True)
    for n in range(part, tl.load(KV_COUNT + row)):  # full tiles: no mask read
        kb = tl.load(KV_IDX + row * nK + n)
        m, l, acc = _forward_step(q, K, V, m, l, acc, h, i, rows_ok, kb, 0, KEEP, SLOPES,
                                  sks, svs, S, D, DV, d, dv, offset, cap, scale, SCORE_MOD,
                                  PRECISION, UPCAST, EVEN_D, BLOCK_M, BLOCK_N, False)
    out, lse = finish_rows(acc, l, m, poisoned)
    o_at = O + b * sob + h * soh + i[:, None].to(tl.int64) * sot + dv[None, :]
    tl.store(o_at, out.to(O.dtype.element_ty), mask=rows_ok[:, None] & (dv[None, :] < DV))
    tl.store(L + (b * H + h) * T + i, lse, mask=rows_ok)


@triton.jit
def _dq_step(dq, q, do, lse, delta, K, V, h, i, rows_ok, kb, slot, KEEP, SLOPES, sks, svs, S,
             D, DV, d, dv, offset, cap, scale, SCORE_MOD: tl.constexpr,
             PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """``dq`` plus key tile ``kb``'s share."""
    k, v, s, dmod = _key_tile(q, K, V, h, i, rows_ok, kb, slot, KEEP, SLOPES, sks, svs, S, D,
                              DV, d, dv, offset, cap, scale, SCORE_MOD, PRECISION, UPCAST,
                              EVEN_D, BLOCK_M, BLOCK_N, MASKED)
    p = tl.math.exp2(s - lse[:, None])
    ds = p * (matmul(do, tl.trans(v), PRECISION, UPCAST) - delta[:, None])
    if SCORE_MOD == 2:
        ds = ds * dmod  # through the soft-cap
    return dq + matmul(ds.to(k.dtype), k, PRECISION, UPCAST)


@triton.jit
def _dkdv_step(dk, dvacc, k, v, Q, DO, LSE, DELTA, h, j, cols_ok, qb, slot, KEEP, SLOPES,
               sqt, sdt, T, D, DV, d, dv, offset, cap, scale, SCORE_MOD: tl.constexpr,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """``(dk, dv)`` plus query tile ``qb``'s share (``Q``, ``DO`` at this ``(b, h)``)."""
    i = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = i < T
    q = load_tile(Q, i, rows_ok, sqt, D, d, True, EVEN_D)
    do = load_tile(DO, i, rows_ok, sdt, DV, dv, True, EVEN_D)
    at = h * T + i
    lse = tl.load(LSE + at, mask=rows_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + at, mask=rows_ok, other=0.0)
    s, dmod = _tile(q, k, h, i, j, rows_ok, cols_ok, slot, KEEP, SLOPES, offset, cap, scale,
                    SCORE_MOD, PRECISION, UPCAST, BLOCK_M, BLOCK_N, MASKED)
    p = tl.math.exp2(s - lse[:, None])
    dvacc += matmul(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
    ds = p * (matmul(do, tl.trans(v), PRECISION, UPCAST) - delta[:, None])
    if SCORE_MOD == 2:
        ds = ds * dmod
    return dk + matmul(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST), dvacc


@triton.jit
def flex_backward_dq(
    Q, K, V, DO, LSE, DELTA, DQ, KV_COUNT, KV_PART, KV_IDX, SLOT, KEEP, SLOPES,
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
    K += b * skb + hkv * skh
    V += b * svb + hkv * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    part = tl.load(KV_PART + row)
    for n in range(0, part):  # partial tiles, then full ones
        kb = tl.load(KV_IDX + row * nK + n)
        slot = tl.load(SLOT + row * nK + kb)
        dq = _dq_step(dq, q, do, lse, delta, K, V, h, i, rows_ok, kb, slot, KEEP, SLOPES,
                      sks, svs, S, D, DV, d, dv, offset, cap, scale, SCORE_MOD, PRECISION,
                      UPCAST, EVEN_D, BLOCK_M, BLOCK_N, True)
    for n in range(part, tl.load(KV_COUNT + row)):
        kb = tl.load(KV_IDX + row * nK + n)
        dq = _dq_step(dq, q, do, lse, delta, K, V, h, i, rows_ok, kb, 0, KEEP, SLOPES,
                      sks, svs, S, D, DV, d, dv, offset, cap, scale, SCORE_MOD, PRECISION,
                      UPCAST, EVEN_D, BLOCK_M, BLOCK_N, False)
    tl.store(DQ + at[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows_ok[:, None] & (d[None, :] < D))


@triton.jit
def flex_backward_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV_, Q_COUNT, Q_PART, Q_IDX, SLOT, KEEP, SLOPES,
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
        q_at, do_at = Q + b * sqb + h * sqh, DO + b * sdb + h * sdh
        lse_at, delta_at = LSE + b * H * T, DELTA + b * H * T
        part = tl.load(Q_PART + column)
        for n in range(0, part):  # partial tiles, then full ones
            qb = tl.load(Q_IDX + column * nQ + n)
            slot = tl.load(SLOT + (plane * nQ + qb) * nK + kb)
            dk, dvacc = _dkdv_step(dk, dvacc, k, v, q_at, do_at, lse_at, delta_at, h, j,
                                   cols_ok, qb, slot, KEEP, SLOPES, sqt, sdt, T, D, DV, d, dv,
                                   offset, cap, scale, SCORE_MOD, PRECISION, UPCAST, EVEN_D,
                                   BLOCK_M, BLOCK_N, True)
        for n in range(part, tl.load(Q_COUNT + column)):
            qb = tl.load(Q_IDX + column * nQ + n)
            dk, dvacc = _dkdv_step(dk, dvacc, k, v, q_at, do_at, lse_at, delta_at, h, j,
                                   cols_ok, qb, 0, KEEP, SLOPES, sqt, sdt, T, D, DV, d, dv,
                                   offset, cap, scale, SCORE_MOD, PRECISION, UPCAST, EVEN_D,
                                   BLOCK_M, BLOCK_N, False)
    at = (b * Hkv + hkv) * S + j
    tl.store(DK + at[:, None] * D + d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=cols_ok[:, None] & (d[None, :] < D))
    tl.store(DV_ + at[:, None] * DV + dv[None, :], dvacc.to(DV_.dtype.element_ty),
             mask=cols_ok[:, None] & (dv[None, :] < DV))
