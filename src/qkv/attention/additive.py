"""Additive (Bahdanau) and multiplicative (Luong) attention scores, and attention over them.

    Bahdanau et al., 2014:   e[t, s] = vᵀ tanh(q_t W_q + k_s W_k + b)
    Luong et al., 2015:      e[t, s] = q_t · k_s          ("dot")
                             e[t, s] = q_t W k_sᵀ          ("general")
                             Luong's "concat" score, vᵀ tanh(W [q_t ; k_s]), is Bahdanau's
                             with W = [W_q ; W_k]: use :func:`bahdanau_scores`.
    then                     α[t, :] = softmax(e[t, :] + mask),   c_t = Σ_s α[t, s] v_s

These are the scores of the RNN encoder-decoder era that scaled dot-product attention
replaced: no ``1/sqrt(D)`` scaling, and the additive one is a small feed-forward network per
(query, key) pair rather than one matrix product. Shapes: ``T`` queries (decoder states),
``S`` keys (encoder states), ``A`` the additive hidden width, ``Dq``/``Dk``/``Dv`` the widths
of queries, keys and values, ``...`` leading batch dimensions, which broadcast.

Masks follow :func:`qkv.scaled_dot_product_attention`: boolean True = may attend, float masks
are added to the scores, broadcastable to the scores ``(..., T, S)`` without enlarging them.
A query row with no visible key gets zero weights, a zero context and zero gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "additive_attention",
    "attend",
    "bahdanau_scores",
    "luong_attention",
    "luong_scores",
]

KINDS = ("dot", "general")


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check(name: str, t: object, dim: int, exact: bool = False, dims: str = "") -> Tensor:
    """``t`` as a floating-point tensor with ``dim`` (or, unless ``exact``, more) dimensions."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if exact and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {_shape(t)}")
    if t.dim() < dim:
        raise ValueError(
            f"{name} must have at least {dim} dimensions {dims}, got shape {_shape(t)}"
        )
    return t


def _same(**tensors: Tensor | None) -> None:
    """All given tensors share one dtype and one device."""
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; "
                "all inputs must share one dtype"
            )
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all inputs must be on one device"
            )


def _batch(query: Tensor, keys: Tensor) -> None:
    """The leading (batch) dimensions of ``query`` and ``keys`` broadcast together."""
    try:
        torch.broadcast_shapes(query.shape[:-2], keys.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"the batch dimensions of query {_shape(query)} and keys {_shape(keys)} "
            "(all but the last two) do not broadcast together"
        ) from None


def bahdanau_scores(
    query: Tensor,
    keys: Tensor,
    w_query: Tensor,
    w_key: Tensor,
    v: Tensor,
    b: Tensor | None = None,
) -> Tensor:
    """Additive attention scores ``e[..., t, s] = vᵀ tanh(q_t W_q + k_s W_k + b)``.

    Queries and keys are projected once each, ``(..., T, A)`` and ``(..., S, A)``, and the
    pairs are formed by a broadcast add, so the cost is one ``(..., T, S, A)`` tanh: O(T·S·A)
    memory per batch element (kept for the backward pass), unlike dot-product scores' O(T·S).

    Args:
        query: ``(..., T, Dq)``, e.g. decoder states.
        keys: ``(..., S, Dk)``, e.g. encoder states; batch dimensions broadcast with query's.
        w_query: ``(Dq, A)``. w_key: ``(Dk, A)``. v: ``(A,)``. b: ``None`` or ``(A,)``.

    Returns:
        Scores ``(..., T, S)``.

    Raises:
        TypeError: non-tensors, non-float or mixed dtypes.
        ValueError: too few dimensions, a weight whose shape does not fit the widths ``Dq``,
            ``Dk`` and ``A``, batch dimensions that do not broadcast, mixed devices.
    """
    _check("query", query, 2, dims="(..., T, Dq)")
    _check("keys", keys, 2, dims="(..., S, Dk)")
    _check("w_query", w_query, 2, exact=True)
    _check("w_key", w_key, 2, exact=True)
    _check("v", v, 1, exact=True)
    if b is not None:
        _check("b", b, 1, exact=True)
    _same(query=query, keys=keys, w_query=w_query, w_key=w_key, v=v, b=b)
    Dq, Dk, A = query.shape[-1], keys.shape[-1], w_query.shape[-1]
    if w_query.shape[0] != Dq:
        raise ValueError(
            f"w_query must have shape (Dq, A) with Dq={Dq} (the width of query "
            f"{_shape(query)}), got {_shape(w_query)}"
        )
    if tuple(w_key.shape) != (Dk, A):
        raise ValueError(
            f"w_key must have shape (Dk, A) = ({Dk}, {A}) (Dk from keys {_shape(keys)}, A from "
            f"w_query {_shape(w_query)}), got {_shape(w_key)}"
        )
    for name, t in (("v", v), ("b", b)):
        if t is not None and t.shape[0] != A:
            raise ValueError(
                f"{name} must have shape (A,) = ({A},) (A from w_query {_shape(w_query)}), "
                f"got {_shape(t)}"
            )
    _batch(query, keys)
    # 1) Project each side once; the bias rides on the (usually shorter) query side.
    q = query @ w_query  # (..., T, A)
    if b is not None:
        q = q + b  # (..., T, A)
    k = keys @ w_key  # (..., S, A)
    # 2) Every (query, key) pair by broadcasting: the only O(T·S·A) tensor.
    hidden = torch.tanh(q.unsqueeze(-2) + k.unsqueeze(-3))  # (..., T, S, A)
    # 3) Reduce the hidden width with v.
    return hidden @ v  # (..., T, S)


def luong_scores(
    query: Tensor, keys: Tensor, *, kind: str = "dot", weight: Tensor | None = None
) -> Tensor:
    """Luong's multiplicative scores, without ``1/sqrt(D)`` scaling (as in the paper).

    Args:
        query: ``(..., T, Dq)``.
        keys: ``(..., S, Dk)``; batch dimensions broadcast with query's.
        kind: ``"dot"``: ``e = q·k``, needs ``Dq == Dk`` and no weight. ``"general"``:
            ``e = q W kᵀ`` with ``weight (Dq, Dk)``. (Luong's ``"concat"`` is Bahdanau's
            additive score: use :func:`bahdanau_scores`.)
        weight: ``(Dq, Dk)`` for ``"general"``; must be None for ``"dot"``.

    Returns:
        Scores ``(..., T, S)``.

    Raises:
        TypeError: non-tensors, non-float or mixed dtypes.
        ValueError: unknown ``kind``, ``Dq != Dk`` for ``"dot"``, a missing, unexpected or
            misshapen ``weight``, batch dimensions that do not broadcast, mixed devices.
    """
    if kind not in KINDS:
        raise ValueError(
            f"kind must be one of {KINDS}, got {kind!r} (Luong's 'concat' is Bahdanau's "
            "additive score: use bahdanau_scores)"
        )
    _check("query", query, 2, dims="(..., T, Dq)")
    _check("keys", keys, 2, dims="(..., S, Dk)")
    Dq, Dk = query.shape[-1], keys.shape[-1]
    if kind == "dot":
        if weight is not None:
            raise ValueError("weight is only used by kind='general'; pass weight=None for 'dot'")
        _same(query=query, keys=keys)
        if Dq != Dk:
            raise ValueError(
                f"kind='dot' needs query and keys of equal width, got query {_shape(query)} "
                f"(Dq={Dq}) and keys {_shape(keys)} (Dk={Dk}); use kind='general' for "
                "different widths"
            )
        _batch(query, keys)
        return query @ keys.transpose(-2, -1)  # (..., T, S)
    if weight is None:
        raise ValueError(f"kind='general' needs weight of shape (Dq, Dk) = ({Dq}, {Dk})")
    _check("weight", weight, 2, exact=True)
    _same(query=query, keys=keys, weight=weight)
    if tuple(weight.shape) != (Dq, Dk):
        raise ValueError(
            f"weight must have shape (Dq, Dk) = ({Dq}, {Dk}) (the widths of query "
            f"{_shape(query)} and keys {_shape(keys)}), got {_shape(weight)}"
        )
    _batch(query, keys)
    # Project the queries into key space (T rows, usually fewer than S), then dot.
    q = query @ weight  # (..., T, Dk)
    return q @ keys.transpose(-2, -1)  # (..., T, S)


def _check_mask(mask: object, scores: Tensor) -> Tensor:
    """Validate ``mask`` against ``scores (..., T, S)``; float masks come back in its dtype."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            "mask must be boolean (True = may attend) or floating point (added to the "
            f"scores), got dtype {mask.dtype}"
        )
    if mask.device != scores.device:
        raise ValueError(f"mask is on {mask.device} but scores are on {scores.device}")
    try:
        fits = torch.broadcast_shapes(mask.shape, scores.shape) == scores.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask of shape {_shape(mask)} does not broadcast to the scores (..., T, S) = "
            f"{_shape(scores)} (without enlarging them)"
        )
    if mask.is_floating_point():
        if bool(torch.isnan(mask).any() | torch.isposinf(mask).any()):
            raise ValueError("mask contains NaN or +inf; use -inf to hide a key")
        mask = mask.to(scores.dtype)
    return mask


def attend(
    scores: Tensor, values: Tensor, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Softmax ``scores`` over the keys and take the weighted average of ``values``.

    Args:
        scores: ``(..., T, S)``, from :func:`bahdanau_scores` or :func:`luong_scores`.
        values: ``(..., S, Dv)``; batch dimensions broadcast with the scores'.
        mask: ``None``; a boolean mask, True where a query *may attend*; or a float mask
            added to the scores (``-inf`` hides a key). Broadcastable to ``(..., T, S)``.

    Returns:
        ``(context (..., T, Dv), weights (..., T, S))``. Each weight row sums to 1, except a
        row with no visible key: its weights and context are zero, and so is its gradient.

    Raises:
        TypeError: non-tensors, non-float or mixed dtypes, a mask neither bool nor float.
        ValueError: ``values`` not ``S`` long, batch dimensions that do not broadcast, a mask
            that does not broadcast to the scores or holds NaN or ``+inf``, mixed devices.
    """
    _check("scores", scores, 2, dims="(..., T, S)")
    _check("values", values, 2, dims="(..., S, Dv)")
    _same(scores=scores, values=values)
    if values.shape[-2] != scores.shape[-1]:
        raise ValueError(
            f"values must have S={scores.shape[-1]} rows (dimension -2) like the scores "
            f"{_shape(scores)}, got values {_shape(values)}"
        )
    try:
        torch.broadcast_shapes(scores.shape[:-2], values.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"the batch dimensions of scores {_shape(scores)} and values {_shape(values)} "
            "do not broadcast together"
        ) from None
    # 1) Mask: hidden keys get -inf (weight exactly 0); float masks are added.
    dead = None
    if mask is not None:
        mask = _check_mask(mask, scores)
        if mask.dtype == torch.bool:
            dead = ~mask.any(dim=-1, keepdim=True)  # (..., T|1, 1)
            scores = scores.masked_fill(~mask, float("-inf"))  # (..., T, S)
        else:
            dead = torch.isneginf(mask).all(dim=-1, keepdim=True)  # (..., T|1, 1)
            scores = scores + mask  # (..., T, S)
        # 2) Rows with no visible key: give softmax a finite row (no 0/0 in the forward, no
        #    NaN in the backward) and zero its weights afterwards.
        scores = scores.masked_fill(dead, 0.0)  # (..., T, S)
    # 3) Softmax over the keys; half precision accumulates in float32.
    acc = torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else scores.dtype
    weights = torch.softmax(scores, dim=-1, dtype=acc).to(scores.dtype)  # (..., T, S)
    if dead is not None:
        weights = weights.masked_fill(dead, 0.0)  # (..., T, S)
    # 4) Weighted average of the values.
    return weights @ values, weights  # (..., T, Dv), (..., T, S)


def additive_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    w_query: Tensor,
    w_key: Tensor,
    v: Tensor,
    b: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Bahdanau attention: :func:`bahdanau_scores` then :func:`attend`.

    Args:
        query: ``(..., T, Dq)``. keys: ``(..., S, Dk)``. values: ``(..., S, Dv)``.
        w_query: ``(Dq, A)``. w_key: ``(Dk, A)``. v: ``(A,)``. b: ``None`` or ``(A,)``.
        mask: bool (True = may attend) or float (added), broadcastable to ``(..., T, S)``.

    Returns:
        ``(context (..., T, Dv), weights (..., T, S))``.

    Raises:
        TypeError, ValueError: as :func:`bahdanau_scores` and :func:`attend`.
    """
    scores = bahdanau_scores(query, keys, w_query, w_key, v, b)  # (..., T, S)
    return attend(scores, values, mask)


def luong_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    kind: str,
    weight: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Luong attention: :func:`luong_scores` then :func:`attend`.

    Args:
        query: ``(..., T, Dq)``. keys: ``(..., S, Dk)``. values: ``(..., S, Dv)``.
        kind: ``"dot"`` or ``"general"``. weight: ``(Dq, Dk)`` for ``"general"``.
        mask: bool (True = may attend) or float (added), broadcastable to ``(..., T, S)``.

    Returns:
        ``(context (..., T, Dv), weights (..., T, S))``.

    Raises:
        TypeError, ValueError: as :func:`luong_scores` and :func:`attend`.
    """
    scores = luong_scores(query, keys, kind=kind, weight=weight)  # (..., T, S)
    return attend(scores, values, mask)
