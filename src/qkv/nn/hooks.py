"""Hook points: named identity modules where an intermediate can be read or replaced.

A :class:`HookPoint` returns its input unchanged. Its value is that it is a *module* with a
name in ``model.named_modules()`` (``blocks.0.self_attn.hook_q``), so a forward hook on it sees
the intermediate and may return a replacement, which then flows on (TransformerLens names its
hook points the same way). Nothing is computed for a hook point nobody listens to, except
``hook_scores`` and ``hook_weights`` of an attention module (:class:`~qkv.nn.core.AttentionCore`):
the fused kernels never form the ``(B, H, T, S)`` scores, so those two exist only when a hook
asks for them, and then that one layer runs the math backend instead of the kernel.

:class:`AttentionInputs` is what an attention module hands to
:func:`qkv.scaled_dot_product_attention`: queries and keys after rotary positions and the KV
cache, and the mask parts (keep/float mask, causal alignment, ALiBi slopes). Its hook point
(``hook_inputs``) lets :mod:`qkv.inspect` rebuild exact weights for chosen heads and rows
without touching the model's own call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qkv.attention.call import AttentionCall, causal_shift, make_call

__all__ = ["AttentionInputs", "HookPoint", "listening"]


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

    def to_call(self, need_weights: bool = False) -> AttentionCall:
        """This record as the :class:`~qkv.attention.call.AttentionCall` the backends run.

        No validation: the record was built by an attention module from checked arguments
        (``attn_mask`` 4-D, ``alibi_slopes`` float32), or passed :meth:`checked`.
        """
        q, k = self.query, self.key
        T, S, D = q.shape[2], k.shape[2], q.shape[3]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(D) if D else 1.0
        return AttentionCall(
            query=q, key=k, value=self.value, mask=self.attn_mask,
            causal=causal_shift(self.is_causal, T, S), window=None, alibi=self.alibi_slopes,
            scale=float(scale), dropout_p=float(self.dropout_p), need_weights=need_weights,
            batch_shape=(q.shape[0],),
        )

    def checked(self) -> AttentionInputs:
        """The record validated as :func:`qkv.scaled_dot_product_attention` validates a call
        (for records built or replaced by user code); the mask comes back in its 4-D form.

        Raises:
            TypeError, ValueError: as :func:`qkv.scaled_dot_product_attention`.
        """
        for name in ("query", "key", "value"):
            t = getattr(self, name)
            if not isinstance(t, Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"AttentionInputs.{name} must be a 4-D tensor, got {shape}")
        call = make_call(
            self.query, self.key, self.value, self.attn_mask, self.dropout_p, self.is_causal,
            self.scale, self.enable_gqa, False, None, self.alibi_slopes,
        )
        return dataclasses.replace(self, attn_mask=call.mask, alibi_slopes=call.alibi)
