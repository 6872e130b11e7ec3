"""The backward kernels of the ``triton`` backend (FlashAttention-2's two-kernel form): one
program per key tile for ``dK`` and ``dV`` (summed over the ``G`` query heads of its group, so
K and V are never repeated), one per tile of packed query rows for ``dQ``. Each recomputes
its score tiles from the forward's log-sum-exp, with the same masks and the same edge/inner
spans as the forward (:mod:`qkv.attention.triton.kernels`).

With ``P = exp(S - lse)`` (zero on a row with no visible key: its lse arrives as ``+inf``),
``dP = dO·Vᵀ`` (dropout applied), ``δ = rowsum(dO ∘ O)`` minus the lse's own incoming
gradient, and ``dS = P ∘ (dP - δ)``: ``dV = Pᵀ·dO``, ``dK = scale · dSᵀ·Q``,
``dQ = scale · dS·K``. Shapes as in the forward; ``lse``, ``δ`` ``(B, H, T)`` float32
contiguous; ``dQ`` ``(B, H, T, D)``, ``dK``/``dV`` ``(B, Hkv, S, D|Dv)`` contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qkv.attention.triton.kernels import (
    key_spans,
    key_tile,
    load_tile,
    mask_tile,
    matmul,
    packed_rows,
    philox_keep,
    spans,
)


@triton.jit
def _dq_span(
    dq, q, do, lse, delta, K_at, V_at, start, end, b, h, i, rows_ok, M, SLOPES, KEEP,
    sks, svs, smb, smh, smt, sms, H, T, S, D, DV, scale, causal, window, alibi_shift,
    keep_scale, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EDGE: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``dq += Σ dS·K`` over key tiles ``[start, end)``."""
    for j0 in range(start, end, BLOCK_N):
        k, v, s, keep = key_tile(
            q, K_at, V_at, j0, S, b, h, i, rows_ok, M, SLOPES, KEEP, sks, svs,
            smb, smh, smt, sms, H, T, S, D, DV, scale, causal, window, alibi_shift,
            MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, DROPOUT, PRECISION, UPCAST, EDGE,
            EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
        )
        p = tl.math.exp2(s - lse[:, None])
        dp = matmul(do, tl.trans(v), PRECISION, UPCAST)
        if DROPOUT:
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += matmul(ds.to(k.dtype), k, PRECISION, UPCAST)
    return dq


@triton.jit
def attention_backward_dq(
    Q, K, V, DO, LSE, DELTA, DQ, M, KEEP, SLOPES,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
    smb, smh, smt, sms,
    H, G, T, S, D, DV,
    scale, causal, window, alibi_shift, keep_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``dQ`` of one tile of packed rows."""
    scale2 = scale * 1.4426950408889634  # scores in base 2
    Hkv = H // G
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hkv = (tl.program_id(1) % Hkv).to(tl.int64)
    h, i, rows_ok, i_lo, i_hi = packed_rows(tl.program_id(0), hkv, G, T, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q = load_tile(Q + b * sqb + h[:, None] * sqh, i, rows_ok, sqt, D, d, True, EVEN_D)
    do = load_tile(DO + b * sdb + h[:, None] * sdh, i, rows_ok, sdt, DV,
                   tl.arange(0, BLOCK_DV), True, EVEN_D)
    row = (b * H + h) * T + i
    lse = tl.load(LSE + row, mask=rows_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + row, mask=rows_ok, other=0.0)
    lo, a, c, hi = key_spans(i_lo, i_hi, 0, S, causal, window, IS_CAUSAL, HAS_WINDOW, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    K_at = K + b * skb + hkv * skh
    V_at = V + b * svb + hkv * svh
    dq = _dq_span(
        dq, q, do, lse, delta, K_at, V_at, lo, a, b, h, i, rows_ok, M, SLOPES, KEEP,
        sks, svs, smb, smh, smt, sms, H, T, S, D, DV, scale2, causal, window, alibi_shift,
        keep_scale, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, DROPOUT, PRECISION,
        UPCAST, True, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
    )
    dq = _dq_span(
        dq, q, do, lse, delta, K_at, V_at, a, c, b, h, i, rows_ok, M, SLOPES, KEEP,
        sks, svs, smb, smh, smt, sms, H, T, S, D, DV, scale2, causal, window, alibi_shift,
        keep_scale, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, DROPOUT, PRECISION,
        UPCAST, False, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
    )
    dq = _dq_span(
        dq, q, do, lse, delta, K_at, V_at, c, hi, b, h, i, rows_ok, M, SLOPES, KEEP,
        sks, svs, smb, smh, smt, sms, H, T, S, D, DV, scale2, causal, window, alibi_shift,
        keep_scale, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, DROPOUT, PRECISION,
        UPCAST, True, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
    )
    at = DQ + row[:, None] * D + d[None, :]
    tl.store(at, (dq * scale).to(DQ.dtype.element_ty), mask=rows_ok[:, None] & (d[None, :] < D))


@triton.jit
def tile_scores_t(
    k, q, b, h, i, j, j0, rows_ok, cols_ok, M, SLOPES, KEEP,
    smb, smh, smt, sms, H, T, S, scale, causal, window, alibi_shift,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EDGE: tl.constexpr,
):
    """:func:`~qkv.attention.triton.kernels.tile_scores` transposed, for one query head
    ``h`` (a scalar): scores ``(BN, BM)`` of keys ``j`` (rows) against queries ``i``
    (columns), and the dropout keep tile, so that ``Pᵀ·dO`` and ``dSᵀ·Q`` multiply tiles as
    they come out of ``K·Qᵀ`` (no tile held in registers is transposed). ``j0``: the key
    tile's first index (``j = j0 + arange``)."""
    s = matmul(k, tl.trans(q), PRECISION, UPCAST) * scale
    slope = s  # (unused without ALiBi)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h)
    s, keep = mask_tile(
        s, M, KEEP, b, h, i[None, :], j[:, None], cols_ok[:, None] & rows_ok[None, :], slope,
        smb, smh, smt, sms, H, T, S, causal, window, alibi_shift, j0,
        MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, DROPOUT, EDGE,
    )
    if DROPOUT == 2:
        keep = tl.trans(philox_keep(KEEP, b * H + h, i, j))  # the forward's tile, transposed
    return s, keep


@triton.jit
def _dkdv_span(
    dk, dvacc, k, v, Q_at, DO_at, LSE_at, DELTA_at, start, end, b, hs, j, j_lo, cols_ok,
    M, SLOPES, KEEP, sqt, sdt, smb, smh, smt, sms, H, T, S, D, DV, scale, causal,
    window, alibi_shift, keep_scale, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EDGE: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``dV += Pᵀ·dO`` and ``dK += dSᵀ·Q`` over query tiles ``[start, end)`` of head ``hs``,
    computed transposed (keys along rows)."""
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    for i0 in range(start, end, BLOCK_M):
        i = i0 + tl.arange(0, BLOCK_M)
        rows_ok = i < T
        q = load_tile(Q_at, i, rows_ok, sqt, D, d, EDGE, EVEN_D)
        do = load_tile(DO_at, i, rows_ok, sdt, DV, dv, EDGE, EVEN_D)
        if EDGE:
            lse = tl.load(LSE_at + i, mask=rows_ok, other=float("inf"))
            delta = tl.load(DELTA_at + i, mask=rows_ok, other=0.0)
        else:
            lse = tl.load(LSE_at + i)
            delta = tl.load(DELTA_at + i)
        s, keep = tile_scores_t(
            k, q, b, hs, i, j, j_lo, rows_ok, cols_ok, M, SLOPES, KEEP, smb, smh, smt, sms,
            H, T, S, scale, causal, window, alibi_shift,
            MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, DROPOUT, PRECISION, UPCAST, EDGE,
        )
        p = tl.math.exp2(s - lse[None, :] * 1.4426950408889634)  # Pᵀ (BN, BM)
        dp = matmul(v, tl.trans(do), PRECISION, UPCAST)  # dPᵀ
        p_applied = p
        if DROPOUT:
            p_applied = tl.where(keep, p * keep_scale, 0.0)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        dvacc += matmul(p_applied.to(do.dtype), do, PRECISION, UPCAST)
        ds = p * (dp - delta[None, :])
        dk += matmul(ds.to(q.dtype), q, PRECISION, UPCAST)
    return dk, dvacc


@triton.jit
def attention_backward_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV_, M, KEEP, SLOPES,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
    smb, smh, smt, sms,
    H, G, T, S, D, DV,
    scale, causal, window, alibi_shift, keep_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``dK`` and ``dV`` of one key tile, summed over the ``G`` query heads of its group."""
    scale2 = scale * 1.4426950408889634  # scores in base 2
    Hkv = H // G
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hkv = (tl.program_id(1) % Hkv).to(tl.int64)
    j_lo = tl.program_id(0) * BLOCK_N
    j = j_lo + tl.arange(0, BLOCK_N)
    cols_ok = j < S
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k = load_tile(K + b * skb + hkv * skh, j, cols_ok, sks, D, d, True, EVEN_D)
    v = load_tile(V + b * svb + hkv * svh, j, cols_ok, svs, DV, dv, True, EVEN_D)
    # Query rows that see some key of the tile: [lo, hi); that see all of them: [full_lo,
    # full_hi) (none when the tile runs past S: its last keys need the edge mask).
    j_hi = tl.minimum(j_lo + BLOCK_N, S) - 1
    lo = 0
    hi = T
    full_lo = 0
    full_hi = T
    if IS_CAUSAL:  # i >= j - causal; with a window also i < j - causal + window
        lo = tl.maximum(0, ((j_lo - causal) // BLOCK_M) * BLOCK_M)
        full_lo = j_hi - causal
        if HAS_WINDOW:
            hi = tl.minimum(T, j_hi - causal + window)
            full_hi = j_lo - causal + window
    partial = (j_lo + BLOCK_N > S).to(tl.int32)
    full_hi = tl.minimum(full_hi, T - partial * (T + 1))
    a, c = spans(lo, hi, full_lo, full_hi, BLOCK_M)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dvacc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        hs = hkv * G + g
        Q_at = Q + b * sqb + hs * sqh
        DO_at = DO + b * sdb + hs * sdh
        LSE_at = LSE + (b * H + hs) * T
        DELTA_at = DELTA + (b * H + hs) * T
        dk, dvacc = _dkdv_span(
            dk, dvacc, k, v, Q_at, DO_at, LSE_at, DELTA_at, lo, a, b, hs, j, j_lo, cols_ok,
            M, SLOPES, KEEP, sqt, sdt, smb, smh, smt, sms, H, T, S, D, DV, scale2, causal,
            window, alibi_shift, keep_scale, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI,
            DROPOUT, PRECISION, UPCAST, True, EVEN_D, BLOCK_M, BLOCK_D, BLOCK_DV,
        )
        dk, dvacc = _dkdv_span(
            dk, dvacc, k, v, Q_at, DO_at, LSE_at, DELTA_at, a, c, b, hs, j, j_lo, cols_ok,
            M, SLOPES, KEEP, sqt, sdt, smb, smh, smt, sms, H, T, S, D, DV, scale2, causal,
            window, alibi_shift, keep_scale, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI,
            DROPOUT, PRECISION, UPCAST, False, EVEN_D, BLOCK_M, BLOCK_D, BLOCK_DV,
        )
        dk, dvacc = _dkdv_span(
            dk, dvacc, k, v, Q_at, DO_at, LSE_at, DELTA_at, c, hi, b, hs, j, j_lo, cols_ok,
            M, SLOPES, KEEP, sqt, sdt, smb, smh, smt, sms, H, T, S, D, DV, scale2, causal,
            window, alibi_shift, keep_scale, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI,
            DROPOUT, PRECISION, UPCAST, True, EVEN_D, BLOCK_M, BLOCK_D, BLOCK_DV,
        )
    at = (b * Hkv + hkv) * S + j
    tl.store(DK + at[:, None] * D + d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=cols_ok[:, None] & (d[None, :] < D))
    tl.store(DV_ + at[:, None] * DV + dv[None, :], dvacc.to(DV_.dtype.element_ty),
             mask=cols_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def row_deltas(O, DO, DLSE, DELTA, rows, H, T, DV, sob, soh, sot, sdb, sdh, sdt,
               HAS_DLSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``δ = rowsum(dO ∘ O) - dlse`` in float32 for ``BLOCK_R`` of the ``B·H·T`` rows (row
    ``r`` is ``(b, h, t)`` in that order): ``O``, ``DO`` ``(B, H, T, Dv)`` at their strides,
    ``DLSE`` and ``DELTA`` ``(B, H, T)`` contiguous. One read of each, where the eager form
    writes and reads three float32 copies of ``(B, H, T, Dv)``."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < rows
    t = (r % T).to(tl.int64)
    b = (r // T // H).to(tl.int64)
    h = (r // T % H).to(tl.int64)
    dv = tl.arange(0, BLOCK_DV)
    edge = ok[:, None] & (dv[None, :] < DV)
    o = tl.load(O + (b * sob + h * soh + t * sot)[:, None] + dv[None, :], mask=edge, other=0.0)
    do = tl.load(DO + (b * sdb + h * sdh + t * sdt)[:, None] + dv[None, :], mask=edge,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + r, mask=ok, other=0.0)
    tl.store(DELTA + r, delta, mask=ok)
