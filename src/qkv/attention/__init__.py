"""The functional attention core on tensors.

``scaled_dot_product_attention`` validates and dispatches to a backend (``backends/``);
``explain`` says which backend runs and why; ``run_call`` runs an already validated
:class:`~qkv.attention.call.AttentionCall`; ``masks`` builds masks and defines what each mask
part means; ``errors`` holds the exceptions (both ``ValueError``/``TypeError`` and
``RuntimeError``); ``additive`` holds Bahdanau and Luong scores.
"""

from qkv.attention import additive, masks
from qkv.attention.dispatch import Explanation
from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.sdpa import explain, run_call, scaled_dot_product_attention

__all__ = [
    "AttentionArgumentError",
    "AttentionTypeError",
    "Explanation",
    "additive",
    "explain",
    "masks",
    "run_call",
    "scaled_dot_product_attention",
]
