"""Decoder-only language model: GPT-2 style and Llama style as two configurations of one class.

    h_0 = embed(ids) (+ positions)
    h_l = block_l(h_{l-1})            causal self-attention + feed-forward, l = 1..L
    logits = lm_head(norm_f(h_L))     (norm_f only with pre-norm)

GPT-2 (Radford et al., 2019): learned positions, LayerNorm, GELU (tanh), pre-norm, biases.
Llama (Touvron et al., 2023): RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases. The
difference is entirely in :class:`DecoderLMConfig`; the model is assembled from the same parts
(:class:`~qkv.nn.TransformerBlock`, :func:`~qkv.models.parts.make_positions`, ``make_norm``).

Today's decoders are configurations too, through generic options: a sliding window on every
layer (``window``: Mistral) or per layer (``layer_windows``: Gemma 2 alternates local and
global layers), with a rolling KV cache (:meth:`DecoderLM.new_cache`); q/k/v biases
(``qkv_bias``: Qwen2); per-head query/key norms (``qk_norm``: Qwen3); soft-capped attention
scores and logits (``attn_softcap``, ``logit_softcap``), a score scale (``attn_scale``), an
embedding multiplier (``embed_scale``) and sublayer-output norms (``sandwich_norm``: Gemma 2);
RoPE scaling (``rope_scaling``: Llama 3, linear, dynamic NTK, YaRN) and partial rotary
(``rope_dim``: Phi).

Padding: batches of prompts are left-padded for generation; pass ``attention_mask`` (1 = real
token) over every cached and new position and ``positions`` counting only real tokens, and each
row computes what it computes alone.

Packed rows: ``document_ids (B, T)`` says which document each position belongs to; attention
then never crosses documents (a document block mask AND causal, on the blockwise flex kernel)
and positions restart at 0 in each document (learned, sinusoidal, RoPE; ALiBi distances are
only ever measured inside a document). Each document computes what it computes alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.mask_builders import combine
from qkv.models.config import ACTIVATIONS, NORM_KINDS, NORM_PLACEMENTS, POSITIONS, ConfigBase
from qkv.models.parts import (
    ModelBase,
    add_positions,
    check_cache,
    check_ids,
    check_length,
    check_positions,
    init_gpt_style,
    make_positions,
    new_static_cache,
    packed_inputs,
    padding_keep_mask,
)
from qkv.nn.block import TransformerBlock
from qkv.nn.cache import KVCache
from qkv.nn.dropout import Dropout
from qkv.nn.norms import make_norm
from qkv.nn.rope_scaling import RopeScaling
from qkv.nn.static_cache import StaticKVCache

__all__ = ["DecoderLM", "DecoderLMConfig"]



@dataclass(frozen=True)
class DecoderLMConfig(ConfigBase):
    """Configuration of a :class:`DecoderLM`.

    Attributes:
        vocab_size: ``V``, tokens ``0 .. V-1``.
        d_model: model width ``E``.
        num_layers: transformer blocks.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` (grouped-query attention); None = ``H``.
        d_head: head width ``D``; None = ``E / H``.
        d_ff: feed-forward hidden width; None = ``4·E``, or for ``"swiglu"`` ``8/3·E`` rounded
            up to a multiple of 8 (the same parameter count as a ``4·E`` MLP).
        max_len: longest sequence (a hard limit only for learned positions).
        dropout: on embeddings, attention weights, feed-forward hidden and residual branches.
        norm: ``"pre"`` (GPT-2, Llama) or ``"post"``.
        norm_kind: ``"layernorm"`` or ``"rmsnorm"``.
        norm_eps: epsilon of every norm.
        activation: ``"gelu"``, ``"gelu_tanh"`` (GPT-2), ``"relu"``, ``"silu"``, ``"swiglu"``
            (Llama), ``"geglu"`` (Gemma).
        positions: ``"learned"``, ``"rope"``, ``"alibi"``, ``"sinusoidal"`` or None.
        rope_base: RoPE frequency base (10000; Llama 3 500000).
        bias: biases in every Linear (except ``lm_head``) and LayerNorm.
        tie_embeddings: ``lm_head.weight`` is ``embed.weight`` (one tensor).
        pad_id, bos_id, eos_id: special token ids (None or in ``[0, V)``), for generation.
        attn_scale: factor on ``q·k`` (None: ``1/sqrt(D)``; Gemma 2 ``query_pre_attn_scalar
            ** -0.5``).
        qkv_bias, k_bias, out_bias: per-projection attention bias overrides (None: follow
            ``bias``; Qwen2: ``qkv_bias=True`` with ``bias=False``).
        qk_norm: None, ``"rmsnorm"`` or ``"layernorm"`` over each query/key head (Qwen3).
        window: sliding causal window of every layer (Mistral), or None.
        layer_windows: one window (or None: full attention) per layer (Gemma 2's alternating
            local/global layers), or None; not together with ``window``. A JSON list is
            stored as a tuple.
        attn_softcap: ``cap·tanh(score/cap)`` on the attention scores (Gemma 2: 50), or None.
        logit_softcap: ``cap·tanh(logit/cap)`` on the output logits (Gemma 2: 30), or None.
        embed_scale: the embeddings are multiplied by it (Gemma: ``sqrt(E)``).
        sandwich_norm: pre-norm blocks also normalise each sublayer's output (Gemma 2).
        rope_scaling: None or a :class:`~qkv.nn.rope_scaling.RopeScaling` as a dict
            (``{"kind": "llama3", "factor": 8.0, "original_max_len": 8192, ...}``).
        rope_dim: columns of each head RoPE rotates (None: all; partial rotary).
        relative_buckets, relative_max_distance: with ``positions="relative"``, T5's bucketed
            relative bias (causal buckets; one bias per head, shared by every layer, added to
            the scores): buckets in all and the offset from which every key shares the last.
    """

    vocab_size: int
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    d_head: int | None = None
    d_ff: int | None = None
    max_len: int = 1024
    dropout: float = 0.0
    norm: str = "pre"
    norm_kind: str = "layernorm"
    norm_eps: float = 1e-5
    activation: str = "gelu"
    positions: str | None = "learned"
    rope_base: float = 10000.0
    bias: bool = True
    tie_embeddings: bool = True
    pad_id: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    attn_scale: float | None = None
    qkv_bias: bool | None = None
    k_bias: bool | None = None
    out_bias: bool | None = None
    qk_norm: str | None = None
    window: int | None = None
    layer_windows: tuple[int | None, ...] | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    embed_scale: float = 1.0
    sandwich_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    rope_dim: int | None = None
    relative_buckets: int = 32
    relative_max_distance: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_len"):
            self._int(name)
        for name in ("num_kv_heads", "d_head", "d_ff"):
            self._int(name, optional=True)
        self._heads(self.d_model, self.num_heads, self.num_kv_heads, self.d_head)
        self._float("dropout", low=0.0, high=1.0)
        self._float("norm_eps", low=0.0)
        self._float("rope_base", low=0.0)
        self._choice("norm", NORM_PLACEMENTS)
        self._choice("norm_kind", NORM_KINDS)
        self._choice("activation", ACTIVATIONS)
        self._choice("positions", POSITIONS)
        self._relative()
        if self.rope_dim is None:
            self._rope_even(self.positions, self.head_dim)
        for name in ("bias", "tie_embeddings"):
            self._flag(name)
        for name in ("pad_id", "bos_id", "eos_id"):
            self._token(name, self.vocab_size)
        self._check_options()

    def _check_options(self) -> None:
        """The options of today's decoders (see the class docstring)."""
        for name in ("attn_scale", "attn_softcap", "logit_softcap"):
            if getattr(self, name) is not None:
                self._float(name, low=0.0)
        self._float("embed_scale", low=0.0)
        for name in ("qkv_bias", "k_bias", "out_bias"):
            if getattr(self, name) is not None:
                self._flag(name)
        self._choice("qk_norm", (*NORM_KINDS, None))
        self._int("window", optional=True)
        self._flag("sandwich_norm")
        if self.sandwich_norm and self.norm != "pre":
            self._fail("sandwich_norm", "False with norm='post'", self.sandwich_norm)
        if self.layer_windows is not None:
            windows = self.layer_windows
            ok = isinstance(windows, (list, tuple)) and len(windows) == self.num_layers
            if not ok or not all(w is None or (isinstance(w, int) and not isinstance(w, bool)
                                               and w >= 1) for w in windows):  # fmt: skip
                self._fail("layer_windows", f"a sequence of {self.num_layers} entries (one per "
                           "layer), each None or a positive int", windows)  # fmt: skip
            if self.window is not None:
                self._fail("layer_windows", "None when window is set (give one or the other)",
                           windows)  # fmt: skip
            object.__setattr__(self, "layer_windows", tuple(windows))
        rope_options = self.rope_scaling is not None or self.rope_dim is not None
        if rope_options and self.positions != "rope":
            self._fail("positions", "'rope' when rope_scaling or rope_dim is set",
                       self.positions)  # fmt: skip
        if self.rope_scaling is not None:
            try:
                scaling = RopeScaling.from_dict(self.rope_scaling)
            except (TypeError, ValueError) as err:
                raise ValueError(f"DecoderLMConfig.rope_scaling: {err}") from None
            object.__setattr__(self, "rope_scaling", scaling.to_dict())
        if self.rope_dim is not None:
            self._int("rope_dim", minimum=2)
            if self.rope_dim % 2 or self.rope_dim > self.head_dim:
                self._fail("rope_dim", f"None or an even int <= the head width {self.head_dim}",
                           self.rope_dim)  # fmt: skip

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer (None: full causal attention)."""
        if self.layer_windows is not None:
            return tuple(self.layer_windows)
        return (self.window,) * self.num_layers

    @property
    def head_dim(self) -> int:
        """Head width ``D`` (``d_head``, or ``d_model // num_heads``)."""
        return self.d_head if self.d_head is not None else self.d_model // self.num_heads

    @property
    def ffn_dim(self) -> int:
        """Feed-forward hidden width (``d_ff`` or its default)."""
        if self.d_ff is not None:
            return self.d_ff
        if self.activation in ("swiglu", "geglu"):
            hidden = (8 * self.d_model + 2) // 3  # ceil(8E/3)
            return (hidden + 7) // 8 * 8  # rounded up to a multiple of 8
        return 4 * self.d_model

    @classmethod
    def gpt2_style(cls, vocab_size: int, **overrides: Any) -> DecoderLMConfig:
        """GPT-2: learned positions, LayerNorm, tanh-GELU, pre-norm, biases, tied embeddings."""
        base: dict[str, Any] = dict(
            positions="learned", norm_kind="layernorm", activation="gelu_tanh", norm="pre",
            bias=True, tie_embeddings=True,
        )
        return cls(vocab_size, **{**base, **overrides})

    @classmethod
    def llama_style(cls, vocab_size: int, **overrides: Any) -> DecoderLMConfig:
        """Llama: RoPE, RMSNorm, SwiGLU, pre-norm, no biases, tied embeddings; GQA by
        ``num_kv_heads``."""
        base: dict[str, Any] = dict(
            positions="rope", norm_kind="rmsnorm", activation="swiglu", norm="pre",
            bias=False, tie_embeddings=True,
        )
        return cls(vocab_size, **{**base, **overrides})


class DecoderLM(ModelBase):
    """Decoder-only transformer language model (causal), with a KV cache for generation.

    Args:
        config: a :class:`DecoderLMConfig`.

    Submodules: ``embed`` (``nn.Embedding(V, E)``), ``pos`` (positions added to the
    embeddings: ``LearnedPositionalEmbedding`` or ``SinusoidalPositionalEncoding``; None for
    RoPE, which lives in ``blocks[i].self_attn.rope``, for ALiBi and for no positions),
    ``drop`` (embedding dropout), ``blocks`` (``nn.ModuleList`` of
    :class:`~qkv.nn.TransformerBlock`), ``norm_f`` (final norm; None with post-norm),
    ``lm_head`` (``nn.Linear(E, V, bias=False)``, its weight *is* ``embed.weight`` when
    ``tie_embeddings``).

    Raises:
        TypeError: ``config`` is not a :class:`DecoderLMConfig`.
    """

    def __init__(self, config: DecoderLMConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderLMConfig):
            raise TypeError(f"config must be a DecoderLMConfig, got {type(config).__name__}")
        self.config = c = config
        parts = make_positions(
            c.positions, d_model=c.d_model, d_head=c.head_dim, max_len=c.max_len,
            rope_base=c.rope_base, rope_dim=c.rope_dim, num_heads=c.num_heads,
            relative_buckets=c.relative_buckets, relative_max_distance=c.relative_max_distance,
            rope_scaling=None if c.rope_scaling is None else RopeScaling.from_dict(c.rope_scaling),
        )
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = parts.added
        self.position_limit = parts.limit  # learned table size; None: any position works
        self.rel_bias = parts.bias  # T5's relative bias (positions="relative"), else None
        self.drop = Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                c.d_model, c.num_heads, c.ffn_dim, num_kv_heads=c.num_kv_heads,
                d_head=c.d_head, dropout=c.dropout, activation=c.activation, norm=c.norm,
                norm_kind=c.norm_kind, norm_eps=c.norm_eps, bias=c.bias, scale=c.attn_scale,
                qkv_bias=c.qkv_bias, k_bias=c.k_bias, out_bias=c.out_bias, qk_norm=c.qk_norm,
                window=window, softcap=c.attn_softcap, sandwich_norm=c.sandwich_norm,
                **parts.attention,
            )
            for window in c.windows
        )
        # Pre-norm leaves the residual stream unnormalised, so one last norm precedes the head.
        self.norm_f = (
            make_norm(c.norm_kind, c.d_model, eps=c.norm_eps, bias=c.bias)
            if c.norm == "pre" else None
        )
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        init_gpt_style(self, c.num_layers)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_cache(self, batch_size: int | None = None, max_len: int | None = None, *,
                  rolling: bool = True, static: bool = False, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache | StaticKVCache:  # fmt: skip
        """An empty cache with one layer per block.

        Args:
            batch_size: rows ``B`` (needed with ``static``; otherwise buffers take the batch
                size of the first step).
            max_len: preallocate room for ``max_len`` tokens (None: grow as needed; needed
                with ``static``).
            rolling: layers with a sliding window keep only their last ``window`` positions
                (a rolling cache; outputs are the same); False keeps every position.
            static: a :class:`~qkv.nn.static_cache.StaticKVCache` (one fixed shape, written
                at slot tensors: the form ``torch.compile`` runs without recompiling) instead
                of a :class:`~qkv.nn.KVCache`.
            dtype, device: of a static cache's buffers (default: the parameters').

        Raises:
            ValueError: ``batch_size`` or ``max_len`` not a positive int or None (not None
                with ``static``); ``static`` for a model with sliding windows, ALiBi or a
                relative bias, whose masks a static cache does not express.
        """
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):  # fmt: skip
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        c = self.config
        if not static:
            windows = c.windows if rolling else None
            return KVCache(c.num_layers, max_len=max_len, windows=windows)
        if any(w is not None for w in c.windows) or c.positions in ("alibi", "relative"):
            raise ValueError(
                f"a static cache does not support sliding windows, ALiBi or relative biases "
                f"(this model: windows {c.windows}, positions={c.positions!r}); use "
                "new_cache() (static=False)"
            )
        return new_static_cache(c.num_layers, batch_size, max_len, c.num_kv_heads or c.num_heads,
                                c.head_dim, self.embed.weight, dtype=dtype,
                                device=device)  # fmt: skip

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Next-token logits for every position.

        Args:
            input_ids: ``(B, T)`` integer token ids in ``[0, V)``.
            attention_mask: ``(B, S)`` bool or 0/1, 1 = real token, over all ``S = cached +
                T`` positions (padding); None = every position is real.
            cache: a :class:`~qkv.nn.KVCache` from :meth:`new_cache`; the new tokens' keys
                and values are appended and attention covers the cached ones too.
            positions: ``(B, T)`` or ``(T,)`` positions of the new tokens (left-padded rows
                count from their first real token); default ``cache.length + arange(T)``.
                Read by learned, sinusoidal and rotary positions; ALiBi depends only on
                distances, which left padding does not change. With ``document_ids`` the
                default restarts at 0 at each document.
            document_ids: ``(B, T)`` integer ids of packed documents (each one contiguous run
                of a row; see :func:`qkv.data.packing.pack_documents`): a position attends
                only to earlier positions of its own document. Not with ``cache`` or
                ``attention_mask`` (padding in a packed row is a document of its own).

        Returns:
            ``(B, T, V)`` logits.

        Raises:
            TypeError: non-integer ids, positions or document ids, a cache that is not a
                ``KVCache``.
            ValueError: ids out of ``[0, V)``, an input (a document, when packed) beyond
                ``max_len`` (learned positions), masks, positions or document ids of the wrong
                shape, a cache with another layer count, ``document_ids`` with a cache or an
                attention mask.
        """
        c = self.config
        B, T = check_ids("input_ids", input_ids, c.vocab_size).shape
        cache = check_cache(cache, c.num_layers)
        if isinstance(cache, StaticKVCache):
            return self._forward_static(input_ids, cache, attention_mask, positions,
                                        document_ids)  # fmt: skip
        offset = 0 if cache is None else cache.length
        block_mask = None
        if document_ids is not None:
            if cache is not None or attention_mask is not None:
                raise ValueError(
                    "document_ids (packed rows) cannot be combined with a cache or an "
                    "attention_mask: generate one document at a time, and give padding a "
                    "document id of its own instead of masking it"
                )
            block_mask, positions = packed_inputs(document_ids, positions, B, T)
        positions = check_positions(positions, B, T, max_len=self.position_limit)
        if positions is None:
            check_length("input_ids", T, offset, self.position_limit)
        mask = None
        if attention_mask is not None:
            mask = padding_keep_mask("attention_mask", attention_mask, B, offset + T)

        h = self.embed(input_ids)  # (B, T, E)
        if c.embed_scale != 1.0:
            h = h * c.embed_scale  # (B, T, E)
        h = add_positions(self.pos, h, offset=offset, positions=positions, checked=True)
        h = self.drop(h)  # (B, T, E)
        if self.rel_bias is not None:  # computed once, every block adds it to its scores
            bias = self.rel_bias(T, offset + T, offset, dtype=h.dtype)  # (1, H, T, S)
            mask = combine(bias, mask)  # (B|1, H, T, S) float; a rolling cache cuts it
        # One new token after a cache sees every cached key: no causal mask to build, unless
        # a sliding window hides the oldest ones.
        causal = T > 1 or any(w is not None for w in c.windows)
        for i, block in enumerate(self.blocks):
            h = block(
                h, mask=mask, is_causal=causal, cache=None if cache is None else cache[i],
                positions=positions, block_mask=block_mask,
            )  # (B, T, E)
        return self._head(h)

    def _head(self, h: Tensor) -> Tensor:
        """Final norm, ``lm_head`` and soft cap: ``(B, T, E) -> (B, T, V)``."""
        c = self.config
        if self.norm_f is not None:
            h = self.norm_f(h)
        logits = self.lm_head(h)  # (B, T, V)
        if c.logit_softcap is not None:
            logits = c.logit_softcap * torch.tanh(logits / c.logit_softcap)  # (B, T, V)
        return logits

    def _forward_static(self, input_ids: Tensor, cache: StaticKVCache,
                        attention_mask: Tensor | None, positions: Tensor | None,
                        document_ids: Tensor | None) -> Tensor:  # fmt: skip
        """:meth:`forward` with a :class:`~qkv.nn.static_cache.StaticKVCache`: the new tokens
        are written at ``cache.slots`` and attend to every slot under its keep mask, so no
        shape depends on how many tokens came before (one compiled graph serves each step).
        ``attention_mask`` is ``(B, L)`` over every slot; ``positions`` default to the slots."""
        c = self.config
        B, T = input_ids.shape
        if document_ids is not None:
            raise ValueError("document_ids (packed rows) cannot be combined with a cache")
        if tuple(cache.slots.shape) != (T,):
            raise ValueError(f"the static cache's slots {tuple(cache.slots.shape)} must have "
                             f"one entry per new token (T={T}); call set_slots first")  # fmt: skip
        positions = cache.slots if positions is None else positions
        positions = check_positions(positions, B, T, max_len=self.position_limit)
        padding = None
        if attention_mask is not None:
            padding = padding_keep_mask("attention_mask", attention_mask, B, cache.capacity)
        mask = cache.keep_mask(padding)  # (B|1, 1, T, L)
        h = self.embed(input_ids)  # (B, T, E)
        if c.embed_scale != 1.0:
            h = h * c.embed_scale  # (B, T, E)
        h = self.drop(add_positions(self.pos, h, positions=positions, checked=True))
        for i, block in enumerate(self.blocks):
            h = block(h, mask=mask, cache=cache[i], positions=positions)  # (B, T, E)
        return self._head(h)
