"""Ready score and mask functions for :func:`qkv.flex_attention` (torch's FlexAttention
signatures: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, ``score_mod(score, b, h, q_idx,
kv_idx) -> score``).

Each factory returns a function of broadcastable index tensors (see
:mod:`qkv.attention.flex_blocks`), so the same function works in :func:`qkv.create_block_mask`,
in qkv's kernel and in torch's ``flex_attention``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkv.attention.errors import AttentionArgumentError, AttentionTypeError

__all__ = ["document_mask"]


def document_mask(document_ids: Tensor) -> Callable:
    """A ``mask_mod`` that lets a position see only positions of its own document.

    Args:
        document_ids: ``(B, T)`` or ``(T,)`` integer ids, one per position of a packed row
            (queries and keys are the same positions: self-attention).

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``: ``document_ids[b, q_idx] == document_ids[b, kv_idx]``.
        Combine with causal for a decoder: ``and_masks(causal_mask, document_mask(ids))``.
    """
    if not isinstance(document_ids, Tensor) or document_ids.is_floating_point() or (
        document_ids.dtype == torch.bool
    ):
        raise AttentionTypeError(
            f"document_ids must be an integer tensor (B, T) or (T,), got {document_ids!r:.60}"
        )
    if document_ids.dim() not in (1, 2):
        raise AttentionArgumentError(
            f"document_ids must have shape (B, T) or (T,), got {tuple(document_ids.shape)}"
        )
    ids = document_ids if document_ids.dim() == 2 else document_ids[None]  # (B|1, T)
    per_batch = ids.shape[0] > 1

    def same_document(b, h, q_idx, kv_idx):
        rows = b if per_batch else torch.zeros_like(b)
        return ids[rows, q_idx] == ids[rows, kv_idx]

    return same_document
