"""Hook points: named identity modules where an intermediate can be read or replaced.

A :class:`HookPoint` returns its input unchanged. Its value is that it is a *module* with a
name in ``model.named_modules()`` (``blocks.0.self_attn.hook_q``), so a forward hook on it sees
the intermediate and may return a replacement, which then flows on (TransformerLens names its
hook points the same way). Nothing is computed for a hook point nobody listens to, except
``hook_scores`` and ``hook_weights`` of :class:`~qkv.nn.attention.Attention`: the fused kernels
never form the ``(B, H, T, S)`` scores, so those two exist only when a hook asks for them, and
then that one layer runs :func:`explicit_attention` (the math path) instead of the kernel.

:class:`AttentionInputs` is what an attention module hands to
:func:`qkv.scaled_dot_product_attention`: queries and keys after rotary positions and the KV
cache, and the mask parts (keep/float mask, causal alignment, ALiBi slopes). Its hook point
(``hook_inputs``) lets :mod:`qkv.inspect` rebuild exact weights for chosen heads and rows
without touching the model's own call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qkv.attention.backends import math as math_backend
from qkv.attention.call import make_call

__all__ = ["AttentionInputs", "HookPoint", "explicit_attention", "listening"]


class HookPoint(nn.Module):
    """Identity module marking a named intermediate (no parameters, no state).

    ``forward(x)`` returns ``x``. A forward hook registered on it (directly, with
    :meth:`add_hook`, or through :func:`qkv.inspect.hooks`) receives the value and may return a
    replacement.
    """

    def forward(self, x: Any) -> Any:
        return x

    @property
    def listening(self) -> bool:
        """Whether any hook is attached (then optional intermediates are computed)."""
        return bool(self._forward_hooks) or bool(self._forward_pre_hooks)

    def add_hook(self, fn: Callable[[Any, HookPoint], Any]) -> RemovableHandle:
        """Attach ``fn(value, hook_point) -> replacement | None``; returns a removable handle.

        Returning None keeps the value (reading); returning a value of the same kind and shape
        replaces it (ablation, patching).
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        return self.register_forward_hook(lambda module, args, out: fn(out, module))


def listening(*points: HookPoint) -> bool:
    """True when any of ``points`` has a hook attached."""
    return any(p.listening for p in points)


@dataclass(frozen=True)
class AttentionInputs:
    """The arguments an attention module passes to ``scaled_dot_product_attention``.

    Attributes:
        query: ``(B, H, T, D)`` after rotary positions.
        key: ``(B, Hkv, S, D)``: every key attended to (cached ones included), rotated.
        value: ``(B, Hkv, S, Dv)``.
        attn_mask: None, a boolean keep mask or a float mask broadcastable to ``(B, H, T, S)``.
        is_causal: False, True (top-left) or ``"bottom-right"``.
        alibi_slopes: ``(H,)`` ALiBi slopes or None.
        enable_gqa: ``H != Hkv``.
        dropout_p: dropout on the weights (0 in evaluation).
        cross: keys come from a context (cross-attention), not from the queries' sequence.
        scale: factor on ``q·k`` (None: ``1/sqrt(D)``).
    """

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None = None
    is_causal: bool | str = False
    alibi_slopes: Tensor | None = None
    enable_gqa: bool = False
    dropout_p: float = 0.0
    cross: bool = False
    scale: float | None = None


def explicit_attention(
    inputs: AttentionInputs,
    hook_scores: HookPoint,
    hook_weights: HookPoint,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention by its four steps, with the scores and weights passed through hook points.

    Equal to the math backend of :func:`qkv.scaled_dot_product_attention` when the hooks
    replace nothing. Used only for a layer whose ``hook_scores`` or ``hook_weights`` has a
    listener, since only this path forms those tensors.

    Args:
        inputs: the call's :class:`AttentionInputs`.
        hook_scores: sees the scaled, masked scores ``(B, H, T, S)`` (hidden keys ``-inf``).
        hook_weights: sees the softmax weights ``(B, H, T, S)``, before dropout.
        need_weights: also return the weights (after dropout, as SDPA does).

    Returns:
        ``(out (B, H, T, Dv), weights or None)``.

    Raises:
        The errors of :func:`qkv.scaled_dot_product_attention`'s argument checks.
    """
    call = make_call(
        inputs.query, inputs.key, inputs.value, inputs.attn_mask, inputs.dropout_p,
        inputs.is_causal, inputs.scale, inputs.enable_gqa, need_weights, None,
        inputs.alibi_slopes,
    )
    return math_backend.run(call, on_scores=hook_scores, on_weights=hook_weights)
