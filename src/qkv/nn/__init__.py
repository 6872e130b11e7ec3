"""Modules: each owns its parameters, projections and conventions; every attention module is
an :class:`AttentionCore` (hook points, the kernel call, weights on request, written once)."""

from qkv.nn.additive import BahdanauAttention, LuongAttention
from qkv.nn.alibi import ALiBi, alibi_bias, alibi_slopes
from qkv.nn.attention import Attention
from qkv.nn.block import TransformerBlock
from qkv.nn.cache import KVCache, LayerKVCache
from qkv.nn.convert import from_torch, to_torch
from qkv.nn.core import AttentionCore
from qkv.nn.errors import DropInArgumentError, DropInTypeError
from qkv.nn.feedforward import FeedForward, GeGLU, SwiGLU, make_feedforward
from qkv.nn.heads import AttentionHead, HeadList, SelfAttention
from qkv.nn.multihead import MultiheadAttention
from qkv.nn.norms import make_norm
from qkv.nn.options import AttentionOptions
from qkv.nn.positions import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    sinusoidal_table,
)
from qkv.nn.relative_bias import RelativePositionBias
from qkv.nn.rope import RotaryEmbedding, apply_rotary, rotary_cos_sin, rotate_half
from qkv.nn.rope_scaling import RopeScaling
from qkv.nn.transformer import (
    Transformer,
    TransformerDecoder,
    TransformerEncoder,
    generate_square_subsequent_mask,
)
from qkv.nn.transformer_layers import TransformerDecoderLayer, TransformerEncoderLayer

__all__ = [
    "ALiBi",
    "Attention",
    "AttentionCore",
    "AttentionHead",
    "AttentionOptions",
    "BahdanauAttention",
    "DropInArgumentError",
    "DropInTypeError",
    "FeedForward",
    "GeGLU",
    "HeadList",
    "KVCache",
    "LayerKVCache",
    "LearnedPositionalEmbedding",
    "LuongAttention",
    "MultiheadAttention",
    "RelativePositionBias",
    "RopeScaling",
    "RotaryEmbedding",
    "SelfAttention",
    "SinusoidalPositionalEncoding",
    "SwiGLU",
    "Transformer",
    "TransformerBlock",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "alibi_bias",
    "alibi_slopes",
    "apply_rotary",
    "from_torch",
    "generate_square_subsequent_mask",
    "make_feedforward",
    "make_norm",
    "rotary_cos_sin",
    "rotate_half",
    "sinusoidal_table",
    "to_torch",
]
