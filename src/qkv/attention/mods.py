"""Ready mask functions for :func:`qkv.flex_attention` (and, re-exported from
:mod:`qkv.attention.score_mods`, ready score functions): torch's FlexAttention signatures
``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend) and ``score_mod(score, b, h,
q_idx, kv_idx) -> score``.

Each is elementwise torch operations on its index tensors, so the same function works in
:func:`qkv.create_block_mask` and qkv's kernel (broadcast grids ``b (B,1,1,1)``, ``h (1,H,1,1)``,
``q_idx (1,1,T',1)``, ``kv_idx (1,1,1,S')``) and in torch's ``create_block_mask`` /
``flex_attention`` (0-d tensors under ``vmap``). Combine them with ``and_masks`` /
``or_masks``: a causal document mask is ``and_masks(causal_mask, document_mask(ids))``.

Mods that capture a per-batch tensor (``document_mask``, ``prefix_lm``, ``padding_mask``)
need the block mask built for that batch: ``create_block_mask(mod, B, ...)``, not ``B=None``.
Under qkv's grids they check it, and that positions fall inside the tensor, with a clear error.

Shapes: ``B`` batch, ``T`` queries, ``S`` keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.score_mods import alibi, relative_bias, relative_position_bucket, soft_cap
from qkv.checks import is_int

__all__ = [
    "alibi",
    "causal_mask",
    "dilated",
    "document_mask",
    "padding_mask",
    "prefix_lm",
    "relative_bias",
    "relative_position_bucket",
    "sliding_window_mask",
    "soft_cap",
]


def _int_arg(name: str, value: object, low: int) -> int:
    if not is_int(value) or value < low:
        raise AttentionArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _int_tensor(name: str, t: object, shapes: str) -> Tensor:
    if isinstance(t, Sequence) and not isinstance(t, str):
        t = torch.tensor(t)
    if not isinstance(t, Tensor) or t.is_floating_point() or t.is_complex() or (
        t.dtype == torch.bool
    ):
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise AttentionTypeError(f"{name} must be an integer tensor {shapes}, got {got}")
    return t


def _batch(b: Tensor, n: int, what: str) -> Tensor:
    """Row of a captured ``(n, ...)`` tensor for batch ``b``; one row is shared by all."""
    if n == 1:
        return torch.zeros_like(b)
    if b.dim() == 4 and b.shape[0] != n:  # qkv's grid; under torch's vmap b is 0-d
        raise AttentionArgumentError(
            f"{what} has B={n} rows but the mask is evaluated for B={b.shape[0]}: build the "
            f"block mask with create_block_mask(mod, B={n}, ...)"
        )
    return b


def _positions(idx: Tensor, n: int, what: str, axis: str) -> None:
    """Refuse positions ``>= n`` of qkv's grids (no-op under torch's vmap)."""
    if idx.dim() == 4 and idx.numel() and int(idx.max()) >= n:
        raise AttentionArgumentError(
            f"{what} covers {n} positions but the attention has a {axis} at position "
            f"{int(idx.max())}"
        )


def causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Query ``i`` sees keys ``j <= i`` (torch's ``is_causal=True``, aligned top-left).

    Returns ``q_idx >= kv_idx``: bool, ``(1, 1, T', S')`` on qkv's grids (0-d under vmap).
    """
    return q_idx >= kv_idx


def sliding_window_mask(window: int, *, offset: int = 0) -> Callable:
    """Causal attention to the last ``window`` keys: query ``i`` sees keys
    ``p - window < j <= p``, ``p = i + offset`` (itself and the ``window - 1`` keys before).

    Equal to ``qkv.scaled_dot_product_attention(..., is_causal=True, window=window)`` with
    ``offset=0``, and to ``is_causal="bottom-right"`` with ``offset=S - T``; the dense mask is
    ``qkv.masks.sliding_window(T, S, window=window, offset=offset)``. (Named apart from that
    builder, which ``qkv.masks`` also exports.)

    Args:
        window: keys seen per query, an int >= 1 (1: only the diagonal).
        offset: key position of query 0, an int.
    """
    window = _int_arg("window", window, 1)
    if not is_int(offset):
        raise AttentionTypeError(f"sliding_window_mask offset must be an int, got {offset!r}")

    def sliding_window(b, h, q_idx, kv_idx):
        p = q_idx + offset
        return (kv_idx <= p) & (kv_idx > p - window)

    return sliding_window


def prefix_lm(prefix_length: int | Tensor) -> Callable:
    """Prefix-LM: every query sees the whole prefix (keys ``j < P``), and keys ``j <= i``
    causally after it; inside the prefix attention is bidirectional.

    Args:
        prefix_length: ``P``, an int >= 0 for every row, or a ``(B,)`` integer tensor, one per
            batch row (build the block mask with that ``B``). ``P = 0`` is causal attention.
    """
    if isinstance(prefix_length, Tensor):
        lengths = _int_tensor("prefix_length", prefix_length, "(B,)")
        if lengths.dim() != 1 or lengths.numel() == 0 or bool((lengths < 0).any()):
            raise AttentionArgumentError(
                f"prefix_length must be an int >= 0 or a (B,) tensor of them, got "
                f"{lengths!r:.80}"
            )

        def prefix_lm_rows(b, h, q_idx, kv_idx):
            rows = _batch(b, lengths.shape[0], "prefix_length")
            return (kv_idx < lengths.to(b.device)[rows]) | (kv_idx <= q_idx)

        return prefix_lm_rows
    n = _int_arg("prefix_length", prefix_length, 0)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < n) | (kv_idx <= q_idx)

    return prefix_lm_mask


def dilated(dilation: int) -> Callable:
    """Dilated causal attention: query ``i`` sees keys ``j = i, i - d, i - 2d, ...`` (``j >= 0``),
    that is ``j <= i`` and ``(i - j) % d == 0``; ``d = 1`` is causal attention. Bound it with
    ``and_masks(dilated(d), sliding_window_mask(w))`` (keys ``j > i - w`` only).

    Args:
        dilation: ``d``, an int >= 1.
    """
    d = _int_arg("dilation", dilation, 1)

    def dilated_mask(b, h, q_idx, kv_idx):
        gap = q_idx - kv_idx
        return (gap >= 0) & (gap % d == 0)

    return dilated_mask


def document_mask(document_ids: Tensor) -> Callable:
    """A ``mask_mod`` that lets a position see only positions of its own document.

    Args:
        document_ids: ``(B, T)`` or ``(T,)`` integer ids, one per position of a packed row
            (queries and keys are the same positions: self-attention, ``S = T``). A ``(T,)``
            or ``(1, T)`` tensor is shared by every batch row.

    Returns:
        ``mask_mod(b, h, q_idx, kv_idx)``: ``document_ids[b, q_idx] == document_ids[b, kv_idx]``.
        Combine with causal for a decoder: ``and_masks(causal_mask, document_mask(ids))``.

    Raises:
        AttentionTypeError / AttentionArgumentError: not an integer ``(B, T)`` / ``(T,)``
            tensor; at call time, another batch size or a position past ``T``.
    """
    ids = _int_tensor("document_ids", document_ids, "(B, T) or (T,)")
    if ids.dim() not in (1, 2) or ids.shape[-1] == 0:
        raise AttentionArgumentError(
            f"document_ids must have shape (B, T) or (T,) with T >= 1, got {tuple(ids.shape)}"
        )
    ids = ids if ids.dim() == 2 else ids[None]  # (B|1, T)
    B, T = ids.shape

    def same_document(b, h, q_idx, kv_idx):
        rows = _batch(b, B, "document_ids")
        _positions(q_idx, T, "document_ids", "query")
        _positions(kv_idx, T, "document_ids", "key")
        doc = ids.to(q_idx.device)
        return doc[rows, q_idx] == doc[rows, kv_idx]

    return same_document


def padding_mask(lengths_or_keep: Tensor | Sequence[int]) -> Callable:
    """Hide padded keys: as the dense ``qkv.masks.padding(lengths, S)``.

    Args:
        lengths_or_keep: ``(B,)`` integer lengths (batch row ``b`` sees keys ``j <
            lengths[b]``: leading real tokens), or a ``(B, S)`` bool keep mask over the keys
            (True = a real token, any pattern). Build the block mask with that ``B``.

    Raises:
        AttentionTypeError / AttentionArgumentError: another dtype or shape, negative
            lengths; at call time, another batch size or (keep mask) a key past ``S``.
    """
    t = lengths_or_keep
    if isinstance(t, Tensor) and t.dtype == torch.bool:
        if t.dim() != 2 or 0 in t.shape:
            raise AttentionArgumentError(
                f"padding_mask keep mask must have shape (B, S), got {tuple(t.shape)}"
            )
        keep = t
        B, S = keep.shape

        def keep_keys(b, h, q_idx, kv_idx):
            _positions(kv_idx, S, "padding_mask keep", "key")
            return keep.to(kv_idx.device)[_batch(b, B, "padding_mask keep"), kv_idx]

        return keep_keys
    lengths = _int_tensor("padding_mask lengths", t, "(B,) (or a bool keep mask (B, S))")
    if lengths.dim() != 1 or lengths.numel() == 0 or bool((lengths < 0).any()):
        raise AttentionArgumentError(
            f"padding_mask lengths must be a (B,) tensor of ints >= 0, got {lengths!r:.80}"
        )

    def leading_keys(b, h, q_idx, kv_idx):
        return kv_idx < lengths.to(kv_idx.device)[_batch(b, lengths.shape[0], "lengths")]

    return leading_keys
