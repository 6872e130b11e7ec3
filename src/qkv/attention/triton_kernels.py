"""Triton kernels of the ``triton`` backend: blockwise attention forward (with split-K for
decoding) and the two backward kernels of FlashAttention-2 (Dao, 2023).

Imported only when the backend runs (it needs the ``triton`` package). With
``TRITON_INTERPRET=1`` in the environment before this module is imported, the same kernels run
on CPU tensors through Triton's interpreter: that is how the test suite checks them on machines
without a GPU.

Layout. One program of the forward kernel owns ``BLOCK_M`` *packed rows* of one ``(b, hkv)``
pair: the ``G·T`` query rows of the ``G = H / Hkv`` query heads that share key/value head
``hkv``, row ``r`` being query ``i = r mod T`` of head ``h = hkv·G + r div T``. A key tile is
loaded once for all of them, so grouped-query attention never repeats K or V, and a decoding
step (``T = 1``) fills a tile with its group's heads. A third grid axis splits the keys
(flash-decoding): each split writes its own output and log-sum-exp, merged afterwards.

Every mask part of an :class:`~qkv.attention.call.AttentionCall` is computed per tile, with
the meaning :func:`qkv.attention.masks.apply_mask` gives it: the causal diagonal
``j <= i + causal`` and window ``j > i + causal - window``, ALiBi ``-slope_h·|i + shift - j|``,
a boolean keep mask or a float mask read through its (broadcast, stride-0) strides, and
torch's dropout keep mask (drawn by :func:`qkv.attention.masks.dropout_keep`, so one seed
drops the same weights as every other backend). A row with no visible key keeps
``l = 0``: zero output, ``lse = -inf``, zero gradients.

Shapes: ``q (B, H, T, D)``, ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``; accumulation in
float32; ``lse (B, H, T)`` float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32. ``UPCAST`` (bfloat16 under the interpreter, whose
    bfloat16 dot is wrong in Triton 3.9) multiplies float32 copies: the same products, as
    bfloat16 products are exact in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _tile_scores(
    q, k, b, h, i, j, rows_ok, cols_ok, M, SLOPES, KEEP,
    smb, smh, smt, sms, H, T, S, scale, causal, window, alibi_shift,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Scores ``(BM, BN)`` of query rows ``(b, h[r], i[r])`` against keys ``j``, scaled and
    masked (hidden: ``-inf``), and the dropout keep tile (meaningless without dropout)."""
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale
    visible = rows_ok[:, None] & cols_ok[None, :]
    if IS_CAUSAL:
        visible = visible & (j[None, :] <= i[:, None] + causal)
        if HAS_WINDOW:
            visible = visible & (j[None, :] > i[:, None] + causal - window)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h, mask=rows_ok, other=0.0)
        distance = tl.abs(i[:, None] + alibi_shift - j[None, :]).to(tl.float32)
        s = s - slope[:, None] * distance
    if MASK_KIND != 0:
        where = (b * smb + h[:, None].to(tl.int64) * smh + i[:, None].to(tl.int64) * smt
                 + j[None, :].to(tl.int64) * sms)
        if MASK_KIND == 1:
            visible = visible & (tl.load(M + where, mask=visible, other=0) != 0)
        else:
            s = s + tl.load(M + where, mask=visible, other=0.0).to(tl.float32)
    s = tl.where(visible, s, float("-inf"))
    keep = visible  # unused without dropout (a compiled kernel cannot return None)
    if HAS_DROPOUT:
        row = (b * H + h[:, None].to(tl.int64)) * T + i[:, None].to(tl.int64)
        keep = tl.load(KEEP + row * S + j[None, :], mask=visible, other=0) != 0
    return s, keep


@triton.jit
def _key_range(i_lo, i_hi, lo, hi, causal, window,
               IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys ``[lo, hi)`` that queries ``i_lo..i_hi`` may see, ``lo`` rounded down to a tile."""
    if IS_CAUSAL:
        hi = tl.minimum(hi, i_hi + causal + 1)
        if HAS_WINDOW:
            lo = tl.maximum(lo, ((i_lo + causal - window + 1) // BLOCK_N) * BLOCK_N)
    return lo, hi


@triton.jit
def _rows(pid_m, hkv, G, T, BLOCK_M: tl.constexpr):
    """Packed rows of a program: head ``h``, query ``i``, validity, and the bounds
    ``i_lo..i_hi`` of the queries it holds (all of ``0..T-1`` when it spans two heads)."""
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < G * T
    h = hkv * G + r // T
    i = r % T
    r0 = pid_m * BLOCK_M
    r1 = tl.minimum(r0 + BLOCK_M, G * T) - 1
    one_head = ((r0 // T) == (r1 // T)).to(tl.int32)  # scalars stay scalars (no tl.where)
    i_lo = (r0 % T) * one_head
    i_hi = (r1 % T) * one_head + (T - 1) * (1 - one_head)
    return h, i, ok, i_lo, i_hi


@triton.jit
def attention_forward(
    Q, K, V, O, L, M, KEEP, SLOPES,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot, slb, slh,
    smb, smh, smt, sms, so_split, sl_split,
    H, G, T, S, D, DV, split_len,
    scale, causal, window, alibi_shift, keep_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Output rows (normalised) and their lse for one tile of packed rows and one key split."""
    pid_m = tl.program_id(0)
    Hkv = H // G
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hkv = (tl.program_id(1) % Hkv).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    h, i, rows_ok, i_lo, i_hi = _rows(pid_m, hkv, G, T, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_at = Q + b * sqb + h[:, None] * sqh + i[:, None].to(tl.int64) * sqt + d[None, :]
    q = tl.load(q_at, mask=rows_ok[:, None] & (d[None, :] < D), other=0.0)
    split_lo = split * split_len
    split_hi = tl.minimum(S, split_lo + split_len)
    lo, hi = _key_range(i_lo, i_hi, split_lo, split_hi, causal, window,
                        IS_CAUSAL, HAS_WINDOW, BLOCK_N)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        cols_ok = j < split_hi
        k = tl.load(K + b * skb + hkv * skh + j[:, None].to(tl.int64) * sks + d[None, :],
                    mask=cols_ok[:, None] & (d[None, :] < D), other=0.0)
        v = tl.load(V + b * svb + hkv * svh + j[:, None].to(tl.int64) * svs + dv[None, :],
                    mask=cols_ok[:, None] & (dv[None, :] < DV), other=0.0)
        s, keep = _tile_scores(
            q, k, b, h, i, j, rows_ok, cols_ok, M, SLOPES, KEEP, smb, smh, smt, sms,
            H, T, S, scale, causal, window, alibi_shift,
            MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, HAS_DROPOUT, PRECISION, UPCAST,
        )
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # dead so far: exps give 0
        p = tl.math.exp2((s - m_safe[:, None]) * 1.4426950408889634)
        alpha = tl.math.exp2((m - m_safe) * 1.4426950408889634)
        l = l * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            p = tl.where(keep, p * keep_scale, 0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m = m_new
    dead = l == 0.0
    out = acc / tl.where(dead, 1.0, l)[:, None]
    lse = tl.where(dead, float("-inf"), m + tl.log(tl.where(dead, 1.0, l)))
    o_at = (O + split * so_split + b * sob + h[:, None] * soh + i[:, None].to(tl.int64) * sot
            + dv[None, :])
    tl.store(o_at, out.to(O.dtype.element_ty), mask=rows_ok[:, None] & (dv[None, :] < DV))
    tl.store(L + split * sl_split + b * slb + h * slh + i, lse, mask=rows_ok)


@triton.jit
def attention_backward_dq(
    Q, K, V, DO, LSE, DELTA, DQ, M, KEEP, SLOPES,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
    smb, smh, smt, sms,
    H, G, T, S, D, DV,
    scale, causal, window, alibi_shift, keep_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``dQ`` of one tile of packed rows: ``scale · Σ_j dS·K`` with ``dS = P ∘ (dP - δ)``.

    ``LSE`` holds ``+inf`` on dead rows (their ``P`` is then exactly 0); ``DELTA`` is
    ``rowsum(dO ∘ O)`` minus the lse's own incoming gradient. ``DQ``, ``LSE`` and ``DELTA``
    are contiguous; ``DO`` shares ``DQ``'s strides.
    """
    pid_m = tl.program_id(0)
    Hkv = H // G
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hkv = (tl.program_id(1) % Hkv).to(tl.int64)
    h, i, rows_ok, i_lo, i_hi = _rows(pid_m, hkv, G, T, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None].to(tl.int64) * sqt + d[None, :],
                mask=rows_ok[:, None] & (d[None, :] < D), other=0.0)
    row = (b * H + h) * T + i
    do = tl.load(DO + b * sdb + h[:, None] * sdh + i[:, None].to(tl.int64) * sdt + dv[None, :],
                 mask=rows_ok[:, None] & (dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + row, mask=rows_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=rows_ok, other=0.0)
    lo, hi = _key_range(i_lo, i_hi, 0, S, causal, window, IS_CAUSAL, HAS_WINDOW, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        cols_ok = j < S
        k = tl.load(K + b * skb + hkv * skh + j[:, None].to(tl.int64) * sks + d[None, :],
                    mask=cols_ok[:, None] & (d[None, :] < D), other=0.0)
        v = tl.load(V + b * svb + hkv * svh + j[:, None].to(tl.int64) * svs + dv[None, :],
                    mask=cols_ok[:, None] & (dv[None, :] < DV), other=0.0)
        s, keep = _tile_scores(
            q, k, b, h, i, j, rows_ok, cols_ok, M, SLOPES, KEEP, smb, smh, smt, sms,
            H, T, S, scale, causal, window, alibi_shift,
            MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, HAS_DROPOUT, PRECISION, UPCAST,
        )
        p = tl.math.exp2((s - lse[:, None]) * 1.4426950408889634)
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
        if HAS_DROPOUT:
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)
    at = DQ + row[:, None] * D + d[None, :]
    tl.store(at, (dq * scale).to(DQ.dtype.element_ty), mask=rows_ok[:, None] & (d[None, :] < D))


@triton.jit
def attention_backward_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV_, M, KEEP, SLOPES,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
    smb, smh, smt, sms,
    H, G, T, S, D, DV,
    scale, causal, window, alibi_shift, keep_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``dK`` and ``dV`` of one key tile, summed over the ``G`` query heads of its group.

    ``dV = Σ Pᵀ·dO`` (dropout applied), ``dK = scale · Σ dSᵀ·Q``; ``DK``/``DV_`` contiguous
    ``(B, Hkv, S, D|Dv)``.
    """
    Hkv = H // G
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hkv = (tl.program_id(1) % Hkv).to(tl.int64)
    j = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = j < S
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + b * skb + hkv * skh + j[:, None].to(tl.int64) * sks + d[None, :],
                mask=cols_ok[:, None] & (d[None, :] < D), other=0.0)
    v = tl.load(V + b * svb + hkv * svh + j[:, None].to(tl.int64) * svs + dv[None, :],
                mask=cols_ok[:, None] & (dv[None, :] < DV), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dvacc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    j_lo = tl.program_id(0) * BLOCK_N
    j_hi = tl.minimum(j_lo + BLOCK_N, S) - 1
    lo = 0
    hi = T
    if IS_CAUSAL:  # queries i with j_lo <= i + causal, and (window) j_hi > i + causal - window
        lo = tl.maximum(0, ((j_lo - causal) // BLOCK_M) * BLOCK_M)
        if HAS_WINDOW:
            hi = tl.minimum(T, j_hi - causal + window)
    for g in range(0, G):
        hs = hkv * G + g
        for i0 in range(lo, hi, BLOCK_M):
            i = i0 + tl.arange(0, BLOCK_M)
            rows_ok = i < T
            h = hs + tl.zeros([BLOCK_M], tl.int64)
            q = tl.load(Q + b * sqb + hs * sqh + i[:, None].to(tl.int64) * sqt + d[None, :],
                        mask=rows_ok[:, None] & (d[None, :] < D), other=0.0)
            do = tl.load(
                DO + b * sdb + hs * sdh + i[:, None].to(tl.int64) * sdt + dv[None, :],
                mask=rows_ok[:, None] & (dv[None, :] < DV), other=0.0,
            )
            row = (b * H + hs) * T + i
            lse = tl.load(LSE + row, mask=rows_ok, other=float("inf"))
            delta = tl.load(DELTA + row, mask=rows_ok, other=0.0)
            s, keep = _tile_scores(
                q, k, b, h, i, j, rows_ok, cols_ok, M, SLOPES, KEEP, smb, smh, smt, sms,
                H, T, S, scale, causal, window, alibi_shift,
                MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, HAS_DROPOUT, PRECISION, UPCAST,
            )
            p = tl.math.exp2((s - lse[:, None]) * 1.4426950408889634)  # (BM, BN)
            dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
            p_applied = p
            if HAS_DROPOUT:
                p_applied = tl.where(keep, p * keep_scale, 0.0)
                dp = tl.where(keep, dp * keep_scale, 0.0)
            dvacc += _dot(tl.trans(p_applied.to(do.dtype)), do, PRECISION, UPCAST)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    at = (b * Hkv + hkv) * S + j
    tl.store(DK + at[:, None] * D + d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=cols_ok[:, None] & (d[None, :] < D))
    tl.store(DV_ + at[:, None] * DV + dv[None, :], dvacc.to(DV_.dtype.element_ty),
             mask=cols_ok[:, None] & (dv[None, :] < DV))
