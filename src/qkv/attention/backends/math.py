"""The textbook backend: scores, scale, mask, softmax, weighted sum, one step per line.

It materialises the full ``(B, H, T, S)`` score matrix, so it costs O(T·S) memory; in return
it is the readable reference every faster backend is tested against, and it returns weights.
Grouped-query attention folds the ``G = H / Hkv`` query heads that share a key/value head into
the query length, so K and V are never repeated in memory.

Half-precision inputs (float16, bfloat16) are computed in float32 from the first product to
the last, as the flash backend and torch's kernels do: a float16 ``q·k`` above 65504 is
``inf`` and a bfloat16 one keeps 8 bits, so scores, softmax, and the weighted sum of the
values all run in float32 and only the output (and the weights returned) are rounded to the
input's dtype. The hook points ``on_scores`` and ``on_weights`` therefore see float32 tensors
for half-precision inputs: the values the output is computed from, not a rounded copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkv.attention.call import AttentionCall
from qkv.attention.masks import (
    accumulation_dtype,
    apply_mask,
    dropout_keep,
    poison_rows,
    safe_row_max,
    safe_total,
)

NAME = "math"


def why_not(call: AttentionCall) -> str | None:
    """The math backend honours every call."""
    return None


def softmax_rows(scores: Tensor) -> Tensor:
    """Softmax over the last dimension in which a row of only ``-inf`` gives zeros, not NaN.

    Equal to ``torch.softmax`` on every other row. The row maximum is detached: softmax does
    not depend on it, so it only keeps ``exp`` in range and needs no gradient.
    """
    if scores.shape[-1] == 0:
        return scores  # no keys: an empty row of weights
    top = safe_row_max(scores.amax(dim=-1, keepdim=True).detach())  # dead rows: 0
    e = torch.exp(scores - top)
    return e / safe_total(e.sum(dim=-1, keepdim=True))


def row_lse(scores: Tensor) -> Tensor:
    """Log-sum-exp over the last dimension ``(..., S) -> (...)``; ``-inf`` on a row with no
    visible key (every score ``-inf``, or ``S = 0``), whose gradient is then zero, not NaN.

    ``max + log Σ exp(s - max)`` with the maximum detached (the result does not depend on
    it), so the gradient is the softmax, exactly as ``torch.logsumexp``'s.
    """
    if scores.shape[-1] == 0:
        return scores.new_full(scores.shape[:-1], float("-inf"))
    top = safe_row_max(scores.amax(dim=-1, keepdim=True).detach())  # dead rows: 0
    total = torch.exp(scores - top).sum(dim=-1, keepdim=True)  # (..., 1); 0 on dead rows
    lse = top + torch.log(safe_total(total))
    return lse.masked_fill(total == 0, float("-inf")).squeeze(-1)  # (...)


def run(
    call: AttentionCall,
    *,
    on_scores: Callable[[Tensor], Tensor] | None = None,
    on_weights: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention by its definition: output ``(B, H, T, Dv)``, weights ``(B, H, T, S)``.

    ``on_scores`` and ``on_weights`` (hook points of :mod:`qkv.nn.hooks`) may read or replace
    the masked scores and the softmax weights ``(B, H, T, S)`` on their way through. They
    see them in the accumulation dtype (float32 for half-precision inputs, else the inputs'
    dtype); a replacement of another float dtype is converted to it. The weights returned
    (``need_weights``) are in the inputs' dtype. A non-finite query row gives a NaN output
    row and a NaN weights row, even when it sees no key.
    """
    out, weights, _ = _attend(call, on_scores, on_weights, want_lse=False)
    return out, weights


def run_lse(call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`run` plus the log-sum-exp ``(B, H, T)`` of the scaled, masked scores (in the
    accumulation dtype, differentiable; ``-inf`` on rows with no visible key)."""
    out, weights, lse = _attend(call, None, None, want_lse=True)
    assert lse is not None
    return out, weights, lse


def _attend(
    call: AttentionCall,
    on_scores: Callable[[Tensor], Tensor] | None,
    on_weights: Callable[[Tensor], Tensor] | None,
    *,
    want_lse: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The steps of :func:`run`; also the log-sum-exp ``(B, H, T)`` when ``want_lse``."""
    q, k, v = call.query, call.key, call.value
    B, H, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = call.groups
    acc = accumulation_dtype(q.dtype)

    # (Half precision: float32 copies of q, k and v; no-ops for float32 and float64.)
    q_grouped = q.to(acc).reshape(B, Hkv, G * T, D)  # (B, Hkv, G·T, D): G heads share one K
    # 1) Scores: every query against every key.
    scores = q_grouped @ k.to(acc).transpose(-2, -1)  # (B, Hkv, G·T, S)
    scores = scores.reshape(B, H, T, S)  # (B, H, T, S)
    # 2) Scale by 1/sqrt(D) (or the caller's scale) so the softmax does not saturate.
    scores = scores * call.scale
    # 3) Mask: hidden keys get -inf (weight exactly 0); float masks and ALiBi are added.
    scores = apply_mask(scores, call)
    if on_scores is not None:
        scores = on_scores(scores).to(acc)
    lse = row_lse(scores) if want_lse else None  # (B, H, T)
    # 4) Softmax over the keys.
    weights = softmax_rows(scores)
    if on_weights is not None:
        weights = on_weights(weights).to(acc)
    # 5) Dropout on the weights (training only: the caller passes 0 in evaluation), drawn as
    #    torch draws it so a seed drops what torch's math SDPA and the flash backend drop.
    applied = weights
    if call.dropout_p > 0.0:
        applied = weights * dropout_keep(call) / (1.0 - call.dropout_p)  # (B, H, T, S)
    # 6) Weighted sum of the values.
    out = applied.reshape(B, Hkv, G * T, S) @ v.to(acc)  # (B, Hkv, G·T, Dv)
    out = out.reshape(B, H, T, Dv).to(q.dtype)  # (B, H, T, Dv)
    # 7) A non-finite query row is NaN even where the softmax gave zeros (no visible key).
    out = poison_rows(out, q)
    if not call.need_weights:
        return out, None, lse
    return out, poison_rows(applied.to(q.dtype), q), lse
