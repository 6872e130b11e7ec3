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

Programmable attention: with a ``score_mod`` and/or a ``block_mask`` (torch's FlexAttention
arguments) step 2 is :func:`qkv.flex_attention` on the blockwise kernel instead (grouped-query
heads with ``enable_gqa``), after the record's other mask parts are folded in
(:meth:`~qkv.nn.hooks.AttentionInputs.flex_parts`: ``is_causal`` AND-ed into the block mask,
ALiBi and a mask tensor applied after ``score_mod``). Weights on request come from the
kernel's log-sum-exp. Two cases run a dense ``(B, H, T, S)`` version of the same definition
instead, because the kernel forms no weights to drop or hook: attention dropout
(``dropout_p > 0``), except on a GPU where the block-sparse Triton kernels serve the call
(they compute dropout's counter-based mask themselves, :mod:`qkv.attention.dropout`: the
same weights the dense version drops), and a hook on ``hook_scores`` / ``hook_weights``; so
does a traced call (``torch.compile``, ``torch.export``), because the kernel's tile skipping
reads the block mask's values. A replaced kernel (``core.kernel``)
does not take flex calls.

Validation happens once, at the public boundary (the module's ``forward``): the core trusts
its arguments. A hook that replaces the ``hook_inputs`` record is checked like a user call.

The kernel call itself can be replaced: ``core.kernel`` (None by default) is a callable
``(AttentionCall) -> (out, weights or None)`` run instead of :func:`run_call`;
:func:`qkv.distributed.context_parallel` installs one that attends across processes. Hook
points before and after it still run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from qkv.attention import dropout
from qkv.attention.backends import math as math_backend
from qkv.attention.flex import flex_attention
from qkv.attention.flex import triton_path as flex_triton
from qkv.attention.flex.blocks import BlockMask, index_grid, tile_keep
from qkv.attention.masks import accumulation_dtype
from qkv.attention.sdpa import run_call
from qkv.checks import values_unknown
from qkv.nn.hooks import AttentionInputs, HookPoint, listening
from qkv.nn.options import AttentionOptions

__all__ = ["AttentionCore", "flex_dense"]

_NO_OPTIONS = AttentionOptions()


def _temperatures(taus: tuple[float, ...], q: Tensor) -> Tensor:
    """Per-head temperatures as ``(H, 1, 1)`` for queries ``q (B, H, T, D)``."""
    if len(taus) != q.shape[1]:
        raise ValueError(f"temperature has {len(taus)} entries but the attention has "
                         f"H={q.shape[1]} query heads (one per head)")
    return torch.tensor(taus, dtype=q.dtype, device=q.device).view(-1, 1, 1)


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
        score_mod: Callable | None = None,
        block_mask: BlockMask | None = None,
        options: AttentionOptions | None = None,
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
            score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` (:func:`qkv.flex_attention`)
                or None.
            block_mask: a ``BlockMask`` for ``(T, S)`` (:func:`qkv.create_block_mask`) or None.
                With either, the call runs :func:`qkv.flex_attention` (see the module
                docstring for how ``mask``, ``is_causal`` and ``alibi_slopes`` combine).
            options: the module's :class:`~qkv.nn.options.AttentionOptions`, read here for
                what acts in the kernel call: ``scale`` (the factor on ``q·k``, None:
                ``1/sqrt(D)``) and ``window`` (a sliding causal window ``w``, with
                ``is_causal``: query ``i`` sees only the ``w`` keys ending at its diagonal),
                and ``temperature`` (head ``h``'s scores divided by ``τ_h``).

        Returns:
            ``(out (B, H, T, Dv), weights (B, H, T, S) or None)``; rows with no visible key
            give zeros.
        """
        options = options or _NO_OPTIONS
        if options.temperature is not None:
            q = q / _temperatures(options.temperature, q)  # (B, H, T, D): scores / τ_h
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        inputs = AttentionInputs(
            q, k, v, attn_mask=mask, is_causal=is_causal, alibi_slopes=alibi_slopes,
            enable_gqa=q.shape[1] != k.shape[1], dropout_p=dropout_p, cross=cross,
            scale=options.scale, score_mod=score_mod, block_mask=block_mask,
            window=options.window,
        )
        if self.hook_inputs.listening:
            replaced = self.hook_inputs(inputs)
            # A replaced record comes from user code: it is validated like a user call.
            inputs = replaced if replaced is inputs else replaced.checked()
        if inputs.is_flex:
            out, weights = self._flex(inputs, need_weights)
            return self.hook_out(out), weights  # (B, H, T, Dv), (B, H, T, S) | None
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

    def _flex(self, inputs: AttentionInputs, need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """A flex record: the blockwise kernel, or the dense path when weights must exist."""
        if self.kernel is not None:
            raise RuntimeError(
                "score_mod/block_mask cannot run while this module's kernel call is replaced "
                "(e.g. by qkv.distributed.context_parallel); call the model on one process"
            )
        score_mod, block_mask = inputs.flex_parts()
        # The blockwise kernel reads the block mask's values to skip tiles, which a trace
        # (torch.compile, torch.export) cannot: traced calls take the dense definition.
        dense = values_unknown(inputs.query) or (
            inputs.dropout_p > 0.0 and not drops_in_kernel(inputs, score_mod, block_mask,
                                                          need_weights))
        if dense or listening(self.hook_scores, self.hook_weights):
            return flex_dense(
                inputs, score_mod, block_mask, need_weights=need_weights,
                on_scores=self.hook_scores, on_weights=self.hook_weights,
            )
        if inputs.dropout_p > 0.0:
            q = inputs.query
            scale = inputs.scale if inputs.scale is not None else q.shape[-1] ** -0.5
            out, _ = flex_triton.attend(q, inputs.key, inputs.value, block_mask, scale,
                                        score_mod, dropout_p=inputs.dropout_p)
            return out, None
        result = flex_attention(
            inputs.query, inputs.key, inputs.value, score_mod, block_mask, inputs.scale,
            enable_gqa=inputs.enable_gqa, need_weights=need_weights,
        )
        return result if need_weights else (result, None)


def drops_in_kernel(inputs: AttentionInputs, score_mod: Callable | None,
                    block_mask: BlockMask | None, need_weights: bool) -> bool:
    """Whether a flex record with dropout runs on the block-sparse Triton kernels, which
    compute dropout's counter-based mask themselves (on a GPU, when they serve the call and
    no weights are asked for), rather than on the dense definition."""
    q = inputs.query
    return (not need_weights and dropout.counter_based(q.device)
            and flex_triton.why_not(q, inputs.value, score_mod, block_mask, named=False) is None)


def flex_dense(
    inputs: AttentionInputs,
    score_mod: Callable | None,
    block_mask: BlockMask | None,
    *,
    need_weights: bool = False,
    on_scores: Callable[[Tensor], Tensor] | None = None,
    on_weights: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`qkv.flex_attention`'s definition on the whole ``(B, H, T, S)`` grid at once.

    The scores ``(q·scale)·kᵀ`` go through ``score_mod``, then ``block_mask.mask_mod`` hides
    keys (evaluated everywhere: a full tile is all True and an empty one all False, so this is
    the block mask's meaning), then ``on_scores``, the softmax (rows with no visible key give
    zeros), ``on_weights`` and dropout ``inputs.dropout_p``. Half precision is computed in
    float32. O(T·S) memory, as the math backend.

    Returns:
        ``(out (B, H, T, Dv), weights (B, H, T, S) after dropout, or None)``.
    """
    q, k, v = inputs.query, inputs.key, inputs.value
    B, H, T, D = q.shape
    S, G = k.shape[2], q.shape[1] // k.shape[1]
    acc = accumulation_dtype(q.dtype)
    scale = inputs.scale if inputs.scale is not None else 1.0 / D**0.5
    if G > 1:
        k = k.repeat_interleave(G, dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(G, dim=1)  # (B, H, S, Dv)
    # 1) Scores, scaled as the kernel scales them (the queries first).
    scores = (q.to(acc) * scale) @ k.to(acc).transpose(-2, -1)  # (B, H, T, S)
    grid = index_grid(B, H, range(T), range(S), q.device)
    # 2) The user's score_mod (and the folded ALiBi and mask tensor), then the mask_mod.
    if score_mod is not None:
        scores = torch.broadcast_to(score_mod(scores, *grid), (B, H, T, S))
    if block_mask is not None:
        keep = tile_keep(block_mask.mask_mod, B, H, range(T), range(S), q.device)
        scores = scores.masked_fill(~keep, float("-inf"))  # (B, H, T, S)
    if on_scores is not None:
        scores = on_scores(scores).to(acc)
    # 3) Softmax over the keys; dead rows give zeros.
    weights = math_backend.softmax_rows(scores)
    if on_weights is not None:
        weights = on_weights(weights).to(acc)
    # 4) Dropout on the weights (training only), then the weighted sum of the values.
    applied = weights
    if inputs.dropout_p > 0.0:  # qkv's mask (torch's draw on the CPU, Philox on a GPU)
        keep = dropout.draw_keep(B, H, T, S, inputs.dropout_p, q)  # (B, H, T, S)
        applied = weights * keep / (1.0 - inputs.dropout_p)
    out = (applied @ v.to(acc)).to(q.dtype)  # (B, H, T, Dv)
    return out, applied.to(q.dtype) if need_weights else None
