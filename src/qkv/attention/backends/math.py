"""The textbook backend: scores, scale, mask, softmax, weighted sum, one step per line.

It materialises the full ``(B, H, T, S)`` score matrix, so it costs O(T·S) memory; in return
it is the readable reference every faster backend is tested against, and it returns weights.
Grouped-query attention folds the ``G = H / Hkv`` query heads that share a key/value head into
the query length, so K and V are never repeated in memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkv.attention.call import AttentionCall
from qkv.attention.masks import apply_mask, safe_row_max, safe_total

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


def run(
    call: AttentionCall,
    *,
    on_scores: Callable[[Tensor], Tensor] | None = None,
    on_weights: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention by its definition: output ``(B, H, T, Dv)``, weights ``(B, H, T, S)``.

    ``on_scores`` and ``on_weights`` (hook points of :mod:`qkv.nn.hooks`) may read or replace
    the masked scores and the softmax weights ``(B, H, T, S)`` on their way through.
    """
    q, k, v = call.query, call.key, call.value
    B, H, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = call.groups
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype

    q_grouped = q.reshape(B, Hkv, G * T, D)  # (B, Hkv, G·T, D): G query heads share one K
    # 1) Scores: every query against every key.
    scores = q_grouped @ k.transpose(-2, -1)  # (B, Hkv, G·T, S)
    scores = scores.reshape(B, H, T, S).to(acc)  # (B, H, T, S)
    # 2) Scale by 1/sqrt(D) (or the caller's scale) so the softmax does not saturate.
    scores = scores * call.scale
    # 3) Mask: hidden keys get -inf (weight exactly 0); float masks and ALiBi are added.
    scores = apply_mask(scores, call)
    if on_scores is not None:
        scores = on_scores(scores)
    # 4) Softmax over the keys (half precision accumulates in float32).
    weights = softmax_rows(scores).to(q.dtype)
    if on_weights is not None:
        weights = on_weights(weights)
    # 5) Dropout on the weights (training only: the caller passes 0 in evaluation).
    applied = weights
    if call.dropout_p > 0.0:
        applied = torch.dropout(weights, call.dropout_p, train=True)
    # 6) Weighted sum of the values.
    out = applied.reshape(B, Hkv, G * T, S) @ v  # (B, Hkv, G·T, Dv)
    out = out.reshape(B, H, T, Dv)  # (B, H, T, Dv)
    return out, (applied if call.need_weights else None)
