"""``qkv.masks``: attention masks for users, importable as a module of its own.

Builders (``causal``, ``sliding_window``, ``padding``, ``padding_from_ids``), conversions
(``to_additive``, ``from_mha``, ``to_mha``, ``combine``) and the linter (``check``,
``MaskReport``), defined in :mod:`qkv.attention.masks`; and for :func:`qkv.flex_attention`,
``and_masks`` / ``or_masks`` / ``noop_mask`` and the ready mods of :mod:`qkv.attention.mods`
(``causal_mask``, ``sliding_window_mask``, ``document_mask``, ``prefix_lm``, ``padding_mask``,
``dilated``, ``alibi``, ``relative_bias``, ``soft_cap``, ...).
Shapes: ``(T, S)`` position masks, ``(B, 1, 1, S)`` padding masks, broadcastable to the
scores ``(B, H, T, S)``.

What a mask means inside a call, and the kernels' helpers (dead rows, the softmax's edge
rows, per-tile masks), stay in :mod:`qkv.attention.masks`: they are not part of this name.
"""

from qkv.attention import mask_builders as _builders
from qkv.attention import mask_lint as _lint
from qkv.attention import mods as _mods
from qkv.attention.flex.blocks import and_masks, noop_mask, or_masks
from qkv.attention.mask_builders import *  # noqa: F403
from qkv.attention.mask_lint import *  # noqa: F403
from qkv.attention.mods import *  # noqa: F403

__all__ = [*_builders.__all__, *_lint.__all__, "and_masks", "noop_mask", "or_masks",
           *_mods.__all__]
