"""The functional attention core on tensors.

``scaled_dot_product_attention`` validates and dispatches to a backend (``backends/``);
``explain`` says which backend runs and why; ``run_call`` runs an already validated
:class:`~qkv.attention.call.AttentionCall`; ``masks`` builds masks and defines what each mask
part means; ``errors`` holds the exceptions (both ``ValueError``/``TypeError`` and
``RuntimeError``); ``additive`` holds Bahdanau and Luong scores; ``flex_attention`` and
``create_block_mask`` (the ``flex`` sub-package: its entry and ``flex.blocks``) run user score
and mask functions on the blockwise kernel, with ready ones in ``mods``; the ``triton``
sub-package holds the GPU kernels of the triton backend, flex and paged attention.
"""

from qkv.attention import additive, masks, mods, score_mods
from qkv.attention.dispatch import Explanation
from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.flex import flex_attention
from qkv.attention.flex.blocks import BlockMask, and_masks, create_block_mask, noop_mask, or_masks
from qkv.attention.sdpa import explain, run_call, scaled_dot_product_attention

__all__ = [
    "AttentionArgumentError",
    "AttentionTypeError",
    "BlockMask",
    "Explanation",
    "additive",
    "and_masks",
    "create_block_mask",
    "explain",
    "flex_attention",
    "masks",
    "mods",
    "noop_mask",
    "or_masks",
    "run_call",
    "scaled_dot_product_attention",
    "score_mods",
]
