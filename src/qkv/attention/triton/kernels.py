"""Triton kernels of the ``triton`` backend: the blockwise forward (with key splits for
decoding) and what the backward kernels (:mod:`qkv.attention.triton.backward`) share with it.

Imported only when the backend runs (it needs the ``triton`` package). With
``TRITON_INTERPRET=1`` in the environment before this module is imported, the same kernels run
on CPU tensors through Triton's interpreter: that is how the test suite checks them on machines
without a GPU (and ``tests/attention/triton_compile_check.py`` compiles them for sm_90/sm_80).

Layout. One program of the forward kernel owns ``BLOCK_M`` *packed rows* of one ``(b, hkv)``
pair: the ``G·T`` query rows of the ``G = H / Hkv`` query heads that share key/value head
``hkv``, row ``r`` being query ``i = r mod T`` of head ``h = hkv·G + r div T``. A key tile is
loaded once for all of them, so grouped-query attention never repeats K or V, and a decoding
step (``T = 1``) fills a tile with its group's heads. A third grid axis splits the keys
(flash-decoding): each split writes its own output and log-sum-exp, merged afterwards.

Every mask part of an :class:`~qkv.attention.call.AttentionCall` is computed per tile, with the
meaning :func:`qkv.attention.masks.apply_mask` gives it: the causal diagonal ``j <= i +
causal`` and window ``j > i + causal - window``, ALiBi ``-slope_h·|i + shift - j|``, a boolean
keep mask or a float mask read through its (broadcast, stride-0) strides, and dropout as
:mod:`qkv.attention.dropout` defines it (``DROPOUT`` 1: a drawn keep mask read by tile, on CPU
tensors; 2: the counter-based mask computed in the kernel from a seed, on a GPU), so one seed
drops the same weights as every other backend. Only tiles that the diagonal, the window edge or
the end of the keys cross build the structure mask (*edge* spans); the tiles between them (the
*inner* span) skip it. A row with no visible key keeps ``l = 0``: zero output, ``lse = -inf``,
zero gradients.

Scores are kept in base 2 (``scale`` arrives multiplied by log₂e, biases are multiplied by
it), so each probability is one ``exp2``. Shapes: ``q (B, H, T, D)``, ``k (B, Hkv, S, D)``,
``v (B, Hkv, S, Dv)``; accumulation in float32; ``lse (B, H, T)`` float32, natural log.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the kernels write it as a literal: a global is not a constant


@triton.jit
def matmul(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32. ``UPCAST`` (bfloat16 under the interpreter, whose
    bfloat16 dot is wrong in Triton 3.9) multiplies float32 copies: the same products, as
    bfloat16 products are exact in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def tile_scores(
    q, k, b, h, i, j, j0, rows_ok, cols_ok, M, SLOPES, KEEP,
    smb, smh, smt, sms, H, T, S, scale, causal, window, alibi_shift,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EDGE: tl.constexpr,
):
    """Scores ``(BM, BN)`` in base 2 of query rows ``(b, h[r], i[r])`` against keys ``j``,
    biased and masked (hidden: ``-inf``), and the dropout keep tile (meaningless without
    dropout). ``EDGE``: the tile may hold invalid rows or keys, or cross the causal diagonal
    or the window's edge; an inner tile skips that mask. ``j0``: the key tile's first index
    (``j = j0 + arange``), what ALiBi's distances are counted from."""
    s = matmul(q, tl.trans(k), PRECISION, UPCAST) * scale
    slope = s  # (unused without ALiBi)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h, mask=rows_ok, other=0.0)[:, None]
    s, keep = mask_tile(
        s, M, KEEP, b, h[:, None], i[:, None], j[None, :], rows_ok[:, None] & cols_ok[None, :],
        slope, smb, smh, smt, sms, H, T, S, causal, window, alibi_shift, j0,
        MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, DROPOUT, EDGE,
    )
    if DROPOUT == 2:
        keep = philox_keep(KEEP, (b * H + h)[:, None], i, j)
    return s, keep


@triton.jit
def alibi_distance(ii, jj, shift, base):
    """ALiBi's ``|i + shift - j|`` as float32 for query indices ``ii`` and key indices ``jj``
    broadcast against each other: the difference of ``i + shift - base`` and ``j - base``,
    each converted on its own. ``base`` (a scalar) makes one side a tile's own ``arange``,
    converted once for every tile, so a tile converts per row or per column, where each
    score's distance took a conversion of its own (sm_90, triton 3.6, the forward: 67 of the
    slow integer-to-float instruction ``I2F`` against 7 now, its inner loop 672 instructions
    against 456). Exact while the distances are under 2²⁴, as converting them whole was."""
    return tl.abs((ii + (shift - base)).to(tl.float32) - (jj - base).to(tl.float32))


@triton.jit
def mask_tile(
    s, M, KEEP, b, hh, ii, jj, inside, slope, smb, smh, smt, sms, H, T, S, causal, window,
    alibi_shift, alibi_base, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    EDGE: tl.constexpr,
):
    """Every mask part on base-2 scores ``s``, in either orientation: ``hh``, ``ii``, ``jj``
    are the head, query and key indices broadcast to the tile (``(BM, 1)``, ``(BM, 1)``,
    ``(1, BN)`` as computed, or keys along rows for ``dK``/``dV``), ``inside`` the valid
    entries, ``slope`` ALiBi's slope (broadcast like ``hh``). Returns ``(s, keep)``, ``keep``
    the drawn dropout mask read by tile (``DROPOUT`` 1; meaningless otherwise).

    ``alibi_base``: see :func:`alibi_distance`."""
    if HAS_ALIBI:
        distance = alibi_distance(ii, jj, alibi_shift, alibi_base)
        s = s - (slope * 1.4426950408889634) * distance
    if MASK_KIND != 0:
        where = (b * smb + hh.to(tl.int64) * smh + ii.to(tl.int64) * smt
                 + jj.to(tl.int64) * sms)
        if MASK_KIND == 1:
            s = tl.where(tl.load(M + where, mask=inside, other=0) != 0, s, float("-inf"))
        else:
            bias = tl.load(M + where, mask=inside, other=0.0).to(tl.float32)
            s = s + bias * 1.4426950408889634
    if EDGE:
        visible = inside
        if IS_CAUSAL:
            visible = visible & (jj <= ii + causal)
            if HAS_WINDOW:
                visible = visible & (jj > ii + causal - window)
        s = tl.where(visible, s, float("-inf"))
    keep = inside  # unused without dropout (a compiled kernel cannot return None)
    if DROPOUT == 1:
        row = (b * H + hh.to(tl.int64)) * T + ii.to(tl.int64)
        keep = tl.load(KEEP + row * S + jj, mask=inside, other=0) != 0
    return s, keep


@triton.jit
def philox_keep(STATE, bh, i, j):
    """The counter-based dropout keep tile ``(BM, BN)`` of :mod:`qkv.attention.dropout` for
    queries ``i (BM,)`` of head ``bh = b·H + h`` (a scalar or ``(BM, 1)``) and keys
    ``j (BN,)``, consecutive from a multiple of 8. One Philox4x32-10 evaluation, keyed by
    ``STATE[0]`` at counter ``(j // 8, i, bh, 0)``, gives the 16-bit numbers of eight keys
    (key ``8c + k``: half ``k % 2`` of word ``k // 2``); a weight is kept when its number
    reaches ``STATE[1]``."""
    seed = tl.load(STATE)
    below = tl.load(STATE + 1).to(tl.int32)
    BN: tl.constexpr = j.shape[0]
    c = tl.min(j, 0) // 8 + tl.arange(0, BN // 8)
    w0, w1, w2, w3 = tl.philox(seed, c[None, :].to(tl.uint32), i[:, None].to(tl.uint32),
                               bh.to(tl.uint32), 0)  # each (BM, BN/8)
    # (BM, BN/8, 8) in key order, then (BM, BN): tl.join adds its axis last, so the halves
    # of a group are joined slowest-varying first (k = 4r + 2p + q).
    low = tl.join(tl.join(w0 & 0xFFFF, w2 & 0xFFFF), tl.join(w1 & 0xFFFF, w3 & 0xFFFF))
    high = tl.join(tl.join(w0 >> 16, w2 >> 16), tl.join(w1 >> 16, w3 >> 16))
    bits = tl.reshape(tl.join(low, high), (i.shape[0], BN))
    return bits.to(tl.int32, bitcast=True) >= below


@triton.jit
def load_tile(at, rows, rows_ok, stride, width, cols, EDGE: tl.constexpr,
              EVEN_D: tl.constexpr):
    """Rows ``rows`` of a ``(·, width)`` operand at ``at`` (row stride ``stride``): masked
    on invalid rows when ``EDGE``, on padded columns unless ``EVEN_D``."""
    ptrs = at + rows[:, None].to(tl.int64) * stride + cols[None, :]
    if EDGE:
        if EVEN_D:
            return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=rows_ok[:, None] & (cols[None, :] < width), other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=cols[None, :] < width, other=0.0)


@triton.jit
def spans(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Split ``[lo, hi)`` (``lo`` on a tile edge) into edge ``[lo, a)``, inner ``[a, c)`` and
    edge ``[c, hi)``: the inner span is the whole tiles inside ``[full_lo, full_hi)``."""
    a = lo + ((tl.maximum(full_lo, lo) - lo + BLOCK - 1) // BLOCK) * BLOCK
    a = tl.minimum(a, hi)
    c = lo + (tl.maximum(full_hi - lo, 0) // BLOCK) * BLOCK
    c = tl.maximum(tl.minimum(c, hi), a)  # hi < lo (nothing to visit): every span empty
    return a, c


@triton.jit
def poisoned_rows(q):
    """Rows ``(BM,)`` of a query tile holding NaN or ``±inf``: their output is NaN."""
    bad = (tl.abs(q.to(tl.float32)) == float("inf")) | (q != q)
    return tl.max(bad.to(tl.int32), 1) != 0


@triton.jit
def finish_rows(acc, l, m, poisoned):
    """Normalised output rows and their natural-log lse from the online softmax's base-2
    ``(acc, l, m)``: a row that saw no key (``l = 0``) gives zeros and ``-inf``, a
    poisoned one NaN."""
    dead = l == 0.0
    out = acc / tl.where(dead, 1.0, l)[:, None]
    out = tl.where(poisoned[:, None], float("nan"), out)
    log2_total = m + tl.math.log2(tl.where(dead, 1.0, l))
    return out, tl.where(dead, float("-inf"), log2_total * 0.6931471805599453)


@triton.jit
def packed_rows(pid_m, hkv, G, T, BLOCK_M: tl.constexpr):
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
def key_spans(i_lo, i_hi, lo, hi, causal, window, IS_CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys ``[lo, hi)`` that queries ``i_lo..i_hi`` may see (``lo`` on a tile edge), and the
    inner span ``[a, c)`` every one of them sees whole."""
    full_lo = lo
    full_hi = hi
    if IS_CAUSAL:
        hi = tl.minimum(hi, i_hi + causal + 1)
        full_hi = tl.minimum(hi, i_lo + causal + 1)
        if HAS_WINDOW:
            lo = tl.maximum(lo, ((i_lo + causal - window + 1) // BLOCK_N) * BLOCK_N)
            full_lo = i_hi + causal - window + 1
    a, c = spans(lo, hi, full_lo, full_hi, BLOCK_N)
    return lo, a, c, hi


@triton.jit
def key_tile(
    q, K_at, V_at, j0, cols_end, b, h, i, rows_ok, M, SLOPES, KEEP, sks, svs,
    smb, smh, smt, sms, H, T, S, D, DV, scale, causal, window, alibi_shift,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EDGE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The key tile at ``j0`` (keys below ``cols_end``) for the query rows ``q``:
    ``(k, v, base-2 scores, dropout keep tile)`` (see :func:`tile_scores`)."""
    j = j0 + tl.arange(0, BLOCK_N)
    cols_ok = j < cols_end
    k = load_tile(K_at, j, cols_ok, sks, D, tl.arange(0, BLOCK_D), EDGE, EVEN_D)
    v = load_tile(V_at, j, cols_ok, svs, DV, tl.arange(0, BLOCK_DV), EDGE, EVEN_D)
    s, keep = tile_scores(
        q, k, b, h, i, j, j0, rows_ok, cols_ok, M, SLOPES, KEEP, smb, smh, smt, sms,
        H, T, S, scale, causal, window, alibi_shift,
        MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, DROPOUT, PRECISION, UPCAST, EDGE,
    )
    return k, v, s, keep


@triton.jit
def softmax_step(m, l, acc, s, v, keep, keep_scale, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr, DROPOUT: tl.constexpr):
    """One key tile of the online softmax: base-2 scores ``s (BM, BN)`` and values
    ``v (BN, Dv)`` into the running ``(m, l, acc)``; the updated three. With ``DROPOUT`` the
    weights summed into ``acc`` are dropped where ``keep (BM, BN)`` is False and the rest
    scaled by ``keep_scale``; the denominator ``l`` counts every weight."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # dead so far: exps give 0
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(keep, p * keep_scale, 0.0)
    acc = acc * alpha[:, None] + matmul(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l, acc


@triton.jit
def _forward_span(
    acc, l, m, q, K_at, V_at, start, end, cols_end, b, h, i, rows_ok, M, SLOPES, KEEP,
    sks, svs, smb, smh, smt, sms, H, T, S, D, DV, scale, causal, window, alibi_shift,
    keep_scale, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EDGE: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """The online softmax over key tiles ``[start, end)``: updated ``(acc, l, m)``."""
    for j0 in range(start, end, BLOCK_N):
        _, v, s, keep = key_tile(
            q, K_at, V_at, j0, cols_end, b, h, i, rows_ok, M, SLOPES, KEEP, sks, svs,
            smb, smh, smt, sms, H, T, S, D, DV, scale, causal, window, alibi_shift,
            MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI, DROPOUT, PRECISION, UPCAST, EDGE,
            EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
        )
        m, l, acc = softmax_step(m, l, acc, s, v, keep, keep_scale, PRECISION, UPCAST,
                                 DROPOUT)
    return acc, l, m


@triton.jit
def attention_forward(
    Q, K, V, O, L, M, KEEP, SLOPES,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot, slb, slh,
    smb, smh, smt, sms, so_split, sl_split,
    H, G, T, S, D, DV, split_len,
    scale, causal, window, alibi_shift, keep_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Output rows (normalised) and their lse for one tile of packed rows and one key split."""
    scale = scale * 1.4426950408889634  # base 2 from here on
    Hkv = H // G
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hkv = (tl.program_id(1) % Hkv).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    h, i, rows_ok, i_lo, i_hi = packed_rows(tl.program_id(0), hkv, G, T, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q + b * sqb + h[:, None] * sqh, i, rows_ok, sqt, D, d, True, EVEN_D)
    poisoned = poisoned_rows(q)  # NaN or ±inf in a query row: a NaN output row (the contract)
    split_lo = split * split_len
    split_hi = tl.minimum(S, split_lo + split_len)
    lo, a, c, hi = key_spans(i_lo, i_hi, split_lo, split_hi, causal, window,
                             IS_CAUSAL, HAS_WINDOW, BLOCK_N)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    K_at = K + b * skb + hkv * skh
    V_at = V + b * svb + hkv * svh
    acc, l, m = _forward_span(  # the edge tiles before the inner span (a window's edge)
        acc, l, m, q, K_at, V_at, lo, a, split_hi, b, h, i, rows_ok, M, SLOPES,
        KEEP, sks, svs, smb, smh, smt, sms, H, T, S, D, DV, scale, causal, window,
        alibi_shift, keep_scale, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI,
        DROPOUT, PRECISION, UPCAST, True, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
    )
    acc, l, m = _forward_span(  # the inner span: no structure mask
        acc, l, m, q, K_at, V_at, a, c, split_hi, b, h, i, rows_ok, M, SLOPES,
        KEEP, sks, svs, smb, smh, smt, sms, H, T, S, D, DV, scale, causal, window,
        alibi_shift, keep_scale, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI,
        DROPOUT, PRECISION, UPCAST, False, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
    )
    acc, l, m = _forward_span(  # the edge tiles after it (the diagonal, the keys' end)
        acc, l, m, q, K_at, V_at, c, hi, split_hi, b, h, i, rows_ok, M, SLOPES,
        KEEP, sks, svs, smb, smh, smt, sms, H, T, S, D, DV, scale, causal, window,
        alibi_shift, keep_scale, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI,
        DROPOUT, PRECISION, UPCAST, True, EVEN_D, BLOCK_N, BLOCK_D, BLOCK_DV,
    )
    out, lse = finish_rows(acc, l, m, poisoned)
    store_rows(O + split * so_split + b * sob, L + split * sl_split + b * slb, out, lse, h, i,
               rows_ok, soh, sot, slh, dv, DV)


@triton.jit
def store_rows(O_AT, L_AT, out, lse, h, i, rows_ok, soh, sot, slh, dv, DV):
    """Store packed rows ``(h[r], i[r])``: ``out (BM, BLOCK_DV)`` at ``O_AT`` (a split's and
    batch row's output), ``lse (BM,)`` at ``L_AT``."""
    o_at = O_AT + h[:, None] * soh + i[:, None].to(tl.int64) * sot + dv[None, :]
    tl.store(o_at, out.to(O_AT.dtype.element_ty), mask=rows_ok[:, None] & (dv[None, :] < DV))
    tl.store(L_AT + h * slh + i, lse, mask=rows_ok)


@triton.jit
def merge_splits(O_PART, L_PART, O, L, n, rows, DV, BLOCK_R: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge ``n`` key splits ``o (n, rows, Dv)`` float32 and ``lse (n, rows)`` by log-sum-exp
    into ``O (rows, Dv)`` and ``L (rows,)``: ``out = Σ w_s o_s / Σ w_s`` with
    ``w_s = exp(lse_s - max lse)``. A row no split saw keeps zeros and ``-inf``; NaN stays.

    ``BLOCK_S`` splits are read at once, ``(BLOCK_S, BLOCK_R, BLOCK_DV)``, so a decoding
    step's dozen splits cost one memory latency, not one a split (a loop over splits waits
    for each load before the next)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < rows
    dv = tl.arange(0, BLOCK_DV)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s0 in range(0, n, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(L_PART + sp[:, None] * rows + r[None, :],
                      mask=(sp[:, None] < n) & ok[None, :], other=float("-inf"))
        top = tl.maximum(top, tl.max(lse, 0))
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for s0 in range(0, n, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        seen = (sp[:, None] < n) & ok[None, :]  # (BLOCK_S, BLOCK_R)
        w = tl.exp(tl.load(L_PART + sp[:, None] * rows + r[None, :], mask=seen,
                           other=float("-inf")) - top[None, :])
        at = (sp[:, None, None] * rows + r[None, :, None]).to(tl.int64) * DV + dv[None, None, :]
        o = tl.load(O_PART + at, mask=seen[:, :, None] & (dv[None, None, :] < DV), other=0.0)
        acc += tl.sum(w[:, :, None] * o, 0)
        total += tl.sum(w, 0)
    dead = total == 0.0
    out = acc / tl.where(dead, 1.0, total)[:, None]
    lse = tl.where(dead, float("-inf"), top + tl.log(tl.where(dead, 1.0, total)))
    tl.store(O + r[:, None].to(tl.int64) * DV + dv[None, :], out.to(O.dtype.element_ty),
             mask=ok[:, None] & (dv[None, :] < DV))
    tl.store(L + r, lse, mask=ok)
