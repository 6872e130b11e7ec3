"""Whether and how Triton runs here: installed or not, and compiled for a GPU or interpreted
on the CPU (``TRITON_INTERPRET=1``, how the test suite runs the triton backend's kernels)."""

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
