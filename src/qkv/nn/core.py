"""The one attention core: everything an attention module does after its projections.

Every module that attends (:class:`~qkv.nn.attention.Attention`, the torch drop-in
:class:`~qkv.nn.multihead.MultiheadAttention`, the teaching modules
:class:`~qkv.nn.heads.AttentionHead` and :class:`~qkv.nn.heads.SelfAttention`) is an
:class:`AttentionCore`. The module owns its parameters, its projections and its API's
conventions (torch's mask polarity, ``batch_first``, a causal ``tril`` buffer, ...); it hands
the core queries, keys and values split into heads and one mask in SDPA polarity, and the core
does the rest, written once:

1. the hook points ``hook_q (B, H, T, D)``, ``hook_k (B, Hkv, S, D)``, ``hook_v (B, Hkv, S, Dv)``
   (after rotary positions and the KV cache) and ``hook_inputs`` (the
   :class:`~qkv.nn.hooks.AttentionInputs` record: what :mod:`qkv.inspect` rebuilds exact weights
   from);
2. the kernel call: :func:`qkv.attention.sdpa.run_call` on an already validated
   :class:`~qkv.attention.call.AttentionCall` (``auto`` picks the fastest backend that can
   honour it), or, while a hook listens on ``hook_scores``/``hook_weights``, the math backend,
   the only path that forms those ``(B, H, T, S)`` tensors (float32 for float16/bfloat16
   inputs: the precision the output is computed in);
3. weights on request, and ``hook_out (B, H, T, Dv)``, the per-head outputs before merging.

Validation happens once, at the public boundary (the module's ``forward``): the core trusts
its arguments. A hook that replaces the ``hook_inputs`` record is checked like a user call.

The kernel call itself can be replaced: ``core.kernel`` (None by default) is a callable
``(AttentionCall) -> (out, weights or None)`` run instead of :func:`run_call`;
:func:`qkv.distributed.context_parallel` installs one that attends across processes. Hook
points before and after it still run.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from qkv.attention.backends import math as math_backend
from qkv.attention.sdpa import run_call
from qkv.nn.hooks import AttentionInputs, HookPoint, listening

__all__ = ["AttentionCore"]


class AttentionCore(nn.Module):
    """Base of every attention module: hook points, the kernel call, weights on request.

    Subclasses set the attributes ``num_heads`` (``H``) and ``num_kv_heads`` (``Hkv``) and call
    :meth:`attend` from their ``forward``. The hook points are identity modules with no
    parameters, so they add no ``state_dict`` keys.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_inputs = HookPoint()
        self.hook_scores, self.hook_weights = HookPoint(), HookPoint()
        self.hook_out = HookPoint()
        # A replacement of the kernel call, (AttentionCall) -> (out, weights | None).
        self.kernel: Callable | None = None

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None = None,
        is_causal: bool | str = False,
        alibi_slopes: Tensor | None = None,
        dropout_p: float = 0.0,
        need_weights: bool = False,
        cross: bool = False,
        scale: float | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of heads that are already projected; the arguments are trusted.

        Args:
            q: ``(B, H, T, D)`` queries (after rotary positions).
            k: ``(B, Hkv, S, D)`` every key attended to (cached ones included).
            v: ``(B, Hkv, S, Dv)``.
            mask: None or a validated mask in SDPA polarity (bool True = may attend, or float
                added to the scores), 4-D and broadcastable to ``(B, H, T, S)``
                (:func:`qkv.attention.masks.check_attn_mask` gives that form).
            is_causal: False, True (top-left, torch's alignment) or ``"bottom-right"``.
            alibi_slopes: ``(H,)`` float32 ALiBi slopes or None.
            dropout_p: dropout on the weights (pass 0 in evaluation).
            need_weights: also return the weights ``(B, H, T, S)`` (after dropout, as SDPA).
            cross: the keys come from another sequence (recorded for :mod:`qkv.inspect`).
            scale: factor on ``q·k``; ``1/sqrt(D)`` when None.

        Returns:
            ``(out (B, H, T, Dv), weights (B, H, T, S) or None)``; rows with no visible key
            give zeros.
        """
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        inputs = AttentionInputs(
            q, k, v, attn_mask=mask, is_causal=is_causal, alibi_slopes=alibi_slopes,
            enable_gqa=q.shape[1] != k.shape[1], dropout_p=dropout_p, cross=cross, scale=scale,
        )
        if self.hook_inputs.listening:
            replaced = self.hook_inputs(inputs)
            # A replaced record comes from user code: it is validated like a user call.
            inputs = replaced if replaced is inputs else replaced.checked()
        call = inputs.to_call(need_weights)
        if self.kernel is not None:
            if listening(self.hook_scores, self.hook_weights):
                raise RuntimeError(
                    "hook_scores/hook_weights cannot listen while this module's kernel call is "
                    "replaced (e.g. by qkv.distributed.context_parallel): no (T, S) scores "
                    "exist there; capture on one process instead"
                )
            out, weights = self.kernel(call)
        elif listening(self.hook_scores, self.hook_weights):
            # Someone reads or replaces the scores or weights: only the math path forms them.
            out, weights = math_backend.run(
                call, on_scores=self.hook_scores, on_weights=self.hook_weights
            )
        else:
            out, weights = run_call(call)
        return self.hook_out(out), weights  # (B, H, T, Dv), (B, H, T, S) | None
