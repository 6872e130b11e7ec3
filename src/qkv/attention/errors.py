"""Exceptions of the attention core, catchable the way torch's own errors are.

torch's ``scaled_dot_product_attention`` raises ``RuntimeError`` for bad arguments, while
Python convention (and qkv's own messages) call them ``ValueError`` and ``TypeError``. The
classes here are both, so ``except RuntimeError`` written against torch and ``except
ValueError`` written against qkv each catch them.
"""

from __future__ import annotations

__all__ = ["AttentionArgumentError", "AttentionTypeError"]


class AttentionArgumentError(ValueError, RuntimeError):
    """A bad argument value (shape, length, head count, mask contents, option)."""


class AttentionTypeError(TypeError, RuntimeError):
    """An argument of the wrong type or dtype (torch raises ``RuntimeError`` for dtypes)."""
