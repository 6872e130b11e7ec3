"""Argument guards shared by every layer: ints that are not bools, finite numbers, positive ints.

``True`` is an ``int`` in Python, so ``isinstance(v, int)`` alone lets ``steps=True`` through;
these helpers say "an int, not a bool" once. The module imports nothing from qkv, so any layer
(``data``, ``generate``, ``train``, ``pretrained``, ``cli``) may use it.
"""

from __future__ import annotations

import math

__all__ = ["is_int", "is_number", "positive_int"]


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
