"""Mask builders and conversions (re-exported by :mod:`qkv.attention.masks`).

Polarity, once and for all:

* **keep** (SDPA, ``qkv.scaled_dot_product_attention``): a boolean mask where True means the
  query *may attend* to the key. Every builder here returns keep masks.
* **drop** (``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``): True
  means the key is *ignored*. Convert with :func:`from_mha` and :func:`to_mha`.
* **float** masks have no polarity: they are added to the scores, ``-inf`` hides a key.

Shapes: ``T`` queries, ``S`` keys, ``B`` batch. Builders return ``(T, S)`` for position masks
and ``(B, 1, 1, S)`` for padding masks, both broadcastable to the scores ``(B, H, T, S)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "causal",
    "combine",
    "from_mha",
    "padding",
    "padding_from_ids",
    "sliding_window",
    "to_additive",
    "to_mha",
]

_ALIGNS = ("top-left", "bottom-right")


def _diagonal(T: int, S: int, align: str, offset: int) -> int:
    """Index shift so that query ``i`` is at key position ``i + shift``."""
    if align not in _ALIGNS:
        raise ValueError(f"align must be one of {_ALIGNS}, got {align!r}")
    if not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    return offset + (S - T if align == "bottom-right" else 0)


def _check_lengths(T: int, S: int | None) -> int:
    for name, n in (("T", T), ("S", S if S is not None else T)):
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return T if S is None else S


def causal(
    T: int,
    S: int | None = None,
    *,
    align: str = "top-left",
    offset: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Keep mask ``(T, S)`` letting query ``i`` see keys up to its own position.

    Args:
        T: number of queries.
        S: number of keys (defaults to ``T``).
        align: ``"top-left"`` (torch's ``is_causal``: query ``i`` sees keys ``j <= i``) or
            ``"bottom-right"`` (the last query sees the last key: ``j <= i + S - T``, the
            alignment of decoding with a cache of ``S - T`` earlier keys).
        offset: extra shift of the queries: query ``i`` sits at position ``i + offset``.
            Cached decoding of one new token after ``n`` cached ones is ``T=1, S=n+1,
            offset=n`` (equivalently ``align="bottom-right"``).
        device: where to build the mask.

    Returns:
        Boolean ``(T, S)``, True where the query may attend.
    """
    S = _check_lengths(T, S)
    shift = _diagonal(T, S, align, offset)
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=shift)


def sliding_window(
    T: int,
    S: int | None = None,
    *,
    window: int,
    align: str = "top-left",
    offset: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Causal keep mask ``(T, S)`` that also hides keys more than ``window - 1`` behind.

    Query ``i`` (at position ``p = i + shift``, see :func:`causal`) sees keys
    ``p - window < j <= p``: itself and the ``window - 1`` keys before it.

    Raises:
        ValueError: ``window`` is not a positive int.
    """
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    S = _check_lengths(T, S)
    shift = _diagonal(T, S, align, offset)
    ones = torch.ones(T, S, dtype=torch.bool, device=device)
    return ones.tril(diagonal=shift) & ones.triu(diagonal=shift - window + 1)


def padding(lengths: Tensor | Sequence[int], S: int | None = None) -> Tensor:
    """Keep mask ``(B, 1, 1, S)`` hiding the padded keys of each sequence.

    Args:
        lengths: ``(B,)`` number of real (leading) tokens in each sequence.
        S: padded length; defaults to ``max(lengths)``.

    Raises:
        ValueError: negative lengths, lengths over ``S``, or not 1-D.
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D integer tensor (B,), got shape {tuple(lengths.shape)} "
            f"and dtype {lengths.dtype}"
        )
    longest = int(lengths.max()) if lengths.numel() else 0
    S = longest if S is None else S
    if lengths.numel() and (int(lengths.min()) < 0 or longest > S):
        raise ValueError(f"lengths must lie in [0, S={S}], got {lengths.tolist()}")
    positions = torch.arange(S, device=lengths.device)  # (S,)
    keep = positions[None, :] < lengths[:, None]  # (B, S)
    return keep[:, None, None, :]  # (B, 1, 1, S)


def padding_from_ids(ids: Tensor, pad_id: int) -> Tensor:
    """Keep mask ``(B, 1, 1, S)`` hiding every position of ``ids (B, S)`` equal to ``pad_id``."""
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"ids must be a (B, S) tensor of token ids, got {shape}")
    return (ids != pad_id)[:, None, None, :]  # (B, 1, 1, S)


def to_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Float mask of ``dtype``: 0 where a keep mask is True, ``-inf`` where False.

    A float mask is returned cast to ``dtype``.
    """
    if mask.dtype == torch.bool:
        zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return zeros.masked_fill(~mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"mask must be bool or float, got dtype {mask.dtype}")
    return mask.to(dtype)


def from_mha(mask: Tensor) -> Tensor:
    """Convert a ``torch.nn.MultiheadAttention`` mask (bool True = ignore) to SDPA polarity.

    Boolean masks are inverted; float masks are returned unchanged (they have no polarity).
    """
    if mask.dtype == torch.bool:
        return ~mask
    if not mask.is_floating_point():
        raise TypeError(f"mask must be bool or float, got dtype {mask.dtype}")
    return mask


def to_mha(mask: Tensor) -> Tensor:
    """Convert an SDPA keep mask to ``torch.nn.MultiheadAttention`` polarity (True = ignore)."""
    return from_mha(mask)  # inversion is its own inverse


def combine(*masks: Tensor | None) -> Tensor | None:
    """Intersect masks: a key is visible only where every mask lets it through.

    ``None`` entries are skipped. All-boolean inputs give a boolean keep mask (logical and);
    any float input gives a float mask (booleans become 0/-inf, floats are summed). The
    result has the broadcast shape of the inputs.

    Raises:
        ValueError: shapes that do not broadcast together.
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    try:
        torch.broadcast_shapes(*(m.shape for m in present))
    except RuntimeError:
        shapes = ", ".join(str(tuple(m.shape)) for m in present)
        raise ValueError(f"masks of shapes {shapes} do not broadcast together") from None
    if all(m.dtype == torch.bool for m in present):
        out = present[0]
        for m in present[1:]:
            out = out & m
        return out
    dtype = next(m.dtype for m in present if m.dtype != torch.bool)
    out = to_additive(present[0], dtype)
    for m in present[1:]:
        out = out + to_additive(m, dtype)
    return out
