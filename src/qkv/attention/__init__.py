"""The functional attention core on tensors.

``scaled_dot_product_attention`` validates and dispatches to a backend (``backends/``);
``explain`` says which backend runs and why; ``masks`` builds and checks masks; ``additive``
holds Bahdanau and Luong scores.
"""

from qkv.attention import additive, masks
from qkv.attention.dispatch import Explanation
from qkv.attention.sdpa import explain, scaled_dot_product_attention

__all__ = ["Explanation", "additive", "explain", "masks", "scaled_dot_product_attention"]
