"""qkv: attention and the transformer, end to end, exact, fast and visible.

Shape glossary, used in every docstring and reshape comment:

    B    batch (all leading dimensions)      T    query length
    H    query heads                          S    key / value length
    Hkv  key/value heads (grouped-query)      D    head width (queries and keys)
    E    model width (d_model)                Dv   head width of values
    V    vocabulary size

Tensors inside attention are ``(B, H, T, D)``. Masks follow SDPA polarity (True = may attend)
unless a function says otherwise; see :mod:`qkv.masks`.
"""

import importlib

from qkv import masks  # the public module: attention/masks.py plus the flex mods
from qkv.attention import (
    BlockMask,
    Explanation,
    create_block_mask,
    explain,
    flex_attention,
    scaled_dot_product_attention,
)

__version__ = "0.1.0"

# Subpackages load on first use (``qkv.nn``, ``qkv.inspect``, ...), so ``import qkv`` stays
# light and optional extras are only needed by what is used.
_SUBPACKAGES = (
    "reference", "attention", "nn", "models", "data", "checkpoint", "generate", "train",
    "pretrained", "inspect", "bench", "distributed", "integrations",
)

__all__ = [
    "BlockMask",
    "Explanation",
    "create_block_mask",
    "flex_attention",
    "__version__",
    "explain",
    "masks",
    "scaled_dot_product_attention",
    *_SUBPACKAGES,
]


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"qkv.{name}")
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")
