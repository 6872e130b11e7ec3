"""The public entry point: ``scaled_dot_product_attention`` and ``explain``.

    Attention(Q, K, V) = softmax(Q·Kᵀ · scale + mask) · V        (Vaswani et al., 2017)

This module only validates (``call.py``), dispatches (``dispatch.py``), runs a backend and
restores the caller's shapes; the arithmetic lives in ``backends/``. Callers that already
hold a validated :class:`AttentionCall` (the ``nn`` attention core) use :func:`run_call`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkv.attention import dispatch
from qkv.attention.call import AttentionCall, make_call
from qkv.attention.dispatch import Explanation
from qkv.attention.errors import AttentionArgumentError
from qkv.attention.flex.sdpa import FlexExplanation, explain_flex, sdpa_flex
from qkv.attention.threads import fitted_threads

__all__ = ["explain", "run_call", "run_call_lse", "scaled_dot_product_attention"]


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool | str = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    need_weights: bool = False,
    backend: str = "auto",
    window: int | None = None,
    alibi_slopes: Tensor | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """Scaled dot-product attention with the semantics of torch's, plus weights on request.

    Args:
        query: ``(..., H, T, D)``; any number of leading batch dimensions (or ``(T, D)``).
        key: ``(..., Hkv, S, D)``; ``Hkv == H`` unless ``enable_gqa``.
        value: ``(..., Hkv, S, Dv)``. Leading dimensions (heads included) of the three
            broadcast as in torch, across ranks too: ``query (4, 3, 8)`` with
            ``key (4, 4, 6, 8)`` is 4 batches of 4 heads.
        attn_mask: ``None``; a boolean mask where True means *may attend*; or a float mask
            added to the scores (``-inf`` hides a key). Broadcastable to ``(..., H, T, S)``.
            torch's ``causal_upper_left(T, S)`` / ``causal_lower_right(T, S)`` objects
            (``torch.nn.attention.bias``) mean ``is_causal=True`` / ``"bottom-right"``.
        dropout_p: probability of zeroing an attention weight; applied only when > 0, so pass
            0 in evaluation.
        is_causal: hide keys after the query. ``True`` (or ``"top-left"``) aligns top-left
            as torch does (query ``i`` sees keys ``j <= i``); ``"bottom-right"`` aligns the
            last query with the last key (decoding after ``S - T`` cached keys). Combined with
            ``attn_mask`` by logical and. Other offsets: :func:`qkv.masks.causal`.
        scale: factor on ``q·k``; ``1/sqrt(D)`` when None.
        enable_gqa: allow grouped-query attention, ``H`` a multiple of ``Hkv``; query head
            ``h`` reads key/value head ``h // (H / Hkv)`` as in torch.
        need_weights: also return the attention weights.
        backend: ``"auto"`` (the fastest backend that can honour the call), ``"torch"``
            (torch's fused kernel), ``"flash"`` (qkv's blockwise kernel), ``"math"`` (the
            textbook steps) or the name of a backend added with
            :func:`qkv.attention.backends.register`.
        window: keyword-only extra: a sliding causal window; query ``i`` sees only the
            ``window`` keys ending at its diagonal (needs ``is_causal``).
        alibi_slopes: keyword-only extra: ``(H,)`` finite ALiBi slopes (used in float32);
            adds ``-slope_h · |i + shift - j|`` to the scores, ``shift`` the causal diagonal
            (``S - T`` without ``is_causal``), as in Press et al., 2022.
        score_mod: keyword-only extra: ``(score, b, h, q_idx, kv_idx) -> score`` on the
            scaled scores, torch's FlexAttention signature (4-D inputs; runs
            :func:`qkv.flex_attention` on the blockwise kernel).
        mask_mod: keyword-only extra: ``(b, h, q_idx, kv_idx) -> bool`` (True = may attend);
            tiles it leaves empty are skipped. ``is_causal`` and ``attn_mask`` combine with
            either mod; dropout, ``window`` and ``alibi_slopes`` do not (use the mods of
            :mod:`qkv.attention.mods`).
        return_lse: keyword-only extra: also return the log-sum-exp of each query row,
            ``lse[..., h, i] = log Σ_j exp(s_ij)`` over the scaled, masked scores ``s``
            (as FlashAttention and FlexAttention return it), ``(..., H, T)``, float32
            (float64 for float64 inputs); ``-inf`` on a row with no visible key. Every
            backend gives it (``torch``: on CPU, without dropout, ``Dv == D``). Gradients
            flow through the output always, and through the lse on ``math`` and ``flash``;
            torch's kernel returns it without gradient, so ``auto`` picks ``flash`` when
            the inputs require grad. Not with ``score_mod``/``mask_mod``: use
            :func:`qkv.flex_attention` (``return_lse=True``).

    Returns:
        The output ``(..., H, T, Dv)``, or ``(output, weights)`` with weights ``(..., H, T, S)``
        when ``need_weights``; ``return_lse`` appends the lse: ``(output, lse)`` or
        ``(output, weights, lse)``. A query row with no visible key gets a zero output row, zero
        weights and zero gradient, never NaN. With dropout the weights returned are the ones
        applied (after dropout).

    Precision: float16 and bfloat16 inputs are computed in float32 on every backend (scores,
    mask and ALiBi additions, softmax, the weighted sum of the values); only the output and
    the weights are rounded to the inputs' dtype.

    Non-finite inputs (NaN or ±inf in query, key or value) are not checked (that would cost a
    host sync per call) but never hidden, the same on every backend:

    * a non-finite query row gives a NaN output row and a NaN weights row, even when it
      sees no key;
    * a NaN key row, or a non-finite value row, makes the output non-finite in every row
      that sees that key; an infinite key follows IEEE arithmetic on its score (``+inf`` or
      NaN: the row is NaN; ``-inf``: the key gets weight 0, as if masked). Weights never read
      the values: a non-finite value row leaves them exact;
    * rows of other batch entries and other key/value heads are exact; rows of the same head
      that do *not* see the bad key may be NaN too (a masked key's zero weight times a NaN
      value, or a float mask's ``-inf`` plus a NaN score, is NaN, and which masked positions
      a backend computes depends on its tiling): do not rely on a mask to contain a NaN;
    * backward: gradients of other batch entries and key/value heads are exact; inside the
      affected head the chain rule carries the NaN (a bad query row that sees a key gets a
      NaN gradient, and so do the keys and values it sees).

    Raises:
        AttentionTypeError: (a ``TypeError`` and a ``RuntimeError``) non-tensors, integer or
            mixed dtypes, a mask that is neither bool nor float, a nested or sparse mask.
        AttentionArgumentError: (a ``ValueError`` and a ``RuntimeError``, so code written
            for torch's errors catches it) widths, lengths or head counts that do not fit or
            broadcast, a mask that does not broadcast or holds NaN or +inf, ALiBi slopes
            of the wrong shape, non-finite or large enough to overflow the float32 bias, a
            ``CausalBias`` mask with ``is_causal``, an unknown backend, or a backend that
            cannot honour the call (``backend="torch"`` with ``need_weights=True``).
    """
    if score_mod is not None or mask_mod is not None:
        if return_lse:
            raise AttentionArgumentError(
                "return_lse=True cannot be combined with score_mod/mask_mod here; call "
                "qkv.flex_attention(query, key, value, score_mod, block_mask, "
                "return_lse=True) instead"
            )
        return sdpa_flex(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            need_weights, backend, window, alibi_slopes, score_mod, mask_mod,
        )
    if not isinstance(return_lse, bool):
        raise AttentionArgumentError(f"return_lse must be a bool, got {return_lse!r}")
    call = make_call(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, need_weights,
        window, alibi_slopes, need_lse=return_lse,
    )
    if not return_lse:
        out, weights = run_call(call, backend)
        return _finish(call, out, weights)
    out, weights, lse = run_call_lse(call, backend)
    return (*_tuple(_finish(call, out, weights)), _finish_lse(call, lse))


def run_call_lse(
    call: AttentionCall, backend: str = "auto"
) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`run_call` for a call with ``need_lse``: ``(out (B, H, T, Dv), weights or None,
    lse (B, H, T))``, the lse in the backend's own dtype (see each backend's ``run_lse``)."""
    impl = dispatch.select(call, backend)
    with fitted_threads(call.query, call.key, call.value):
        return impl.run_lse(call)


def _tuple(result: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _finish_lse(call: AttentionCall, lse: Tensor) -> Tensor:
    """The lse ``(B, H, T)`` in the caller's leading dimensions, float32 (float64 inputs:
    float64)."""
    dtype = torch.float64 if call.query.dtype == torch.float64 else torch.float32
    lse = lse.to(dtype).reshape(*call.batch_shape, *lse.shape[1:])  # (..., H, T)
    return lse[0] if call.squeeze_heads else lse  # (T,) for 2-D inputs


def run_call(call: AttentionCall, backend: str = "auto") -> tuple[Tensor, Tensor | None]:
    """Dispatch and run an already validated call, with no validation of its tensors.

    Args:
        call: an :class:`AttentionCall` (from :func:`~qkv.attention.call.make_call`, or built
            directly from 4-D inputs by a caller that has checked them; a user mask in it
            must come from :func:`qkv.attention.masks.check_attn_mask`).
        backend: as in :func:`scaled_dot_product_attention`.

    Returns:
        ``(out (B, H, T, Dv), weights (B, H, T, S) or None)`` in the call's 4-D layout;
        weights only when ``call.need_weights``.

    Raises:
        AttentionArgumentError: an unknown backend, or one that cannot honour the call.
    """
    impl = dispatch.select(call, backend)
    with fitted_threads(call.query, call.key, call.value):
        return impl.run(call)


def _finish(
    call: AttentionCall, out: Tensor, weights: Tensor | None
) -> Tensor | tuple[Tensor, Tensor]:
    """Restore the caller's leading dimensions."""
    out = _restored(call, out)  # (..., H, T, Dv)
    if not call.need_weights:
        return out
    assert weights is not None
    return out, _restored(call, weights)  # (..., H, T, S)


def _restored(call: AttentionCall, t: Tensor) -> Tensor:
    """``t (B, H, T, X)`` in the caller's leading dimensions: ``(..., H, T, X)``, ``(T, X)``
    for 2-D inputs."""
    lead = call.batch_shape
    if len(lead) != 1:  # (one leading dimension is B itself: nothing to restore)
        t = t.reshape(*lead, *t.shape[1:])
    return t[0] if call.squeeze_heads else t


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool | str = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    need_weights: bool = False,
    backend: str = "auto",
    window: int | None = None,
    alibi_slopes: Tensor | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    return_lse: bool = False,
) -> Explanation | FlexExplanation:
    """Say which backend ``scaled_dot_product_attention`` would run for these arguments.

    Takes exactly the arguments of :func:`scaled_dot_product_attention` and validates them
    the same way, but computes nothing. Returns an :class:`Explanation` whose ``chosen`` is
    the backend ``auto`` picks (or the named ``backend``, after checking it can honour the
    call) and whose ``reasons`` say why each other backend was not chosen; ``str()`` of it
    reads as a short report. With ``score_mod``/``mask_mod`` it returns a
    :class:`~qkv.attention.flex.sdpa.FlexExplanation`: the block mask's density (tiles visited,
    full tiles) and the predicted FLOPs and tile memory.
    """
    if score_mod is not None or mask_mod is not None:
        return explain_flex(query, key, value, attn_mask, is_causal, score_mod, mask_mod,
                            dropout_p, window, alibi_slopes, backend)
    call = make_call(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, need_weights,
        window, alibi_slopes, need_lse=bool(return_lse),
    )
    decision = dispatch.decide(call)
    if backend == "auto":
        return decision
    impl = dispatch.select(call, backend)
    reasons = dict(decision.reasons)
    reasons.pop(impl.NAME, None)
    if decision.chosen != impl.NAME:
        reasons[decision.chosen] = f"backend={impl.NAME!r} was requested"
    return Explanation(
        chosen=impl.NAME, reasons=reasons, shapes=decision.shapes, costs=decision.costs
    )
