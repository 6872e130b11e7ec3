"""Turn ``torch.nn.MultiheadAttention``'s masks into the one mask SDPA takes.

``MultiheadAttention`` accepts up to three ways to hide keys, all in torch's *drop* polarity
(bool True = ignore; float masks are added to the scores):

* ``key_padding_mask`` ``(N, S)`` (``(S,)`` unbatched): keys to ignore, per sequence;
* ``attn_mask`` ``(T, S)`` or ``(N·H, T, S)`` (``(H, T, S)`` unbatched): per query row;
* ``is_causal``: a *hint* that ``attn_mask`` is the causal mask (see :func:`resolve_causal`).

:func:`merge` converts both masks to SDPA *keep* polarity with :func:`qkv.masks.from_mha` and
intersects them into one mask broadcastable to the scores ``(N, H, T, S)``; :func:`append_visible`
opens the extra key columns of ``add_bias_kv`` and ``add_zero_attn``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.masks import combine, from_mha
from qkv.nn.errors import DropInArgumentError, DropInTypeError

__all__ = [
    "append_visible",
    "check_mask",
    "check_mask_type",
    "check_masks",
    "check_types",
    "merge",
    "resolve_causal",
]


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_mask_type(name: str, mask: object, device: torch.device | None = None) -> None:
    """``mask`` is None or a bool or floating tensor (on ``device`` when given).

    torch refuses other dtypes with ``AssertionError: only bool and floating types of <name>
    are supported`` (or, for some arguments, fails deep inside ``torch.full``); qkv raises
    :class:`~qkv.nn.errors.DropInTypeError` (an AssertionError too) naming the argument.

    Raises:
        TypeError: not a tensor, or a dtype that is neither bool nor floating.
        ValueError: a tensor on another device than the inputs.
    """
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise DropInTypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise DropInTypeError(
            f"{name} must be boolean (True = ignore, torch's MultiheadAttention polarity) or "
            f"floating point (added to the scores), got dtype {mask.dtype}"
        )
    if device is not None and mask.device != device:
        raise DropInArgumentError(
            f"{name} must be on the inputs' device {device}, got a mask on {mask.device}"
        )


def check_types(inputs: dict[str, object], masks: dict[str, object]) -> None:
    """Tensors for ``inputs``; None or bool/float tensors on the first input's device for
    ``masks`` (the check of a stack of custom layers, whose shapes qkv cannot know).

    Raises:
        TypeError, ValueError: as :func:`check_mask_type`, naming the argument.
    """
    for name, x in inputs.items():
        if not isinstance(x, Tensor):
            raise DropInTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    device = next(iter(inputs.values())).device  # type: ignore[union-attr]
    for name, mask in masks.items():
        check_mask_type(name, mask, device)


def check_mask(
    name: str, mask: Tensor | None, *, kind: str, batched: bool, N: int, H: int, T: int,
    S: int, device: torch.device | None = None,
) -> None:  # fmt: skip
    """Check one mask's type, dtype, device and shape as the caller gave it.

    Args:
        name: the caller's argument name (``src_mask``, ``memory_key_padding_mask``, ...).
        mask: None, or a bool/float tensor.
        kind: ``"padding"`` (expected ``(N, S)``, ``(S,)`` unbatched) or ``"attn"``
            (expected ``(T, S)`` or ``(N·H, T, S)``, ``(H, T, S)`` unbatched).
        batched: whether the inputs are 3-D.
        N, H, T, S: batch size, query heads, query length, key length.
        device: the inputs' device (None: not checked).

    Raises:
        TypeError: as :func:`check_mask_type`.
        ValueError: a shape that is not one of the expected ones, another device.
    """
    if mask is None:
        return
    check_mask_type(name, mask, device)
    if kind == "padding":
        want = (N, S) if batched else (S,)
        if _shape(mask) != want:
            layout = "(N, S)" if batched else "(S,) for unbatched inputs"
            raise DropInArgumentError(f"{name} must have shape {layout} = {want}, got "
                                      f"{_shape(mask)}")  # fmt: skip
        return
    wants = [(T, S), (N * H, T, S)] if batched else [(T, S), (H, T, S)]
    if _shape(mask) not in wants:
        layout = "(N·H, T, S)" if batched else "(H, T, S)"
        raise DropInArgumentError(
            f"{name} must have shape (T, S) = {wants[0]} or {layout} = {wants[1]}, got "
            f"{_shape(mask)}"
        )


def check_masks(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    *,
    batched: bool,
    N: int,
    H: int,
    T: int,
    S: int,
    device: torch.device | None = None,
) -> None:
    """Check dtypes, devices and shapes of the masks as the caller gave them (before
    unsqueezing); :func:`check_mask` under ``MultiheadAttention``'s argument names.

    Args:
        key_padding_mask: expected ``(N, S)`` for batched inputs, ``(S,)`` unbatched.
        attn_mask: expected ``(T, S)`` or ``(N·H, T, S)`` (``(H, T, S)`` unbatched).
        batched: whether the query was 3-D.
        N, H, T, S: batch size, query heads, query length, key length.
        device: the inputs' device (None: not checked).

    Raises:
        TypeError: a mask that is neither bool nor float.
        ValueError: a mask whose shape is not one of the expected ones, or on another device.
    """
    dims = {"batched": batched, "N": N, "H": H, "T": T, "S": S, "device": device}
    check_mask("key_padding_mask", key_padding_mask, kind="padding", **dims)
    check_mask("attn_mask", attn_mask, kind="attn", **dims)


def resolve_causal(
    attn_mask: Tensor | None, is_causal: bool, *, has_padding: bool, need_weights: bool
) -> tuple[Tensor | None, bool]:
    """Apply torch's reading of the ``is_causal`` hint; returns ``(attn_mask, is_causal)``.

    As in ``torch.nn.functional.multi_head_attention_forward``: the hint requires
    ``attn_mask`` (which it asserts *is* the causal mask). With no padding mask and no
    weights requested, the mask is dropped and the fused causal path (top-left aligned) runs
    instead; otherwise the mask itself is used and the hint is ignored. The two agree
    whenever the hint is true.

    Raises:
        ValueError: ``is_causal=True`` without ``attn_mask`` (torch raises too).
    """
    if not is_causal:
        return attn_mask, False
    if attn_mask is None:
        raise DropInArgumentError(
            "is_causal=True is a hint that attn_mask is the causal mask, so it needs attn_mask; "
            "got attn_mask=None (build one with Transformer.generate_square_subsequent_mask)"
        )
    if has_padding or need_weights:
        return attn_mask, False
    return None, True


def merge(
    key_padding_mask: Tensor | None, attn_mask: Tensor | None, *, N: int, H: int
) -> Tensor | None:
    """One SDPA keep-or-float mask from torch-polarity masks; ``None`` if both are ``None``.

    Args:
        key_padding_mask: ``(N, S)`` bool (True = ignore) or float (added).
        attn_mask: ``(T, S)`` or ``(N·H, T, S)``, bool (True = ignore) or float (added).
        N, H: batch size and query heads, to unflatten a 3-D ``attn_mask``.

    Returns:
        A mask broadcastable to the scores ``(N, H, T, S)``: boolean (True = may attend) when
        both masks are boolean, else a float mask equal to the sum of torch's additive forms,
        exactly what ``multi_head_attention_forward`` adds to the scores.
    """
    padding = None
    if key_padding_mask is not None:
        padding = from_mha(key_padding_mask)[:, None, None, :]  # (N, 1, 1, S)
    position = None
    if attn_mask is not None:
        position = from_mha(attn_mask)  # (T, S) or (N·H, T, S)
        if position.dim() == 3:
            position = position.reshape(N, H, *position.shape[1:])  # (N, H, T, S)
    return combine(position, padding)


def append_visible(mask: Tensor | None, n: int) -> Tensor | None:
    """Append ``n`` always-visible key columns to ``mask`` (last dimension).

    ``add_bias_kv`` and ``add_zero_attn`` append keys that every query may see: a True column
    in a keep mask, a 0 column in a float mask (torch pads its masks with 0 the same way).
    """
    if mask is None or n == 0:
        return mask
    size = (*mask.shape[:-1], n)
    visible = mask.new_zeros(size) if mask.is_floating_point() else mask.new_ones(size)
    return torch.cat([mask, visible], dim=-1)  # (..., S + n)
