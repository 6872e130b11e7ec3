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

import torch
from torch import Tensor, nn

from qkv.attention.mask_builders import combine
from qkv.models.decoder_config import DecoderLMConfig
from qkv.models.lm_loss import CausalLMOutput, causal_lm_loss
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
from qkv.nn.linear import Linear
from qkv.nn.norms import make_norm
from qkv.nn.rope_scaling import RopeScaling
from qkv.nn.sink_cache import sink_cache
from qkv.nn.static_cache import StaticKVCache

__all__ = ["DecoderLM", "DecoderLMConfig"]



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
        options = c.attention  # built once: every layer's options, but for its window
        self.blocks = nn.ModuleList(
            TransformerBlock(
                c.d_model, c.num_heads, c.ffn_dim, num_kv_heads=c.num_kv_heads,
                d_head=c.d_head, dropout=c.dropout, activation=c.activation, norm=c.norm,
                norm_kind=c.norm_kind, norm_eps=c.norm_eps, bias=c.bias,
                qkv_bias=c.qkv_bias, k_bias=c.k_bias, out_bias=c.out_bias,
                sandwich_norm=c.sandwich_norm, options=options, window=window,
                **parts.attention,
            )
            for window in c.windows
        )
        # Pre-norm leaves the residual stream unnormalised, so one last norm precedes the head.
        self.norm_f = (
            make_norm(c.norm_kind, c.d_model, eps=c.norm_eps, bias=c.bias)
            if c.norm == "pre" else None
        )
        self.lm_head = Linear(c.d_model, c.vocab_size, bias=False)
        init_gpt_style(self, c.num_layers)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_cache(self, batch_size: int | None = None, max_len: int | None = None, *,
                  rolling: bool = True, static: bool = False, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, sinks: int = 4,
                  recent: int | None = None) -> KVCache | StaticKVCache:  # fmt: skip
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
            recent: with it, an attention-sink cache (:mod:`qkv.nn.sink_cache`): the first
                ``sinks`` positions and the last ``recent`` ones are kept, positions
                re-based, so generation goes on in flat memory (rotary models without
                sliding windows; rows not padded).
            sinks: first positions a sink cache keeps (StreamingLLM's 4; 0: a plain rolling
                window).

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
        if recent is not None:
            return self._sink_cache(sinks, recent, static)
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

    def _sink_cache(self, sinks: int, recent: int, static: bool) -> KVCache:
        c = self.config
        if static or c.positions != "rope" or any(w is not None for w in c.windows):
            raise ValueError(
                f"an attention-sink cache (recent={recent}) re-bases rotary positions: it needs "
                f"positions='rope', no sliding windows and static=False (this model: "
                f"positions={c.positions!r}, windows {c.windows}, static={static})"
            )
        return sink_cache(c.num_layers, sinks, recent)

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        document_ids: Tensor | None = None,
        labels: Tensor | None = None,
        logits_at: Tensor | None = None,
    ) -> Tensor | CausalLMOutput:
        """Next-token logits for every position (and, given ``labels``, the loss).

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
            labels: ``(B, T)`` token ids, as transformers takes them (usually ``input_ids``
                itself; ``-100`` leaves a position out): the output is then a
                :class:`~qkv.models.lm_loss.CausalLMOutput` with ``.loss`` (the mean
                next-token cross-entropy, :func:`~qkv.models.lm_loss.causal_lm_loss`) and
                ``.logits``.
            logits_at: ``(B, T)`` bool: the logits of these positions only, ``(N, V)`` in
                row-major order (``N`` = True entries), as transformers' ``logits_to_keep``
                but per position: training on a chat's replies needs the output layer (a
                fifth of a small model's compute) only where the loss counts. Not with
                ``labels``.

        Returns:
            ``(B, T, V)`` logits (``(N, V)`` with ``logits_at``); with ``labels``,
            ``CausalLMOutput(loss, logits)``.

        Raises:
            TypeError: non-integer ids, positions or document ids, a cache that is not a
                ``KVCache``.
            ValueError: ids out of ``[0, V)``, an input (a document, when packed) beyond
                ``max_len`` (learned positions), masks, positions or document ids of the wrong
                shape, a cache with another layer count, ``document_ids`` with a cache or an
                attention mask, ``logits_at`` not a ``(B, T)`` bool tensor or with ``labels``.
        """
        if logits_at is not None:
            _check_logits_at(logits_at, input_ids, labels)
        logits = self._logits(input_ids, attention_mask, cache, positions, document_ids,
                              logits_at)  # fmt: skip
        return logits if labels is None else CausalLMOutput(causal_lm_loss(logits, labels),
                                                            logits)

    def _logits(self, input_ids: Tensor, attention_mask: Tensor | None,
                cache: KVCache | None, positions: Tensor | None,
                document_ids: Tensor | None, keep: Tensor | None = None) -> Tensor:  # fmt: skip
        """:meth:`forward`'s logits ``(B, T, V)`` (``(N, V)`` at ``keep``)."""
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
        return self._head(h, keep)

    def _head(self, h: Tensor, keep: Tensor | None = None) -> Tensor:
        """Final norm, ``lm_head`` and soft cap: ``(B, T, E) -> (B, T, V)``, or ``(N, V)`` at
        the positions ``keep`` ``(B, T)`` marks."""
        c = self.config
        if keep is not None:
            h = h[keep]  # (N, E)
        if self.norm_f is not None:
            h = self.norm_f(h)
        logits = self.lm_head(h)  # (B, T, V) or (N, V)
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


def _check_logits_at(keep: Tensor, input_ids: Tensor, labels: Tensor | None) -> None:
    """``logits_at`` is a ``(B, T)`` bool tensor like ``input_ids``, without ``labels``."""
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        raise TypeError(f"logits_at must be a bool tensor (B, T), got "
                        f"{getattr(keep, 'dtype', type(keep).__name__)}")  # fmt: skip
    if tuple(keep.shape) != tuple(input_ids.shape):
        raise ValueError(f"logits_at must have input_ids' shape (B, T) = "
                         f"{tuple(input_ids.shape)}, got {tuple(keep.shape)}")  # fmt: skip
    if labels is not None:
        raise ValueError("logits_at and labels: the loss needs every position's logits; "
                         "give one of them")  # fmt: skip
