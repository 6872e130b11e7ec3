"""Errors of the torch drop-ins, catchable the way torch's own are.

``torch.nn.MultiheadAttention`` and the transformer modules report bad arguments with
``assert`` (``AssertionError``) or ``RuntimeError`` depending on the check, while qkv's
messages are ``ValueError``/``TypeError`` by Python's convention. The drop-ins raise the classes
below, which are all of these at once: code written ``except AssertionError`` (or
``RuntimeError``) against torch keeps working, and so does ``except ValueError``. The messages
are qkv's: they name the argument, what was received and what was expected.
"""

from __future__ import annotations

__all__ = ["DropInArgumentError", "DropInTypeError"]


class DropInArgumentError(ValueError, AssertionError, RuntimeError):
    """A drop-in's argument has a bad value or shape."""


class DropInTypeError(TypeError, AssertionError, RuntimeError):
    """A drop-in's argument has the wrong type or dtype."""
