"""Scaled dot-product attention in NumPy float64, forward and backward written out by hand.

    S = scale · Q·Kᵀ + mask,   W = softmax(S),   O = W·V          (Vaswani et al., 2017)

This is the ground truth the torch paths are tested against (DESIGN.md, contract 4): every
step is one line of NumPy in float64, and the gradients come from the chain rule on paper,
not from autograd:

    dV = Wᵀ·dO      dW = dO·Vᵀ      dS = W ⊙ (dW − rowsum(dW ⊙ W))
    dQ = scale · dS·K               dK = scale · dSᵀ·Q

The semantics are those of ``qkv.scaled_dot_product_attention`` (and torch's): a boolean mask
keeps the keys where it is True, a float mask is added to the scores, ``is_causal`` lets query
``i`` see keys ``j <= i`` (top-left), and query head ``h`` reads key/value head
``h // (H / Hkv)`` (grouped-query attention). A query row with no visible key gets zero
output, zero weights and zero gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import numpy as np

from qkv.reference.softmax import softmax

__all__ = ["attention", "attention_backward"]


@dataclass(frozen=True)
class _Prepared:
    """One validated call; key and value already repeated to one head per query head."""

    q: np.ndarray  # (..., H, T, D) float64
    k: np.ndarray  # (..., H, S, D) float64, kv head h // G repeated for query head h
    v: np.ndarray  # (..., H, S, Dv) float64
    scores: np.ndarray  # (..., H, T, S): scale·Q·Kᵀ + mask, -inf where hidden
    scale: float
    groups: int  # G = H / Hkv query heads per key/value head
    squeeze: bool  # the inputs were 2-D (T, D): drop the head axis on the way out


def _check_array(name: str, x: object) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} must be a numpy.ndarray (convert with np.asarray or tensor.numpy()), "
            f"got {type(x).__name__}"
        )
    if x.dtype.kind not in "fiu":
        raise TypeError(f"{name} must hold real numbers (float or integer), got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., T, D), got shape {x.shape}")
    x = x.astype(np.float64, copy=False)
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf; attention of it is undefined")
    return x


def _check_inputs(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    shapes = f"query {q.shape}, key {k.shape}, value {v.shape}"
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"query, key and value must have the same number of dimensions, got {shapes}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query and key must have the same head width D (last dimension), got query "
            f"{q.shape} with D={q.shape[-1]} and key {k.shape} with D={k.shape[-1]}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"key and value must have the same length S (dimension -2), got key {k.shape} "
            f"with S={k.shape[-2]} and value {v.shape} with S={v.shape[-2]}"
        )
    if q.ndim == 2:
        return
    H, Hk, Hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if Hk != Hv:
        raise ValueError(
            f"key and value must have the same number of heads Hkv (dimension -3), got key "
            f"{k.shape} with {Hk} and value {v.shape} with {Hv}"
        )
    if Hk == 0 or H % Hk != 0:
        raise ValueError(
            f"query heads H={H} must be a multiple of key/value heads Hkv={Hk} (dimension -3) "
            f"for grouped-query attention; got {shapes}"
        )
    if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        raise ValueError(
            f"query, key and value must have the same leading (batch) dimensions, got {shapes}"
        )


def _check_mask(mask: object, full: tuple[int, ...]) -> np.ndarray:
    """Return ``mask`` (bool, or float64 without NaN/+inf) after checking it fits ``full``."""
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"mask must be a numpy.ndarray or None, got {type(mask).__name__}")
    if mask.dtype != np.bool_ and mask.dtype.kind != "f":
        raise TypeError(
            "mask must be boolean (True = may attend) or floating point (added to the scores), "
            f"got dtype {mask.dtype}"
        )
    if mask.ndim > len(full):
        raise ValueError(
            f"mask has shape {mask.shape} with {mask.ndim} dimensions, more than the attention "
            f"scores {full} it must broadcast to"
        )
    try:
        grown = np.broadcast_shapes(mask.shape, full)
    except ValueError:
        raise ValueError(
            f"mask of shape {mask.shape} does not broadcast to the attention scores "
            f"(..., H, T, S) = {full}"
        ) from None
    if grown != full:
        raise ValueError(f"mask of shape {mask.shape} would enlarge the attention scores {full}")
    if mask.dtype == np.bool_:
        return mask
    mask = mask.astype(np.float64, copy=False)
    if np.isnan(mask).any() or np.isposinf(mask).any():
        raise ValueError("mask contains NaN or +inf; use -inf to hide a key")
    return mask


def _prepare(query, key, value, mask, is_causal, scale) -> _Prepared:
    q, k, v = (_check_array(n, x) for n, x in (("query", query), ("key", key), ("value", value)))
    _check_inputs(q, k, v)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is not None and (
        not isinstance(scale, Real) or isinstance(scale, bool) or not math.isfinite(scale)
    ):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")

    # 1) One head axis everywhere: 2-D (T, D) inputs become a single head.
    squeeze = q.ndim == 2
    if squeeze:
        q, k, v = q[None], k[None], v[None]  # (1, T, D), (1, S, D), (1, S, Dv)
    H, T, D = q.shape[-3:]
    S = k.shape[-2]
    G = H // k.shape[-3]
    full = (*q.shape[:-3], H, T, S) if not squeeze else (T, S)
    if mask is not None:
        mask = _check_mask(mask, full)
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0

    # 2) Grouped-query attention: query head h reads kv head h // G, which is exactly the
    #    order np.repeat lays the copies out in.
    k = np.repeat(k, G, axis=-3)  # (..., H, S, D)
    v = np.repeat(v, G, axis=-3)  # (..., H, S, Dv)

    # 3) Scaled scores, then the mask: floats are added, booleans and causality hide keys.
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # (..., H, T, S)
    keep = None
    if mask is not None and mask.dtype == np.bool_:
        keep = mask
    elif mask is not None:
        scores = scores + mask  # (..., H, T, S)
    if is_causal:
        causal = np.tri(T, S, dtype=bool)  # (T, S): query i sees keys j <= i
        keep = causal if keep is None else keep & causal
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)  # (..., H, T, S)
    return _Prepared(q, k, v, scores, float(scale), G, squeeze)


def _group_sum(x: np.ndarray, groups: int) -> np.ndarray:
    """Sum the gradients of the ``G`` query heads that share one key/value head."""
    *lead, H, S, D = x.shape
    return x.reshape(*lead, H // groups, groups, S, D).sum(axis=-3)  # (..., Hkv, S, D)


def attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention, in float64.

    Args:
        query: ``(..., H, T, D)``, any number of leading batch dimensions, or ``(T, D)``.
        key: ``(..., Hkv, S, D)`` (or ``(S, D)``); ``H`` must be a multiple of ``Hkv``.
        value: ``(..., Hkv, S, Dv)`` (or ``(S, Dv)``).
        mask: ``None``; a boolean keep mask (True = may attend); or a float mask added to the
            scores (``-inf`` hides a key). Broadcastable to ``(..., H, T, S)`` without
            enlarging it (``(T, S)`` for 2-D inputs).
        is_causal: query ``i`` sees only keys ``j <= i`` (top-left, as torch); combined with
            ``mask`` by logical and.
        scale: factor on ``q·k``; ``1/sqrt(D)`` when None.

    Returns:
        ``(out, weights)``: float64 ``(..., H, T, Dv)`` and ``(..., H, T, S)`` (``(T, Dv)`` and
        ``(T, S)`` for 2-D inputs). A query row with no visible key has zero output and zero
        weights.

    Raises:
        TypeError: a non-array or non-real input, a mask neither bool nor float, a non-bool
            ``is_causal``.
        ValueError: ranks, widths, lengths or head counts that do not fit, non-finite inputs,
            a mask that does not broadcast or holds NaN/+inf, a non-finite ``scale``.
    """
    p = _prepare(query, key, value, mask, is_causal, scale)
    weights = softmax(p.scores, axis=-1)  # (..., H, T, S); dead rows are all zero
    out = weights @ p.v  # (..., H, T, Dv)
    if p.squeeze:
        return out[0], weights[0]  # (T, Dv), (T, S)
    return out, weights


def attention_backward(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    grad_out: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``sum(attention(query, key, value, ...)[0] * grad_out)``, by hand.

    Args:
        query, key, value, mask, is_causal, scale: as in :func:`attention`.
        grad_out: ``dO``, the gradient of the loss with respect to the output, shaped like the
            output ``(..., H, T, Dv)`` (``(T, Dv)`` for 2-D inputs).

    Returns:
        ``(dq, dk, dv)`` in float64, shaped like ``query``, ``key`` and ``value``. Key/value
        heads shared by ``G`` query heads receive the sum of their ``G`` gradients. Dead rows
        (no visible key) contribute nothing. The mask gets no gradient.

    Raises:
        TypeError, ValueError: as :func:`attention`, and ``grad_out`` that is not a finite
            real array shaped like the output.
    """
    p = _prepare(query, key, value, mask, is_causal, scale)
    d_out = _check_array("grad_out", grad_out)
    if p.squeeze:
        d_out = d_out[None]  # (1, T, Dv)
    expected = (*p.q.shape[:-1], p.v.shape[-1])
    if d_out.shape != expected:
        shown = expected[1:] if p.squeeze else expected
        raise ValueError(
            f"grad_out must have the shape of the output (..., H, T, Dv) = {shown}, got "
            f"{np.shape(grad_out)}"
        )
    # 1) Forward again: the weights are all the backward needs.
    w = softmax(p.scores, axis=-1)  # (..., H, T, S)
    # 2) O = W·V, so dV = Wᵀ·dO and dW = dO·Vᵀ.
    dv = np.swapaxes(w, -1, -2) @ d_out  # (..., H, S, Dv)
    dw = d_out @ np.swapaxes(p.v, -1, -2)  # (..., H, T, S)
    # 3) Softmax backward: the Jacobian diag(w) − w·wᵀ applied row by row. Dead rows have
    #    w = 0, so their dS is 0 and they contribute nothing below.
    ds = w * (dw - np.sum(dw * w, axis=-1, keepdims=True))  # (..., H, T, S)
    # 4) S = scale·Q·Kᵀ (the mask is a constant).
    dq = p.scale * (ds @ p.k)  # (..., H, T, D)
    dk = p.scale * (np.swapaxes(ds, -1, -2) @ p.q)  # (..., H, S, D)
    # 5) Grouped-query attention: a kv head collects the gradients of its G query heads.
    dk = _group_sum(dk, p.groups)  # (..., Hkv, S, D)
    dv = _group_sum(dv, p.groups)  # (..., Hkv, S, Dv)
    if p.squeeze:
        return dq[0], dk[0], dv[0]  # (T, D), (S, D), (S, Dv)
    return dq, dk, dv
