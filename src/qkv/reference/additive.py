"""Additive (Bahdanau) and multiplicative (Luong) attention in NumPy float64, from the papers.

    Bahdanau et al., 2014 ("concat" in Luong et al., 2015):
        e[t, s] = vᵀ tanh(W [q_t ; k_s] + b),   W = [W_q ; W_k] stacked, shape (Dq + Dk, A)
    Luong et al., 2015:
        dot:      e[t, s] = q_t · k_s
        general:  e[t, s] = q_t W k_sᵀ,         W of shape (Dq, Dk)
    then, for every kind:
        α[t, :] = softmax(e[t, :] + mask),      c_t = Σ_s α[t, s] v_s

The additive score is computed here the way the papers write it, on the *concatenation*
``[q_t ; k_s]`` of every (query, key) pair, not by projecting queries and keys separately as
the torch path does; the two agree only if the torch path's factorisation is right. Masks
follow SDPA polarity: a boolean mask is True where a query *may attend*, a float mask is added
to the scores. A query row with no visible key gets zero weights and a zero context.

Shapes: ``T`` queries, ``S`` keys, ``A`` the additive hidden width, ``Dq``/``Dk``/``Dv`` the
widths of queries, keys and values; ``...`` leading batch dimensions (broadcast).
No torch here: this module is the trusted reference the torch code is tested against.
"""

from __future__ import annotations

import numpy as np

from qkv.reference.softmax import softmax

__all__ = [
    "additive_attention",
    "attend",
    "bahdanau_scores",
    "luong_attention",
    "luong_scores",
]

_KINDS = ("dot", "general")


def _array(name: str, x: object, min_dim: int) -> np.ndarray:
    """``x`` as a float64 array with at least ``min_dim`` dimensions."""
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name} must hold real numbers, got dtype {a.dtype}")
    if a.ndim < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dimension(s), got shape {a.shape}"
        )
    return a.astype(np.float64, copy=False)


def _expect(name: str, a: np.ndarray, shape: tuple[int, ...], meaning: str) -> None:
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {meaning} = {shape}, got {a.shape}")


def bahdanau_scores(query, keys, w_query, w_key, v, b=None) -> np.ndarray:
    """Additive scores ``e[..., t, s] = vᵀ tanh([q_t ; k_s] · [W_q ; W_k] + b)``.

    Args:
        query: ``(..., T, Dq)``. keys: ``(..., S, Dk)``.
        w_query: ``(Dq, A)``. w_key: ``(Dk, A)``. v: ``(A,)``. b: ``None`` or ``(A,)``.

    Returns:
        Float64 scores ``(..., T, S)``.

    Raises:
        ValueError: a weight whose shape does not fit the widths of ``query`` and ``keys``.
    """
    q, k = _array("query", query, 2), _array("keys", keys, 2)
    Dq, Dk = q.shape[-1], k.shape[-1]
    wq = _array("w_query", w_query, 2)
    A = wq.shape[-1]
    _expect("w_query", wq, (Dq, A), "(Dq, A)")
    wk = _array("w_key", w_key, 2)
    _expect("w_key", wk, (Dk, A), "(Dk, A)")
    vv = _array("v", v, 1)
    _expect("v", vv, (A,), "(A,)")
    bias = np.zeros(A) if b is None else _array("b", b, 1)
    _expect("b", bias, (A,), "(A,)")
    T, S = q.shape[-2], k.shape[-2]
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    # 1) Every (query, key) pair, concatenated: the paper's [s_{t-1} ; h_i].
    qq = np.broadcast_to(q[..., :, None, :], (*lead, T, S, Dq))  # (..., T, S, Dq)
    kk = np.broadcast_to(k[..., None, :, :], (*lead, T, S, Dk))  # (..., T, S, Dk)
    pairs = np.concatenate([qq, kk], axis=-1)  # (..., T, S, Dq + Dk)
    # 2) One feed-forward layer on each pair, then the score vector v.
    hidden = np.tanh(pairs @ np.concatenate([wq, wk], axis=0) + bias)  # (..., T, S, A)
    return hidden @ vv  # (..., T, S)


def luong_scores(query, keys, *, kind: str = "dot", weight=None) -> np.ndarray:
    """Luong's multiplicative scores: ``q·k`` (``"dot"``) or ``q W kᵀ`` (``"general"``).

    Args:
        query: ``(..., T, Dq)``. keys: ``(..., S, Dk)``.
        kind: ``"dot"`` (needs ``Dq == Dk``, no weight) or ``"general"`` (``weight (Dq, Dk)``).
            Luong's third kind, ``"concat"``, is Bahdanau's: use :func:`bahdanau_scores`.

    Returns:
        Float64 scores ``(..., T, S)`` (no ``1/sqrt(D)`` scaling, as in the paper).

    Raises:
        ValueError: unknown ``kind``, widths that do not match, a missing or misshapen
            ``weight`` for ``"general"``, or a ``weight`` given for ``"dot"``.
    """
    if kind not in _KINDS:
        raise ValueError(
            f"kind must be one of {_KINDS}, got {kind!r} (Luong's 'concat' is Bahdanau's "
            "additive score: use bahdanau_scores)"
        )
    q, k = _array("query", query, 2), _array("keys", keys, 2)
    Dq, Dk = q.shape[-1], k.shape[-1]
    if kind == "dot":
        if weight is not None:
            raise ValueError("weight is only used by kind='general'; pass weight=None for 'dot'")
        if Dq != Dk:
            raise ValueError(
                f"kind='dot' needs query and keys of equal width, got query {q.shape} "
                f"(Dq={Dq}) and keys {k.shape} (Dk={Dk}); use kind='general' for different widths"
            )
        return q @ np.swapaxes(k, -1, -2)  # (..., T, S)
    if weight is None:
        raise ValueError(f"kind='general' needs weight of shape (Dq, Dk) = ({Dq}, {Dk})")
    w = _array("weight", weight, 2)
    _expect("weight", w, (Dq, Dk), "(Dq, Dk)")
    # Written as a sum over both widths, straight from e = Σ_ij q_i W_ij k_j.
    return np.einsum("...ti,ij,...sj->...ts", q, w, k)  # (..., T, S)


def attend(scores, values, mask=None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax the scores over the keys and average the values.

    Args:
        scores: ``(..., T, S)``. values: ``(..., S, Dv)``.
        mask: ``None``, a boolean array (True = may attend) or a float array added to the
            scores (``-inf`` hides a key), broadcastable to ``(..., T, S)``.

    Returns:
        ``(context (..., T, Dv), weights (..., T, S))`` in float64; rows with no visible key
        are zero in both.

    Raises:
        ValueError: ``values`` of the wrong length, a mask that does not broadcast, or a float
            mask holding NaN or ``+inf``.
    """
    e = _array("scores", scores, 2)
    vals = _array("values", values, 2)
    if vals.shape[-2] != e.shape[-1]:
        raise ValueError(
            f"values must have S={e.shape[-1]} rows (dimension -2) like the scores {e.shape}, "
            f"got values {vals.shape}"
        )
    if mask is not None:
        m = np.asarray(mask)
        try:
            fits = np.broadcast_shapes(m.shape, e.shape) == e.shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"mask of shape {m.shape} does not broadcast to scores {e.shape}")
        if m.dtype == np.bool_:
            e = np.where(m, e, -np.inf)
        else:
            m = _array("mask", m, 0)
            if np.isnan(m).any() or np.isposinf(m).any():
                raise ValueError("mask contains NaN or +inf; use -inf to hide a key")
            e = e + m
    # An all -inf row (no visible key) gives zero weights: the convention of qkv's softmax.
    weights = softmax(e, axis=-1)  # (..., T, S)
    return weights @ vals, weights  # (..., T, Dv), (..., T, S)


def additive_attention(
    query, keys, values, w_query, w_key, v, b=None, mask=None
) -> tuple[np.ndarray, np.ndarray]:
    """Bahdanau attention: :func:`bahdanau_scores`, then :func:`attend`.

    Args:
        query: ``(..., T, Dq)``. keys: ``(..., S, Dk)``. values: ``(..., S, Dv)``.
        w_query: ``(Dq, A)``. w_key: ``(Dk, A)``. v: ``(A,)``. b: ``None`` or ``(A,)``.
        mask: as in :func:`attend`.

    Returns:
        ``(context (..., T, Dv), weights (..., T, S))``, float64.

    Raises:
        ValueError: as :func:`bahdanau_scores` and :func:`attend`.
    """
    return attend(bahdanau_scores(query, keys, w_query, w_key, v, b), values, mask)


def luong_attention(
    query, keys, values, *, kind: str, weight=None, mask=None
) -> tuple[np.ndarray, np.ndarray]:
    """Luong attention: :func:`luong_scores`, then :func:`attend`.

    Args:
        query: ``(..., T, Dq)``. keys: ``(..., S, Dk)``. values: ``(..., S, Dv)``.
        kind: ``"dot"`` or ``"general"``. weight: ``(Dq, Dk)`` for ``"general"``.
        mask: as in :func:`attend`.

    Returns:
        ``(context (..., T, Dv), weights (..., T, S))``, float64.

    Raises:
        ValueError: as :func:`luong_scores` and :func:`attend`.
    """
    return attend(luong_scores(query, keys, kind=kind, weight=weight), values, mask)
