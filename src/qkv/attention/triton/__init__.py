"""The Triton kernels of the ``triton`` backend, of block-sparse flex and of paged attention;
this module says whether and how Triton runs here: installed or not, and compiled for a GPU or
interpreted on the CPU (``TRITON_INTERPRET=1``, how the test suite runs the kernels).

Module map: :mod:`~qkv.attention.triton.kernels` (the blockwise forward, key splits for
decoding, their merge), :mod:`~qkv.attention.triton.backward` (FlashAttention-2's two
backward kernels and the row deltas), :mod:`~qkv.attention.triton.flex` (block-sparse
programmable attention), :mod:`~qkv.attention.triton.paged` (attention over a paged KV cache),
:mod:`~qkv.attention.triton.launch` (grids, strides and launches of all of them),
:mod:`~qkv.attention.triton.plan` (tile sizes, key splits and the launch plans kept per
shape), :mod:`~qkv.attention.triton.fast` (a kept kernel launched again without Triton's
per-launch binding). This module imports no ``triton`` (the kernel modules do).

Shapes: ``query (B, H, T, D)``, ``key (B, Hkv, S, D)``, ``value (B, Hkv, S, Dv)``.
"""

from __future__ import annotations

import functools
import os

__all__ = ["installed", "interpreting"]


@functools.cache
def installed() -> bool:
    """Whether the ``triton`` package imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``): CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
