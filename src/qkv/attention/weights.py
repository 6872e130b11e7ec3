"""Exact attention weights rebuilt from the log-sum-exp, for chosen heads and query rows.

A fast kernel returns the output and ``lse[b, h, i] = log Σ_j exp(s_ij)``; the weights are
then ``exp(s_ij - lse_i)`` for any subset of heads and rows, computed from ``q`` and ``k``
alone. Asking for the weights of 2 heads out of 32, or of the last query row, costs only that
slice: the output never has to go through the O(T·S) math path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from qkv.attention.call import AttentionCall, make_call
from qkv.attention.errors import AttentionArgumentError
from qkv.attention.masks import (
    accumulation_dtype,
    apply_mask,
    poison_rows,
    safe_lse,
)

__all__ = ["attention_weights", "merge_partials", "rebuild"]


def rebuild(
    call: AttentionCall,
    lse: Tensor,
    *,
    heads: Sequence[int] | None = None,
    rows: slice | None = None,
    lse_differentiable: bool = True,
) -> Tensor:
    """Weights ``(B, H', T', S)`` of ``call`` from its ``lse (B, H, T)``.

    ``heads`` selects query heads (default all), ``rows`` a slice of query rows (default all).
    Rows with no visible key (``lse = -inf``, or any lse: their scores are all ``-inf``) get
    zero weights. With ``lse_differentiable=False`` (an lse from a kernel whose lse output
    carries no gradient and is rounded to float32, such as torch's CPU flash kernel) the lse is
    only the shift of a normalised softmax, so the weights and their gradient are the
    softmax's exactly (one extra pass over the rows for the sums). A non-finite query row
    gives a NaN weights row, even when it sees no key.
    """
    q, k = call.query, call.key
    H, G = call.num_heads, call.groups
    head_idx = torch.arange(H, device=q.device) if heads is None else torch.as_tensor(
        list(heads), device=q.device, dtype=torch.long
    )
    rows = rows or slice(None)
    acc = accumulation_dtype(q.dtype)
    # Scores computed exactly as the flash backend computes them (scale folded into q, in the
    # accumulation dtype), so they match the lse to the last bit rather than to rounding.
    qs = q[:, head_idx, rows].to(acc) * call.scale  # (B, H', T', D)
    ks = k[:, head_idx // G].to(acc)  # (B, H', S, D): the key/value head each query head reads
    s = qs @ ks.transpose(-2, -1)  # (B, H', T', S)
    s = apply_mask(s, call, rows=rows, heads=head_idx)
    l = safe_lse(lse[:, head_idx, rows][..., None])  # (B, H', T', 1); dead rows: +inf
    # lse in two parts, hi + lo: s - hi is exact where it matters (s near hi), so the weights
    # keep the precision of the scores instead of that of lse rounded to their dtype.
    hi = l.to(acc)
    lo = torch.nan_to_num(l - hi.to(l.dtype), nan=0.0).to(acc)
    if not lse_differentiable:
        # An lse from another kernel (float32, no gradient) serves only as the stable shift,
        # and the row is normalised: the weights are then the softmax itself, gradient
        # included (the shift cancels), and a row with one visible key is exactly 1.
        e = torch.exp((s - hi.detach()) - lo.detach())  # (B, H', T', S)
        total = e.sum(-1, keepdim=True)  # (B, H', T', 1); 0 on rows with no visible key
        w = (e / total.masked_fill(total == 0, 1.0)).to(q.dtype)
    else:
        w = torch.exp((s - hi) - lo).to(q.dtype)  # (B, H', T', S)
    # Rows that see no key skipped their (NaN) scores: mark non-finite queries there too.
    return poison_rows(w, q[:, head_idx, rows])


def attention_weights(
    query: Tensor,
    key: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool | str = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window: int | None = None,
    alibi_slopes: Tensor | None = None,
    heads: Sequence[int] | None = None,
    rows: slice | None = None,
) -> Tensor:
    """Exact softmax weights from ``query (..., H, T, D)``, ``key (..., Hkv, S, D)`` and the
    ``lse (..., H, T)`` a flash call returned, for the chosen ``heads`` and ``rows`` only.

    Mask arguments mean what they mean in :func:`qkv.scaled_dot_product_attention` and must
    be the ones the lse was computed with. Returns ``(..., H', T', S)``.

    Raises:
        AttentionArgumentError: ``lse`` of the wrong shape, and every error of the attention call.
    """
    call = make_call(
        query, key, key, attn_mask, 0.0, is_causal, scale, enable_gqa, True, window,
        alibi_slopes,
    )
    expected = (*call.batch_shape, call.num_heads, call.T)
    if not isinstance(lse, Tensor) or tuple(lse.shape) != expected:
        got = tuple(lse.shape) if isinstance(lse, Tensor) else type(lse).__name__
        raise AttentionArgumentError(f"lse must have shape (..., H, T) = {expected}, got {got}")
    lse4 = lse.reshape(-1, call.num_heads, call.T)  # (B, H, T)
    w = rebuild(call, lse4, heads=heads, rows=rows)  # (B, H', T', S)
    return w.reshape(*call.batch_shape, *w.shape[1:])  # (..., H', T', S)


def merge_partials(out0: Tensor, lse0: Tensor, out1: Tensor, lse1: Tensor):
    """Merge two partial attentions over disjoint key sets into one, exactly, in place.

    ``out0``/``out1`` ``(B, H, T, Dv)`` are each normalised over their own keys and
    ``lse0``/``lse1`` ``(B, H, T)`` are their log-sum-exps: the result is the attention over
    both key sets, ``out = out0·exp(lse0 - lse) + out1·exp(lse1 - lse)`` with
    ``lse = logaddexp(lse0, lse1)``. Rows that see no key in either stay 0 with ``lse = -inf``.
    ``out0`` (an accumulator the caller owns) is overwritten; ``out1`` is not.

    Returns:
        ``(out, lse)``.
    """
    new = torch.logaddexp(lse0, lse1)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # rows seeing nothing
    w0 = torch.exp(lse0 - safe).unsqueeze(-1).to(out0.dtype)  # (B, H, T, 1)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1).to(out0.dtype)
    return out0.mul_(w0).add_(out1 * w1), new

