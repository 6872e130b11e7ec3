"""Multi-head layout in NumPy: split the model width into heads, and merge them back.

Multi-head attention (Vaswani et al., 2017, section 3.2) runs ``H`` attentions side by side on
slices of width ``D = E / H`` of the projected inputs. Head ``h`` owns the columns
``h·D .. (h+1)·D - 1`` of the width ``E``: the layout of ``torch.nn.MultiheadAttention`` and
of GPT-style models, where ``x.view(B, T, H, D).transpose(1, 2)`` splits the heads.
These are pure layout changes: values and dtype are kept, only the axes move.
"""

from __future__ import annotations

import numpy as np

__all__ = ["merge_heads", "split_heads"]


def _check_array(name: str, x: object, min_dims: int, layout: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} must be a numpy.ndarray (convert with np.asarray or tensor.numpy()), "
            f"got {type(x).__name__}"
        )
    if x.ndim < min_dims:
        raise ValueError(
            f"{name} must have at least {min_dims} dimensions {layout}, got shape {x.shape}"
        )
    return x


def split_heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """Split the last dimension into heads: ``(..., T, E) -> (..., H, T, E/H)``.

    Args:
        x: ``(..., T, E)``; any number of leading dimensions, any dtype.
        num_heads: ``H``, a positive int dividing ``E``.

    Returns:
        ``(..., H, T, D)`` with ``D = E / H``; head ``h`` holds columns ``h·D .. (h+1)·D - 1``.

    Raises:
        TypeError: ``x`` is not a NumPy array, or ``num_heads`` is not an int.
        ValueError: ``x`` has fewer than 2 dimensions, ``num_heads < 1``, or ``E`` is not a
            multiple of ``num_heads``.
    """
    x = _check_array("x", x, 2, "(..., T, E)")
    if not isinstance(num_heads, (int, np.integer)) or isinstance(num_heads, bool):
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be at least 1, got {num_heads}")
    *lead, T, E = x.shape
    if E % num_heads != 0:
        raise ValueError(
            f"the width E={E} of x {x.shape} (last dimension) must be a multiple of "
            f"num_heads={num_heads}"
        )
    D = E // num_heads
    x = x.reshape(*lead, T, num_heads, D)  # (..., T, H, D)
    return np.swapaxes(x, -3, -2)  # (..., H, T, D)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """Concatenate the heads back into one width: ``(..., H, T, D) -> (..., T, H·D)``.

    The inverse of :func:`split_heads`: ``merge_heads(split_heads(x, H))`` equals ``x``.

    Args:
        x: ``(..., H, T, D)``; any number of leading dimensions, any dtype.

    Returns:
        ``(..., T, H·D)``; head ``h`` fills columns ``h·D .. (h+1)·D - 1``.

    Raises:
        TypeError: ``x`` is not a NumPy array.
        ValueError: ``x`` has fewer than 3 dimensions.
    """
    x = _check_array("x", x, 3, "(..., H, T, D)")
    *lead, H, T, D = x.shape
    x = np.swapaxes(x, -3, -2)  # (..., T, H, D)
    return x.reshape(*lead, T, H * D)  # (..., T, H·D)
