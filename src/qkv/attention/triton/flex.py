"""Triton kernels of block-sparse programmable attention: :func:`qkv.flex_attention` with a
:class:`~qkv.attention.flex.blocks.BlockMask` (and no ``score_mod``) on a GPU.

A program owns one query tile of one ``(b, h)`` and visits only the key tiles its block mask
marks visible, read from tables built once per block mask (:mod:`qkv.attention.flex.triton_path`):
``KV_COUNT``/``KV_PART``/``KV_IDX`` (visited key tiles per query tile: the partial ones
first, then the full ones, each ascending), ``Q_COUNT``/``Q_PART``/``Q_IDX`` (the same for
query tiles per key tile, for ``dK``/``dV``), and ``SLOT`` (per tile: -1 when full, else the
index of its ``SPARSE_M × SPARSE_N`` keep tile in ``KEEP``, ``mask_mod`` evaluated once, on
partial tiles only). Each kernel runs two loops: partial tiles reading their keep tile, then
full tiles reading no mask. The tables are per block of the block mask (``SPARSE_M ×
SPARSE_N``, its ``BLOCK_SIZE``); the kernels compute in tiles of ``BLOCK_M × BLOCK_N`` that
divide it (a 128 × 128 block as two 128 × 64 tiles, as torch's flex kernels do on Hopper:
fewer registers a tile), one flat loop over (block, tile within it). The tables may be
shared by every batch row or head (a block mask built with ``B`` or ``H`` None):
``BB``/``HB`` are 1 when they vary over it, 0 when not, and ``HT`` is the tables' head count.

Three ready score mods run inside the kernels (``SCORE_MOD``): ALiBi
(:func:`qkv.attention.score_mods.alibi`, 1), soft-capping
(:func:`qkv.attention.score_mods.soft_cap`, 2) and T5's relative bias
(:func:`qkv.attention.score_mods.relative_bias`, 3: read as a bias by head and distance,
``MOD_DATA (H, T + S - 1)``, built from the table and its buckets once per call, so the
buckets are torch's own); any other ``score_mod`` keeps the tile loop. Learned slopes and
tables get their gradient from the ``dQ`` kernel (``GRAD_MOD``, into ``DMOD_DATA``).

Dropout (``DROPOUT``, the ``DROP`` state of :func:`qkv.attention.dropout.dropout_state`):
each kernel computes the counter-based keep tile of the weights it visits
(:func:`~qkv.attention.triton.kernels.philox_keep`; transposed in ``dK``/``dV``), the mask
the dense definition draws on a GPU, so nothing of size ``(B, H, T, S)`` exists.

Shapes: ``q (B, H, T, D)``, ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``; ``lse (B, H, T)``
float32 natural log; ``dQ``, ``dK``, ``dV`` contiguous. Scores in base 2 inside, as in
:mod:`qkv.attention.triton.kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qkv.attention.triton.kernels import (
    alibi_distance,
    finish_rows,
    load_tile,
    matmul,
    philox_keep,
    poisoned_rows,
    softmax_step,
)


@triton.jit
def _tanh(x):
    """``tanh(x)`` from one exp (the interpreter has no libdevice): absolute error ~1e-7."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _tile(q, k, i, j, j0, rows_ok, cols_ok, keep_at, mod_at, offset, cap, scale,
          SCORE_MOD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_N: tl.constexpr,
          MASKED: tl.constexpr, EVEN: tl.constexpr):
    """Base-2 scores of one tile after the score mod (``SCORE_MOD`` 1: ALiBi
    ``-slope_h·|i + offset - j|``, 2: soft-cap ``cap·tanh(s / cap)``, 3: plus the bias of
    distance ``j - i``; ``mod_at`` from :func:`_mod_row`), ``-inf`` where the
    block mask (a partial block, ``MASKED``: ``keep_at`` points at this tile's corner of its
    keep tile, rows ``SPARSE_N`` apart) or the edges hide a key (none with ``EVEN``: every
    tile inside ``T × S``); and ``d mod / d s`` (soft-cap: ``1 - tanh²``; meaningless
    otherwise). ``j0``: the tile's first key (``j = j0 + arange``)."""
    if SCORE_MOD == 0:  # base 2 at once: one multiply a score
        s = matmul(q, tl.trans(k), PRECISION, UPCAST) * (scale * 1.4426950408889634)
        dmod = s
    else:  # the score mods act in natural units
        s = matmul(q, tl.trans(k), PRECISION, UPCAST) * scale
        dmod = s
        if SCORE_MOD == 1:
            s = s - tl.load(mod_at) * alibi_distance(i[:, None], j[None, :], offset, j0)
        if SCORE_MOD == 3:
            ok = rows_ok[:, None] & cols_ok[None, :]
            s = s + tl.load(mod_at + (j[None, :] - i[:, None]), mask=ok, other=0.0)
        if SCORE_MOD == 2:
            t = _tanh(s / cap)
            s = cap * t
            dmod = 1.0 - t * t
        s = s * 1.4426950408889634
    if MASKED:
        r = tl.arange(0, BLOCK_M)
        c = tl.arange(0, BLOCK_N)
        at = keep_at + r[:, None] * SPARSE_N + c[None, :]
        if EVEN:
            s = tl.where(tl.load(at) != 0, s, float("-inf"))
        else:
            keep = tl.load(at, mask=rows_ok[:, None], other=1) != 0
            s = tl.where(keep & rows_ok[:, None] & cols_ok[None, :], s, float("-inf"))
    elif not EVEN:
        s = tl.where(rows_ok[:, None] & cols_ok[None, :], s, float("-inf"))
    return s, dmod


@triton.jit
def _keep_at(KEEP, slot, r0, c0, SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr):
    """Where the tile at row ``r0``, column ``c0`` of keep tile ``slot`` starts."""
    return KEEP + slot.to(tl.int64) * (SPARSE_M * SPARSE_N) + r0 * SPARSE_N + c0


@triton.jit
def _mod_row(MOD_DATA, h, T, S, SCORE_MOD: tl.constexpr):
    """Head ``h``'s place in the score mod's data: its ALiBi slope, or (a bias by head and
    distance, ``(H, T + S - 1)``) the entry of distance 0, so ``j - i`` indexes from it."""
    if SCORE_MOD == 3:
        return MOD_DATA + h * (T + S - 1) + (T - 1)
    return MOD_DATA + h


@triton.jit
def _key_tile(q, K, V, i, rows_ok, kt, keep_at, mod_at, sks, svs, S, D, DV, d, dv,
              offset, cap, scale, SCORE_MOD: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, SPARSE_N: tl.constexpr, MASKED: tl.constexpr,
              EVEN: tl.constexpr):
    """Key tile ``kt`` (``BLOCK_N`` keys) read for the query tile ``q``:
    ``(k, v, base-2 scores, d mod / d s)``."""
    j = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = j < S
    k = load_tile(K, j, cols_ok, sks, D, d, not EVEN, EVEN_D)
    v = load_tile(V, j, cols_ok, svs, DV, dv, not EVEN, EVEN_D)
    s, dmod = _tile(q, k, i, j, kt * BLOCK_N, rows_ok, cols_ok, keep_at, mod_at, offset, cap,
                    scale, SCORE_MOD, PRECISION, UPCAST, BLOCK_M, BLOCK_N, SPARSE_N, MASKED,
                    EVEN)
    return k, v, s, dmod


@triton.jit
def _visited(IDX, SLOT, KEEP, at, n, slot_at, slot_step, r0, SPARSE_M: tl.constexpr,
             SPARSE_N: tl.constexpr, SUBS: tl.constexpr, ACROSS: tl.constexpr,
             MASKED: tl.constexpr):
    """Step ``n`` of a flat loop over visited blocks (``IDX + at``: their indices) and the
    ``SUBS`` tiles within each: ``(tile index, keep tile corner)``. ``ACROSS``: the tiles
    split the blocks' columns (keys; else rows, queries); ``r0``: this program's own offset
    within its block on the other side. The keep tile's slot is read for partial blocks only
    (``SLOT + slot_at + block · slot_step``)."""
    block = tl.load(IDX + at + n // SUBS)
    sub = n % SUBS
    keep_at = KEEP
    if MASKED:
        slot = tl.load(SLOT + slot_at + block * slot_step)
        if ACROSS:
            keep_at = _keep_at(KEEP, slot, r0, sub * (SPARSE_N // SUBS), SPARSE_M, SPARSE_N)
        else:
            keep_at = _keep_at(KEEP, slot, sub * (SPARSE_M // SUBS), r0, SPARSE_M, SPARSE_N)
    return block * SUBS + sub, keep_at


@triton.jit
def _forward_step(q, K, V, m, l, acc, i, rows_ok, kt, keep_at, mod_at, sks, svs, S, D,
                  DV, d, dv, offset, cap, scale, bh, DROP, keep_scale,
                  SCORE_MOD: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPARSE_N: tl.constexpr, MASKED: tl.constexpr,
                  EVEN: tl.constexpr):
    """One key tile ``kt`` of the online softmax: the updated ``(m, l, acc)``."""
    _, v, s, _ = _key_tile(q, K, V, i, rows_ok, kt, keep_at, mod_at, sks, svs, S, D, DV,
                           d, dv, offset, cap, scale, SCORE_MOD, PRECISION, UPCAST, EVEN_D,
                           BLOCK_M, BLOCK_N, SPARSE_N, MASKED, EVEN)
    keep = s == s  # (unused without dropout)
    if DROPOUT:
        keep = philox_keep(DROP, bh, i, kt * BLOCK_N + tl.arange(0, BLOCK_N))
    return softmax_step(m, l, acc, s, v, keep, keep_scale, PRECISION, UPCAST, DROPOUT)


@triton.jit
def flex_forward(
    Q, K, V, O, L, KV_COUNT, KV_PART, KV_IDX, SLOT, KEEP, MOD_DATA, DROP,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot,
    H, G, T, S, D, DV, nQ, nK, BB, HB, HT, scale, offset, cap, keep_scale,
    SCORE_MOD: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Output rows and lse of one query tile of one ``(b, h)``."""
    SUBS: tl.constexpr = SPARSE_N // BLOCK_N
    qt = tl.program_id(0)
    qb = qt // (SPARSE_M // BLOCK_M)
    r0 = (qt % (SPARSE_M // BLOCK_M)) * BLOCK_M
    b = (tl.program_id(1) // H).to(tl.int64)
    h = (tl.program_id(1) % H).to(tl.int64)
    hkv = h // G
    i = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = i < T
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q + b * sqb + h * sqh, i, rows_ok, sqt, D, d, not EVEN, EVEN_D)
    poisoned = poisoned_rows(q)
    mod_at = _mod_row(MOD_DATA, h, T, S, SCORE_MOD)
    row = ((b * BB) * HT + h * HB) * nQ + qb
    K += b * skb + hkv * skh
    V += b * svb + hkv * svh
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    part = tl.load(KV_PART + row) * SUBS
    for n in range(0, part):  # partial blocks' tiles: their keep tiles
        kt, keep_at = _visited(KV_IDX, SLOT, KEEP, row * nK, n, row * nK, 1, r0, SPARSE_M,
                               SPARSE_N, SUBS, True, True)
        m, l, acc = _forward_step(q, K, V, m, l, acc, i, rows_ok, kt, keep_at, mod_at,
                                  sks, svs, S, D, DV, d, dv, offset, cap, scale, b * H + h,
                                  DROP, keep_scale, SCORE_MOD, DROPOUT, PRECISION, UPCAST,
                                  EVEN_D, BLOCK_M, BLOCK_N, SPARSE_N, True, EVEN)
    for n in range(part, tl.load(KV_COUNT + row) * SUBS):  # full blocks' tiles: no mask read
        kt, keep_at = _visited(KV_IDX, SLOT, KEEP, row * nK, n, row * nK, 1, r0, SPARSE_M,
                               SPARSE_N, SUBS, True, False)
        m, l, acc = _forward_step(q, K, V, m, l, acc, i, rows_ok, kt, keep_at, mod_at,
                                  sks, svs, S, D, DV, d, dv, offset, cap, scale, b * H + h,
                                  DROP, keep_scale, SCORE_MOD, DROPOUT, PRECISION, UPCAST,
                                  EVEN_D, BLOCK_M, BLOCK_N, SPARSE_N, False, EVEN)
    out, lse = finish_rows(acc, l, m, poisoned)
    o_at = O + b * sob + h * soh + i[:, None].to(tl.int64) * sot + dv[None, :]
    tl.store(o_at, out.to(O.dtype.element_ty), mask=rows_ok[:, None] & (dv[None, :] < DV))
    tl.store(L + (b * H + h) * T + i, lse, mask=rows_ok)


@triton.jit
def _dq_step(dq, q, do, lse, delta, K, V, i, rows_ok, kt, keep_at, mod_at, dmod_at, sks,
             svs, S, D, DV, d, dv, offset, cap, scale, bh, DROP, keep_scale,
             SCORE_MOD: tl.constexpr, GRAD_MOD: tl.constexpr, DROPOUT: tl.constexpr,
             PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_N: tl.constexpr,
             MASKED: tl.constexpr, EVEN: tl.constexpr):
    """``dq`` plus key tile ``kt``'s share; with ``GRAD_MOD``, the tile's share of the score
    mod's gradient added at ``dmod_at`` (:func:`_mod_grad`)."""
    k, v, s, dmod = _key_tile(q, K, V, i, rows_ok, kt, keep_at, mod_at, sks, svs, S, D,
                              DV, d, dv, offset, cap, scale, SCORE_MOD, PRECISION, UPCAST,
                              EVEN_D, BLOCK_M, BLOCK_N, SPARSE_N, MASKED, EVEN)
    p = tl.math.exp2(s - lse[:, None])
    dp = matmul(do, tl.trans(v), PRECISION, UPCAST)
    if DROPOUT:  # dO reaches the weights the forward kept, scaled as they were
        j = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        dp = tl.where(philox_keep(DROP, bh, i, j), dp * keep_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if SCORE_MOD == 2:
        ds = ds * dmod  # through the soft-cap
    if GRAD_MOD:
        _mod_grad(ds, dmod_at, i, kt * BLOCK_N, rows_ok, S, offset, BLOCK_N,
                  SCORE_MOD)
    return dq + matmul(ds.to(k.dtype), k, PRECISION, UPCAST)


@triton.jit
def _mod_grad(ds, dmod_at, i, j0, rows_ok, S, offset, BLOCK_N: tl.constexpr,
              SCORE_MOD: tl.constexpr):
    """Add a tile's share of the score mod's gradient, from ``ds`` (the loss's gradient in
    the scores after the mod): ALiBi's slope, ``-Σ ds·|i + offset - j|`` (one atomic add a
    tile); the relative bias of each distance, ``Σ ds`` over the pairs at ``j - i`` (an
    atomic add per pair). Every visited pair is in exactly one ``dQ`` tile, so each is
    counted once. The tile's keys are ``j0 + arange(BLOCK_N)``."""
    j = j0 + tl.arange(0, BLOCK_N)
    if SCORE_MOD == 1:
        distance = alibi_distance(i[:, None], j[None, :], offset, j0)
        tl.atomic_add(dmod_at, -tl.sum(tl.sum(ds * distance, 1), 0))
    if SCORE_MOD == 3:
        ok = rows_ok[:, None] & (j[None, :] < S)
        tl.atomic_add(dmod_at + (j[None, :] - i[:, None]), ds, mask=ok)


@triton.jit
def _tile_t(k, q, i, j, rows_ok, cols_ok, keep_at, mod_at, offset, cap, scale,
            SCORE_MOD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_N: tl.constexpr,
            MASKED: tl.constexpr, EVEN: tl.constexpr):
    """:func:`_tile` transposed: keys ``j`` along rows, queries ``i`` along columns, as the
    dK/dV kernel computes (``Sᵀ = K Qᵀ``, so neither ``Pᵀ dO`` nor ``dSᵀ Q`` transposes a
    tile held in registers). ``rows_ok``/``cols_ok`` are still the queries'/keys'. ALiBi's
    distances are converted whole here: converting them per row and column (as
    :func:`_tile` does) spilled registers in this loop (sm_90: counted from the tile's first
    key, 13 local loads and stores a step against 4 under triton 3.6; from its first query,
    296 bytes a thread under triton 3.9)."""
    if SCORE_MOD == 0:  # base 2 at once: one multiply a score
        s = matmul(k, tl.trans(q), PRECISION, UPCAST) * (scale * 1.4426950408889634)
        dmod = s
    else:  # (BLOCK_N, BLOCK_M), natural units for the score mods
        s = matmul(k, tl.trans(q), PRECISION, UPCAST) * scale
        dmod = s
        if SCORE_MOD == 1:
            distance = tl.abs(i[None, :] + offset - j[:, None]).to(tl.float32)
            s = s - tl.load(mod_at) * distance
        if SCORE_MOD == 3:
            ok = cols_ok[:, None] & rows_ok[None, :]
            s = s + tl.load(mod_at + (j[:, None] - i[None, :]), mask=ok, other=0.0)
        if SCORE_MOD == 2:
            t = _tanh(s / cap)
            s = cap * t
            dmod = 1.0 - t * t
        s = s * 1.4426950408889634
    if MASKED:
        r = tl.arange(0, BLOCK_M)
        c = tl.arange(0, BLOCK_N)
        at = keep_at + r[None, :] * SPARSE_N + c[:, None]
        if EVEN:
            s = tl.where(tl.load(at) != 0, s, float("-inf"))
        else:
            keep = tl.load(at, mask=rows_ok[None, :], other=1) != 0
            s = tl.where(keep & cols_ok[:, None] & rows_ok[None, :], s, float("-inf"))
    elif not EVEN:
        s = tl.where(cols_ok[:, None] & rows_ok[None, :], s, float("-inf"))
    return s, dmod


@triton.jit
def _dkdv_step(dk, dvacc, k, v, Q, DO, LSE, DELTA, h, j, cols_ok, qt, keep_at, mod_at,
               sqt, sdt, T, D, DV, d, dv, offset, cap, scale, bh, DROP, keep_scale,
               SCORE_MOD: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
               UPCAST: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, SPARSE_N: tl.constexpr, MASKED: tl.constexpr,
               EVEN: tl.constexpr):
    """``(dk, dv)`` plus query tile ``qt``'s share (``Q``, ``DO`` at this ``(b, h)``),
    computed transposed (keys along rows)."""
    i = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = i < T
    q = load_tile(Q, i, rows_ok, sqt, D, d, not EVEN, EVEN_D)
    do = load_tile(DO, i, rows_ok, sdt, DV, dv, not EVEN, EVEN_D)
    at = h * T + i
    lse = tl.load(LSE + at, mask=rows_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + at, mask=rows_ok, other=0.0)
    # Without the edge masks on the scores, a score mod's dK/dV spilled registers in its
    # loops (sm_90, triton 3.6: 21 local loads and stores a step with ALiBi, 31 with
    # soft-cap, where they kept none): only whole mask-only tiles drop them.
    s, dmod = _tile_t(k, q, i, j, rows_ok, cols_ok, keep_at, mod_at, offset,
                      cap, scale, SCORE_MOD, PRECISION, UPCAST, BLOCK_M, BLOCK_N, SPARSE_N,
                      MASKED, EVEN and SCORE_MOD == 0)
    p = tl.math.exp2(s - lse[None, :])  # Pᵀ (BLOCK_N, BLOCK_M)
    dp = matmul(v, tl.trans(do), PRECISION, UPCAST)  # dPᵀ
    p_applied = p
    if DROPOUT:  # the forward's mask, transposed
        keep = tl.trans(philox_keep(DROP, bh, i, j))
        p_applied = tl.where(keep, p * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    dvacc += matmul(p_applied.to(do.dtype), do, PRECISION, UPCAST)
    ds = p * (dp - delta[None, :])
    if SCORE_MOD == 2:
        ds = ds * dmod
    return dk + matmul(ds.to(q.dtype), q, PRECISION, UPCAST), dvacc


@triton.jit
def flex_backward_dq(
    Q, K, V, DO, LSE, DELTA, DQ, KV_COUNT, KV_PART, KV_IDX, SLOT, KEEP, MOD_DATA, DMOD_DATA,
    DROP, sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
    H, G, T, S, D, DV, nQ, nK, BB, HB, HT, scale, offset, cap, keep_scale,
    SCORE_MOD: tl.constexpr, GRAD_MOD: tl.constexpr, DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN: tl.constexpr, SPARSE_M: tl.constexpr,
    SPARSE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``dQ`` of one query tile (``LSE`` is ``+inf`` on dead rows); with ``GRAD_MOD`` also
    the score mod's gradient, added into ``DMOD_DATA`` (``MOD_DATA``'s shape, zeros)."""
    SUBS: tl.constexpr = SPARSE_N // BLOCK_N
    qt = tl.program_id(0)
    qb = qt // (SPARSE_M // BLOCK_M)
    r0 = (qt % (SPARSE_M // BLOCK_M)) * BLOCK_M
    b = (tl.program_id(1) // H).to(tl.int64)
    h = (tl.program_id(1) % H).to(tl.int64)
    hkv = h // G
    i = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = i < T
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(Q + b * sqb + h * sqh, i, rows_ok, sqt, D, d, not EVEN, EVEN_D)
    do = load_tile(DO + b * sdb + h * sdh, i, rows_ok, sdt, DV, dv, not EVEN, EVEN_D)
    at = (b * H + h) * T + i
    lse = tl.load(LSE + at, mask=rows_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + at, mask=rows_ok, other=0.0)
    mod_at = _mod_row(MOD_DATA, h, T, S, SCORE_MOD)
    dmod_at = _mod_row(DMOD_DATA, h, T, S, SCORE_MOD)
    row = ((b * BB) * HT + h * HB) * nQ + qb
    K += b * skb + hkv * skh
    V += b * svb + hkv * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    part = tl.load(KV_PART + row) * SUBS
    for n in range(0, part):  # partial blocks' tiles, then full ones
        kt, keep_at = _visited(KV_IDX, SLOT, KEEP, row * nK, n, row * nK, 1, r0, SPARSE_M,
                               SPARSE_N, SUBS, True, True)
        dq = _dq_step(dq, q, do, lse, delta, K, V, i, rows_ok, kt, keep_at, mod_at,
                      dmod_at, sks, svs, S, D, DV, d, dv, offset, cap, scale, b * H + h,
                      DROP, keep_scale, SCORE_MOD, GRAD_MOD, DROPOUT, PRECISION, UPCAST,
                      EVEN_D, BLOCK_M, BLOCK_N, SPARSE_N, True, EVEN)
    for n in range(part, tl.load(KV_COUNT + row) * SUBS):
        kt, keep_at = _visited(KV_IDX, SLOT, KEEP, row * nK, n, row * nK, 1, r0, SPARSE_M,
                               SPARSE_N, SUBS, True, False)
        dq = _dq_step(dq, q, do, lse, delta, K, V, i, rows_ok, kt, keep_at, mod_at,
                      dmod_at, sks, svs, S, D, DV, d, dv, offset, cap, scale, b * H + h,
                      DROP, keep_scale, SCORE_MOD, GRAD_MOD, DROPOUT, PRECISION, UPCAST,
                      EVEN_D, BLOCK_M, BLOCK_N, SPARSE_N, False, EVEN)
    tl.store(DQ + at[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows_ok[:, None] & (d[None, :] < D))


@triton.jit
def flex_backward_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV_, Q_COUNT, Q_PART, Q_IDX, SLOT, KEEP, MOD_DATA, DROP,
    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
    H, G, T, S, D, DV, nQ, nK, BB, HB, HT, scale, offset, cap, keep_scale,
    SCORE_MOD: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_D: tl.constexpr, EVEN: tl.constexpr,
    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``dK`` and ``dV`` of one key tile, summed over the query heads of its group."""
    SUBS: tl.constexpr = SPARSE_M // BLOCK_M
    kt = tl.program_id(0)
    kb = kt // (SPARSE_N // BLOCK_N)
    c0 = (kt % (SPARSE_N // BLOCK_N)) * BLOCK_N
    Hkv = H // G
    b = (tl.program_id(1) // Hkv).to(tl.int64)
    hkv = (tl.program_id(1) % Hkv).to(tl.int64)
    j = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = j < S
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k = load_tile(K + b * skb + hkv * skh, j, cols_ok, sks, D, d, not EVEN, EVEN_D)
    v = load_tile(V + b * svb + hkv * svh, j, cols_ok, svs, DV, dv, not EVEN, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dvacc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        h = hkv * G + g
        plane = (b * BB) * HT + h * HB
        column = plane * nK + kb
        mod_at = _mod_row(MOD_DATA, h, T, S, SCORE_MOD)
        q_at, do_at = Q + b * sqb + h * sqh, DO + b * sdb + h * sdh
        lse_at, delta_at = LSE + b * H * T, DELTA + b * H * T
        part = tl.load(Q_PART + column) * SUBS
        for n in range(0, part):  # partial blocks' tiles, then full ones
            qt, keep_at = _visited(Q_IDX, SLOT, KEEP, column * nQ, n, plane * nQ * nK + kb,
                                   nK, c0, SPARSE_M, SPARSE_N, SUBS, False, True)
            dk, dvacc = _dkdv_step(dk, dvacc, k, v, q_at, do_at, lse_at, delta_at, h, j,
                                   cols_ok, qt, keep_at, mod_at, sqt, sdt, T, D, DV, d, dv,
                                   offset, cap, scale, b * H + h, DROP, keep_scale,
                                   SCORE_MOD, DROPOUT, PRECISION, UPCAST, EVEN_D, BLOCK_M,
                                   BLOCK_N, SPARSE_N, True, EVEN)
        for n in range(part, tl.load(Q_COUNT + column) * SUBS):
            qt, keep_at = _visited(Q_IDX, SLOT, KEEP, column * nQ, n, plane * nQ * nK + kb,
                                   nK, c0, SPARSE_M, SPARSE_N, SUBS, False, False)
            dk, dvacc = _dkdv_step(dk, dvacc, k, v, q_at, do_at, lse_at, delta_at, h, j,
                                   cols_ok, qt, keep_at, mod_at, sqt, sdt, T, D, DV, d, dv,
                                   offset, cap, scale, b * H + h, DROP, keep_scale,
                                   SCORE_MOD, DROPOUT, PRECISION, UPCAST, EVEN_D, BLOCK_M,
                                   BLOCK_N, SPARSE_N, False, EVEN)
    at = (b * Hkv + hkv) * S + j
    tl.store(DK + at[:, None] * D + d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=cols_ok[:, None] & (d[None, :] < D))
    tl.store(DV_ + at[:, None] * DV + dv[None, :], dvacc.to(DV_.dtype.element_ty),
             mask=cols_ok[:, None] & (dv[None, :] < DV))
