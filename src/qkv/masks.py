"""``qkv.masks``: attention masks, importable as a module of its own.

The same functions as :mod:`qkv.attention.masks` (where they are defined): builders
(``causal``, ``sliding_window``, ``padding``, ``padding_from_ids``), conversions
(``to_additive``, ``from_mha``, ``to_mha``, ``combine``), the linter (``check``) and the
mask semantics of an attention call (``check_attn_mask``, ``dense_mask``, ...); and for
:func:`qkv.flex_attention`, ``and_masks`` / ``or_masks`` / ``noop_mask`` and the ready mods of
:mod:`qkv.attention.mods`.
Shapes: ``(T, S)`` position masks, ``(B, 1, 1, S)`` padding masks, broadcastable to the
scores ``(B, H, T, S)``.
"""

from qkv.attention import masks as _masks
from qkv.attention import mods as _mods
from qkv.attention.flex_blocks import and_masks, noop_mask, or_masks
from qkv.attention.masks import *  # noqa: F403
from qkv.attention.mods import *  # noqa: F403

__all__ = [*_masks.__all__, "and_masks", "noop_mask", "or_masks", *_mods.__all__]
