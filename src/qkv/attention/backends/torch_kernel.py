"""The fused backend: ``torch.nn.functional.scaled_dot_product_attention``.

On CPU torch picks its flash-attention kernel (blockwise, O(T) memory) when it can, else its
math kernel. It never returns weights. Grouped-query attention without a mask folds the query
heads of a group into the query length, so K and V are not repeated; with a mask or causal
masking it uses torch's own ``enable_gqa``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from qkv.attention.call import AttentionCall

NAME = "torch"


def why_not(call: AttentionCall) -> str | None:
    """Reasons torch's kernel cannot honour ``call``, or ``None``."""
    if call.need_weights:
        return "the fused kernel does not return attention weights"
    if call.T == 0 or call.S == 0:
        return "empty sequence (T or S is 0)"
    return None


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """Output ``(B, H, T, Dv)`` from torch's fused kernel; weights are never returned."""
    q, k, v = call.query, call.key, call.value
    B, H, T, D = q.shape
    G = call.groups
    if G > 1 and call.mask is None and not call.is_causal:
        # No mask depends on the query index, so the G query heads of a group can ride
        # along the query length: one call, K and V read once and never copied.
        q_folded = q.reshape(B, k.shape[1], G * T, D)  # (B, Hkv, G·T, D)
        out = F.scaled_dot_product_attention(
            q_folded, k, v, dropout_p=call.dropout_p, scale=call.scale
        )  # (B, Hkv, G·T, Dv)
        return out.reshape(B, H, T, v.shape[-1]), None  # (B, H, T, Dv)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=call.mask,
        dropout_p=call.dropout_p,
        is_causal=call.is_causal,
        scale=call.scale,
        enable_gqa=G > 1,
    )  # (B, H, T, Dv)
    return out, None
