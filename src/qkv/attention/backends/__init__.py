"""Attention backends: interchangeable implementations of one :class:`AttentionCall`.

Each backend module exposes ``NAME``, ``why_not(call) -> str | None`` (``None`` when it can
honour the call) and ``run(call) -> (output (B, H, T, Dv), weights (B, H, T, S) | None)``.
Dead rows (no visible key) are zeroed by the caller, not by the backend.
"""

from qkv.attention.backends import flash, math, torch_kernel

__all__ = ["flash", "math", "torch_kernel"]
