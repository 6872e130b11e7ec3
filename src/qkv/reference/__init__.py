"""The NumPy float64 reference: the ground truth the torch paths are tested against.

NumPy only, never torch (a test parses every file here to keep it so). Shapes follow the
package glossary: ``H`` query heads, ``Hkv`` key/value heads, ``T`` queries, ``S`` keys,
``D`` head width, ``Dv`` value head width, ``E`` model width.
"""

from qkv.reference.additive import additive_attention, luong_attention
from qkv.reference.attention import attention, attention_backward
from qkv.reference.heads import merge_heads, split_heads
from qkv.reference.softmax import softmax

__all__ = [
    "additive_attention",
    "attention",
    "attention_backward",
    "luong_attention",
    "merge_heads",
    "softmax",
    "split_heads",
]
