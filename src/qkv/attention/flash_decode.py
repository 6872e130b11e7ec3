"""Flash-decoding: the flash forward for a few queries against a long key sequence.

Decoding asks ``T <= DECODE_ROWS`` queries (one per sequence, or a few when verifying draft
tokens) about ``S`` cached keys. The tile loop of the flash backend would walk the keys one
block at a time, rescaling its running output after every block. Here every key block gives
an independent *partial* result instead (its unnormalised output ``o_j``, row maximum
``m_j`` and row sum ``l_j``), and the partials are merged once at the end by log-sum-exp,
as flash-decoding does (Dao, Haziza, Massa and Sizov, 2023)::

    M = max_j m_j        L = sum_j l_j exp(m_j - M)        out = sum_j o_j exp(m_j - M) / L

**Split-S.** When there are fewer ``(batch, key head)`` pairs than threads to keep busy
(``B·Hkv < 2·threads``: one sequence of a multi-query model, say), an unmasked call takes all
its keys as one block (when its scores fit :data:`WHOLE_SCORES`) cut into ``n`` splits of
``c`` keys, viewed as ``(B, Hkv, n, c, D)`` without a copy, so one batched matmul hands every
thread its own keys; the splits are partials like any other. (Otherwise the keys are walked
in blocks, each one matmul, which BLAS spreads over the threads.) A call with a mask, ALiBi
or a causal edge inside the block keeps ``n = 1`` and gets its mask parts per block from
:func:`qkv.attention.masks.apply_mask`, the one definition every backend shares.

Grouped heads stay grouped: the ``G = H / Hkv`` query heads of a key head are ``G·T`` rows
against the same keys, which are never repeated. Rows that see no key get a zero output
and ``lse = -inf``, as in the tile loop. Forward only; the flash backward recomputes its
tiles from the log-sum-exp this returns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.call import AttentionCall
from qkv.attention.flash_blocks import plan_blocks
from qkv.attention.masks import apply_mask, exp_shifted_

__all__ = ["MAX_SPLITS", "MIN_SPLIT_KEYS", "WHOLE_SCORES", "decode_forward", "splits"]

MIN_SPLIT_KEYS = 512  # a split shorter than this costs more in overhead than it saves
# A call that splits takes all its keys as one block when its scores (B·H·T·S) fit in this
# many elements (16 MiB of float32); its K and V are not copied (no upcast in this case).
WHOLE_SCORES = 1 << 22
MAX_SPLITS = 16


def splits(pairs: int, keys: int, threads: int | None = None) -> int:
    """How many splits ``n`` to cut a block of ``keys`` keys into, for ``pairs = B·Hkv``.

    One split (none) when the ``(batch, key head)`` pairs alone give every thread two
    matmuls; otherwise enough splits for that, each at least :data:`MIN_SPLIT_KEYS` long.
    """
    threads = threads or torch.get_num_threads()
    if pairs >= 2 * threads:
        return 1
    want = -(-2 * threads // pairs)
    return max(1, min(MAX_SPLITS, want, keys // MIN_SPLIT_KEYS))


def decode_forward(
    call: AttentionCall, qs: Tensor, k: Tensor, v: Tensor, bk: int, acc: torch.dtype,
    lse_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor | None]:
    """Attention of ``T`` queries against all keys: ``(out (B, H, T, Dv), lse (B, H, T))``.

    Args:
        call: the call (its mask parts, ``T``, ``S``, heads).
        qs: queries times the scale, grouped: ``(B, Hkv, G·T, D)`` in ``acc``.
        k, v: ``(B, Hkv, S, D)`` and ``(B, Hkv, S, Dv)`` in the call's dtype.
        bk: keys per block (the flash plan's key block size).
        acc: accumulation dtype; ``lse_dtype``: the returned lse's dtype, or ``None`` for
            no lse (inference needs none, and it is a few more small ops per call).
    """
    B, Hkv = qs.shape[:2]
    H, T, S, Dv = call.query.shape[1], call.T, call.S, v.shape[-1]
    masked = call.mask is not None or call.alibi is not None
    # Splits only where (B, Hkv, n, c, D) views merge into one batch dimension: one block of
    # every key of a contiguous K and V (a block of part of them, or keys that are a slice of
    # a longer cache buffer, would make matmul copy K).
    n_whole = 1
    if not masked and call.causal is None and k.dtype == v.dtype == acc \
            and B * H * T * S <= WHOLE_SCORES and _mergeable(k, v, S):
        n_whole = splits(B * Hkv, S)
        if n_whole > 1:
            bk = S  # few key heads: one block of every key, cut into splits for the threads
    parts = []
    for plan in plan_blocks(T, S, T, bk, call.causal, call.window)[0].tiles:
        j0, j1 = plan.j0, plan.j1
        plain = not (masked or plan.partial)
        n = n_whole if plain and j1 - j0 == S else 1
        main = j0 + (j1 - j0) // n * n  # keys [j0, main) split n ways, [main, j1) the rest
        parts.append(_partial(call, qs, k, v, j0, main, n, None if plain else plan, acc))
        if main < j1:
            parts.append(_partial(call, qs, k, v, main, j1, 1, None, acc))
    if not parts:  # no key visible to any query (a window past every key)
        out = torch.zeros(B, H, T, Dv, dtype=acc, device=qs.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=lse_dtype or acc, device=qs.device)
        return out, lse if lse_dtype else None
    if len(parts) == 1 and parts[0][0].shape[2] == 1:  # one block, unsplit: nothing to merge
        o, top, total = (x[:, :, 0] for x in parts[0])  # (B, Hkv, G·T, ·)
    else:
        o, m, l = (torch.cat(x, dim=2) for x in zip(*parts, strict=True))  # (B, Hkv, n', G·T, ·)
        top = m.amax(dim=2)  # (B, Hkv, G·T, 1)
        weight = torch.exp(m - _finite(top).unsqueeze(2))  # 0 for a partial with no key
        total = (l * weight).sum(dim=2)  # (B, Hkv, G·T, 1)
        o = (o * weight).sum(dim=2)  # (B, Hkv, G·T, Dv)
    # A row that saw no key has o = 0 and total = 0: the clamp makes its output 0, not NaN.
    out = (o / total.clamp_min(_TINY)).reshape(B, H, T, Dv)  # (B, H, T, Dv)
    if lse_dtype is None:
        return out, None
    # In float64 for float32 inputs: weights rebuilt from the lse need its low bits.
    lse = top.to(lse_dtype) + torch.log(total.to(lse_dtype))  # -inf where total = 0
    return out, lse.reshape(B, H, T)  # (B, H, T)


_TINY = 1e-30  # below any row sum that saw a key (each such sum is >= 1)


def _mergeable(k: Tensor, v: Tensor, keys: int) -> bool:
    """Whether ``keys`` keys of ``k``/``v`` ``(B, Hkv, S, ·)`` cut into splits keep batch
    strides matmul can merge: each head's keys contiguous and heads back to back."""
    def merges(t: Tensor) -> bool:
        B, Hkv, S, D = t.shape
        rows = S == keys and t.stride(3) == 1 and t.stride(2) == D
        heads = t.stride(1) == keys * D and (B == 1 or t.stride(0) == Hkv * t.stride(1))
        return rows and heads

    return merges(k) and merges(v)


def _finite(m: Tensor) -> Tensor:
    """Row maxima with ``-inf`` (a row that saw no key) raised to the dtype's lowest finite
    value: ``exp(s - m)`` is then an exact 0 there instead of ``exp(-inf + inf) = NaN``.
    One op (``safe_row_max`` is two; this runs on every decoding step); NaN stays NaN."""
    return m.clamp_min(torch.finfo(m.dtype).min)


def _partial(
    call: AttentionCall, qs: Tensor, k: Tensor, v: Tensor, j0: int, j1: int, n: int,
    plan, acc: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """Keys ``[j0, j1)`` in ``n`` equal splits: ``o (B, Hkv, n, G·T, Dv)``, and the row
    maxima and sums ``(B, Hkv, n, G·T, 1)``. ``plan`` (a masked block, ``n = 1``) applies the
    call's mask parts; ``None`` means every key is visible."""
    B, Hkv, _, D = qs.shape
    c = (j1 - j0) // n
    kt = k[:, :, j0:j1].to(acc).reshape(B, Hkv, n, c, D)  # (B, Hkv, n, c, D), a view
    vt = v[:, :, j0:j1].to(acc).reshape(B, Hkv, n, c, -1)  # (B, Hkv, n, c, Dv)
    s = qs.unsqueeze(2) @ kt.transpose(-2, -1)  # (B, Hkv, n, G·T, c)
    if plan is not None:
        H = call.query.shape[1]
        tile = s.view(B, H, call.T, c)  # (B, H, T, c), h = hkv·G + g
        apply_mask(tile, call, slice(0, call.T), slice(j0, j1), structure=plan.partial,
                   inplace=True)
    m = s.amax(dim=-1, keepdim=True)  # (B, Hkv, n, G·T, 1)
    p = exp_shifted_(s, m) if plan is not None else s.sub_(_finite(m)).exp_()
    return p @ vt, m, p.sum(dim=-1, keepdim=True)
