"""Encoder-decoder transformer for sequence-to-sequence tasks (Vaswani et al., 2017, Fig. 1).

    memory = encoder(src_embed(src)·√E + PE)                       bidirectional self-attention
    logits = lm_head(decoder(tgt_embed(tgt_in)·√E + PE, memory))   causal self-attention,
                                                                    cross-attention to memory

Each encoder block is self-attention + feed-forward, each decoder block adds cross-attention
between them (:class:`~qkv.nn.TransformerBlock` with ``cross_attention=True``). With the
defaults (post-norm, ReLU, sinusoidal positions) the stacks compute what
``torch.nn.Transformer`` computes without its final LayerNorms, which the paper does not have.

Masks: the source padding mask ``(B, 1, 1, S)`` (True = real token) hides padded source
positions from the encoder's self-attention and from every cross-attention. The decoder needs
no target padding mask: target padding sits after the real tokens, which the causal mask hides
from them; the loss ignores padded positions.

Pretrained encoder-decoders differ from the paper by options of :class:`Seq2SeqConfig`, never
by model type: the embedding scale, a position offset and layout, a norm on the embeddings,
RMSNorm and no biases, relative position biases computed once per stack (a ``(1, H, T, S)``
float mask every block of the stack adds to its self-attention scores), the attention scale,
and a scale and bias at the output.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.attention import masks
from qkv.models.parts import (
    ModelBase,
    add_positions,
    check_cache,
    check_ids,
    check_length,
    check_memory,
    init_xavier,
    new_static_cache,
)
from qkv.models.seq2seq_config import Seq2SeqConfig
from qkv.models.seq2seq_positions import stack_positions
from qkv.nn.block import TransformerBlock
from qkv.nn.cache import KVCache
from qkv.nn.linear import Linear
from qkv.nn.norms import make_norm
from qkv.nn.static_cache import StaticKVCache

__all__ = ["Seq2SeqConfig", "Seq2SeqTransformer"]


class Seq2SeqTransformer(ModelBase):
    """Encoder-decoder transformer: ``forward(src, tgt_in) -> logits``, plus ``encode`` and an
    incremental ``decode`` with a KV cache.

    Args:
        config: a :class:`Seq2SeqConfig`.

    Submodules: ``src_embed``, ``tgt_embed`` (``nn.Embedding``; the same module when
    ``share_embeddings``), ``src_pos``, ``tgt_pos`` (positions added to the embeddings, or
    None for RoPE/ALiBi/relative/no positions), ``src_rel_bias``, ``tgt_rel_bias``
    (:class:`~qkv.nn.relative_bias.RelativePositionBias` with ``positions="relative"``, else
    None), ``src_embed_norm``, ``tgt_embed_norm`` (``embed_norm`` only, else None), ``drop``,
    ``encoder_blocks``, ``decoder_blocks`` (``nn.ModuleList`` of
    :class:`~qkv.nn.TransformerBlock`; decoder blocks have ``cross_attn``), ``encoder_norm``,
    ``decoder_norm`` (final norms, pre-norm only, else None), ``lm_head`` (``nn.Linear(E,
    V_tgt)``, bias when ``output_bias``; weight tied to ``tgt_embed`` when
    ``tie_embeddings``). Matrices are initialised Xavier-uniform.

    Raises:
        TypeError: ``config`` is not a :class:`Seq2SeqConfig`.
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        if not isinstance(config, Seq2SeqConfig):
            raise TypeError(f"config must be a Seq2SeqConfig, got {type(config).__name__}")
        self.config = c = config
        self.embed_scale = math.sqrt(c.d_model) if c.embed_scale is None else c.embed_scale
        src_parts = stack_positions(c, encoder=True)
        tgt_parts = stack_positions(c, encoder=False)
        self.src_embed = nn.Embedding(c.src_vocab_size, c.d_model)
        self.tgt_embed = (
            self.src_embed if c.share_embeddings else nn.Embedding(c.tgt_vocab_size, c.d_model)
        )
        self.src_pos, self.tgt_pos = src_parts.added, tgt_parts.added
        self.src_rel_bias, self.tgt_rel_bias = src_parts.bias, tgt_parts.bias
        self.position_limit = src_parts.limit  # learned table size; None: any length works
        norm = {"eps": c.norm_eps, "bias": c.bias}
        self.src_embed_norm = make_norm(c.norm_kind, c.d_model, **norm) if c.embed_norm else None
        self.tgt_embed_norm = make_norm(c.norm_kind, c.d_model, **norm) if c.embed_norm else None
        self.drop = nn.Dropout(c.dropout)
        block = {"d_model": c.d_model, "num_heads": c.num_heads, "d_ff": c.d_ff,
                 "d_head": c.d_head, "dropout": c.dropout, "activation": c.activation,
                 "norm": c.norm, "norm_kind": c.norm_kind, "norm_eps": c.norm_eps,
                 "bias": c.bias, "scale": c.attn_scale}
        self.encoder_blocks = nn.ModuleList(
            TransformerBlock(**block, **src_parts.attention) for _ in range(c.num_encoder_layers)
        )
        self.decoder_blocks = nn.ModuleList(
            TransformerBlock(**block, cross_attention=True, **tgt_parts.attention)
            for _ in range(c.num_decoder_layers)
        )
        pre = c.norm == "pre"
        self.encoder_norm = make_norm(c.norm_kind, c.d_model, **norm) if pre else None
        self.decoder_norm = make_norm(c.norm_kind, c.d_model, **norm) if pre else None
        self.lm_head = Linear(c.d_model, c.tgt_vocab_size, bias=c.output_bias)
        init_xavier(self)
        if c.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight

    def new_cache(self, max_len: int | None = None, *, static: bool = False,
                  batch_size: int | None = None) -> KVCache | StaticKVCache:  # fmt: skip
        """An empty cache for :meth:`decode`, one layer per decoder block (``max_len``:
        preallocate room for that many target tokens).

        ``static=True`` gives a :class:`~qkv.nn.static_cache.StaticKVCache` of ``batch_size``
        rows and ``max_len`` slots (the form ``torch.compile`` wants: one shape for every
        step); the cross-attention keys and values are stored in it at the first step.

        Raises:
            ValueError: ``static`` without ``batch_size`` and ``max_len``, or for a model with
                relative position biases (whose masks a static cache does not express).
        """
        c = self.config
        if not static:
            return KVCache(c.num_decoder_layers, max_len=max_len)
        if self.tgt_rel_bias is not None or c.positions == "alibi":
            raise ValueError(
                f"a static cache does not support ALiBi or relative position biases (this "
                f"model: positions={c.positions!r}); use new_cache() (static=False)"
            )
        return new_static_cache(c.num_decoder_layers, batch_size, max_len, c.num_heads,
                                c.head_width, self.lm_head.weight)

    def _device(self) -> torch.device:
        return self.lm_head.weight.device

    def make_src_mask(self, src: Tensor) -> Tensor | None:
        """Source padding keep mask ``(B, 1, 1, S)`` (True = real token) from ``pad_id``; None
        when ``pad_id`` is None."""
        if self.config.pad_id is None:
            return None
        return masks.padding_from_ids(src, self.config.pad_id)  # (B, 1, 1, S)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """Encode source tokens into the memory the decoder attends to.

        Args:
            src: ``(B, S)`` source token ids.
            src_mask: keep mask broadcastable to ``(B, H, S, S)``, usually ``(B, 1, 1, S)``;
                None builds it from ``pad_id`` (:meth:`make_src_mask`).

        Returns:
            memory ``(B, S, E)``.

        Raises:
            TypeError, ValueError: bad ids (type, shape, range, device), a source beyond
                ``max_len`` with learned positions, a mask of the wrong type, shape or device.
        """
        c = self.config
        device = self._device()
        _check_device("src", src, device)
        B, S = check_ids("src", src, c.src_vocab_size).shape
        if src_mask is None:
            src_mask = self.make_src_mask(src)
        _check_mask("src_mask", src_mask, (B, c.num_heads, S, S), device)
        check_length("src", S, 0, self.position_limit)
        x = self._embed(src, self.src_embed, self.src_pos, self.src_embed_norm, 0)  # (B, S, E)
        # A relative bias is computed once and every block adds it (with the padding mask).
        mask = src_mask
        if self.src_rel_bias is not None:
            bias = self.src_rel_bias(S, S, dtype=x.dtype)  # (1, H, S, S)
            mask = masks.combine(bias, src_mask)  # (B|1, H, S, S) float
        for block in self.encoder_blocks:
            x = block(x, mask=mask)  # (B, S, E)
        return x if self.encoder_norm is None else self.encoder_norm(x)

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        src_mask: Tensor | None = None,
        *,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Target logits given the memory; incremental with a cache.

        Args:
            tgt_in: ``(B, T)`` target ids (shifted right: ``bos`` first).
            memory: ``(B, S, E)`` from :meth:`encode`.
            src_mask: keep mask broadcastable to ``(B, H, T, S)`` (usually ``(B, 1, 1, S)``
                from :meth:`make_src_mask`); None lets every memory position be seen.
            cache: from :meth:`new_cache`. The new tokens follow the cached ones (positions
                and causal mask shift by ``cache.length``); the cross-attention keys/values
                are projected from ``memory`` at the first call and reused afterwards.

        Returns:
            ``(B, T, V_tgt)`` logits, equal to decoding the whole prefix at once.

        Raises:
            TypeError, ValueError: bad ids, a memory that is not ``(B, S, E)`` with
                ``tgt_in``'s ``B`` (in the parameters' dtype, on their device), a mask of the
                wrong shape or device, a cache of another layer count, a target beyond
                ``max_len`` with learned positions.
        """
        c = self.config
        device = self._device()
        _check_device("tgt_in", tgt_in, device)
        B, T = check_ids("tgt_in", tgt_in, c.tgt_vocab_size).shape
        check_memory(memory, B, self.lm_head.weight, batch_of="tgt_in")
        cache = check_cache(cache, c.num_decoder_layers)
        _check_mask("src_mask", src_mask, (B, c.num_heads, T, memory.shape[1]), device)
        if isinstance(cache, StaticKVCache):
            # New tokens at the cache's slots, seeing every slot its keep mask opens: no
            # shape depends on how many tokens came before (one compiled graph per step).
            if tuple(cache.slots.shape) != (T,):
                raise ValueError(f"the static cache's slots {tuple(cache.slots.shape)} must "
                                 f"have one entry per new token (T={T}); call set_slots first")
            positions = cache.slots + c.position_offset  # (T,)
            y = self._embed(tgt_in, self.tgt_embed, self.tgt_pos, self.tgt_embed_norm, 0,
                            positions=positions)  # (B, T, E)  # fmt: skip
            mask, causal = cache.keep_mask(), False  # (1, 1, T, L)
            rotary = cache.slots  # (T,): what rotary positions read
        else:
            offset = 0 if cache is None else cache.length
            check_length("tgt_in", T, offset, self.position_limit)
            y = self._embed(tgt_in, self.tgt_embed, self.tgt_pos, self.tgt_embed_norm,
                            offset)  # (B, T, E)  # fmt: skip
            mask, causal, rotary = None, T > 1, None
            if self.tgt_rel_bias is not None:
                mask = self.tgt_rel_bias(T, offset + T, offset, dtype=y.dtype)  # (1, H, T, S)
        for i, block in enumerate(self.decoder_blocks):
            y = block(
                y, memory, mask=mask, is_causal=causal, context_mask=src_mask,
                cache=None if cache is None else cache[i], positions=rotary,
            )  # (B, T, E)
        if self.decoder_norm is not None:
            y = self.decoder_norm(y)
        if c.head_scale != 1.0:
            y = y * c.head_scale
        return self.lm_head(y)  # (B, T, V_tgt)

    def _embed(
        self, ids: Tensor, embed: nn.Module, pos: nn.Module | None, norm: nn.Module | None,
        offset: int, positions: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """``ids (B, T) -> (B, T, E)``: scaled embeddings + positions (after ``offset`` cached
        tokens, shifted by ``position_offset``; or ``positions (T,)`` as given), then the
        embedding norm and dropout."""
        x = embed(ids) * self.embed_scale  # (B, T, E)
        if positions is None:
            x = add_positions(pos, x, offset=offset + self.config.position_offset)  # (B, T, E)
        else:
            x = add_positions(pos, x, positions=positions)  # (B, T, E)
        return self.drop(x if norm is None else norm(x))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced logits.

        Args:
            src: ``(B, S)`` source ids (padded with ``pad_id``).
            tgt_in: ``(B, T)`` target ids shifted right.

        Returns:
            ``(B, T, V_tgt)`` logits.

        Raises:
            TypeError, ValueError: as :meth:`encode` and :meth:`decode`, and ``src`` and
                ``tgt_in`` of different batch sizes.
        """
        device = self._device()
        _check_device("src", src, device)
        _check_device("tgt_in", tgt_in, device)
        B = check_ids("src", src, self.config.src_vocab_size).shape[0]
        B_tgt = check_ids("tgt_in", tgt_in, self.config.tgt_vocab_size).shape[0]
        if B != B_tgt:
            raise ValueError(
                f"src and tgt_in must have the same batch size B, got src {tuple(src.shape)} "
                f"and tgt_in {tuple(tgt_in.shape)}"
            )
        src_mask = self.make_src_mask(src)
        return self.decode(tgt_in, self.encode(src, src_mask), src_mask)


def _check_device(name: str, x: object, device: torch.device) -> None:
    """A tensor ``x`` on the model's ``device`` (anything else is left to the other checks)."""
    if isinstance(x, Tensor) and x.device != device:
        raise ValueError(f"{name} must be on the model's device {device}, got {x.device}")


def _check_mask(
    name: str, mask: object, scores: tuple[int, int, int, int], device: torch.device
) -> None:
    """None, or a bool/float tensor on ``device`` broadcastable to the attention scores
    ``(B, H, T, S)``."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    _check_device(name, mask, device)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name} must be a boolean keep mask (True = may attend) or a float mask, "
            f"got dtype {mask.dtype}"
        )
    try:
        fits = torch.broadcast_shapes(mask.shape, scores) == torch.Size(scores)
    except RuntimeError:
        fits = False
    if not fits or mask.dim() > 4:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} must broadcast to the attention scores "
            f"(B, H, T, S) = {scores}, e.g. ({scores[0]}, 1, 1, {scores[3]})"
        )
