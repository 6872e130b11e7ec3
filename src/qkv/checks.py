"""Argument guards shared by every layer: ints that are not bools, finite numbers, positive ints.

``True`` is an ``int`` in Python, so ``isinstance(v, int)`` alone lets ``steps=True`` through;
these helpers say "an int, not a bool" once. The module imports nothing from qkv, so any layer
(``data``, ``generate``, ``train``, ``pretrained``, ``cli``) may use it.

:func:`values_unknown` says when a tensor's values cannot be read: checks of token ids or
positions against their ranges (``int(ids.max())``) are skipped then, so ``torch.compile``
with ``fullgraph=True``, ``torch.export``, ONNX export and the meta device trace the models;
shapes and dtypes are still checked, and an eager call checks the values as before.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["is_int", "is_number", "positive_int", "values_unknown"]


def is_int(value: object) -> bool:
    """``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """``value`` is a finite ``int`` or ``float``, and not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def positive_int(name: str, value: object) -> int:
    """``value`` when it is an int >= 1 (not a bool).

    Raises:
        ValueError: ``"<name> must be a positive int, got <value>"``.
    """
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def values_unknown(t: torch.Tensor) -> bool:
    """True when ``t``'s values cannot be read without breaking a trace: under
    ``torch.compile`` / ``torch.export`` tracing, on the meta device, or a fake tensor.

    Value checks (ids in range, a 0/1 mask) are skipped then; everything else is checked.
    """
    return torch.compiler.is_compiling() or t.device.type == "meta" or is_fake(t)
