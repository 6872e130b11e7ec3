"""``qkv.masks``: attention masks, importable as a module of its own.

The same functions as :mod:`qkv.attention.masks` (where they are defined): builders
(``causal``, ``sliding_window``, ``padding``, ``padding_from_ids``), conversions
(``to_additive``, ``from_mha``, ``to_mha``, ``combine``), the linter (``check``) and the
mask semantics of an attention call (``check_attn_mask``, ``dense_mask``, ...).
Shapes: ``(T, S)`` position masks, ``(B, 1, 1, S)`` padding masks, broadcastable to the
scores ``(B, H, T, S)``.
"""

from qkv.attention.masks import *  # noqa: F403
from qkv.attention.masks import __all__  # noqa: F401
