"""A numerically stable softmax in NumPy float64, the one every reference function uses.

    softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m),   m = max_j x_j

Subtracting the row maximum changes nothing mathematically (the factor ``exp(-m)`` cancels)
but keeps every exponent <= 0, so nothing overflows even for inputs of size 1e4. A row that
is entirely ``-inf`` (a query with no visible key) has no defined softmax; here it gives an
all-zero row, the convention every qkv backend follows, instead of ``0/0 = NaN``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["softmax"]


def _check_array(name: str, x: object) -> np.ndarray:
    """Return ``x`` as float64 after checking it is a real-valued NumPy array."""
    if not isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} must be a numpy.ndarray (convert with np.asarray or tensor.numpy()), "
            f"got {type(x).__name__}"
        )
    if x.dtype.kind not in "fiu":
        raise TypeError(
            f"{name} must hold real numbers (a float or integer dtype), got dtype {x.dtype}"
        )
    return x.astype(np.float64, copy=False)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax of ``x`` along ``axis``, in float64.

    Args:
        x: any shape, real dtype; entries may be ``-inf`` (hidden), never NaN or ``+inf``.
        axis: the axis to normalise over (``-1``: the last, i.e. the keys ``S`` of scores
            ``(..., T, S)``).

    Returns:
        Float64 array of ``x``'s shape; every slice along ``axis`` is non-negative and sums
        to 1, except slices that are entirely ``-inf`` (or empty), which are all zeros.

    Raises:
        TypeError: ``x`` is not a NumPy array of real numbers, or ``axis`` is not an int.
        ValueError: ``axis`` is out of range for ``x``, or ``x`` holds NaN or ``+inf``.
    """
    x = _check_array("x", x)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"axis {axis} is out of range for x of shape {x.shape} ({x.ndim} dimensions)"
        )
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError(
            "x contains NaN or +inf, whose softmax is undefined; use -inf to hide an entry"
        )
    if x.shape[axis] == 0:
        return np.zeros_like(x)
    # 1) Shift by the maximum so every exponent is <= 0; an all -inf slice shifts by 0
    #    instead, so exp gives exact zeros there rather than exp(-inf - -inf) = NaN.
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(x - m)
    # 2) Normalise; a slice summing to 0 is all -inf and stays all zeros.
    total = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(total == 0.0, 1.0, total)
