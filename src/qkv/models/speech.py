"""Speech encoder-decoder: log-mel spectrogram in, text tokens out (Whisper's architecture).

    h      = gelu(conv2(gelu(conv1(features))))     (B, n_mels, F) -> (B, E, S), S = ceil(F/2)
    memory = encoder_norm(encoder(hᵀ + PE_sin))      bidirectional self-attention, (B, S, E)
    logits = decoder_norm(decoder(embed(tokens) + PE_learned, memory)) · embedᵀ
                                                     causal self-attention, cross-attention

(Radford et al., 2022, "Robust Speech Recognition via Large-Scale Weak Supervision", Fig. 1.)
The front-end is two 1-D convolutions of width 3 over time, the second with stride 2, so an
encoder frame covers 2 spectrogram frames: with a 10 ms hop, 20 ms of audio. The encoder's
positions are a fixed sinusoidal table laid out as ``[sin | cos]`` halves
(:func:`speech_sinusoids`); the decoder's are learned. Blocks are qkv's own
:class:`~qkv.nn.TransformerBlock` (pre-norm, GELU feed-forward, key projections without bias
by default: ``k_bias``); each stack ends with a LayerNorm; the output projection is the token
embedding's transpose (tied), without bias.

Every frame is real (a 30 s window is padded with silence, not masked), so no mask is needed;
the decoder's self-attention is causal, its cross-attention sees every frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.checks import values_unknown
from qkv.models.config import ConfigBase
from qkv.models.parts import (
    ModelBase,
    check_cache,
    check_ids,
    check_length,
    check_memory,
    new_static_cache,
)
from qkv.nn.block import TransformerBlock
from qkv.nn.cache import KVCache
from qkv.nn.feedforward import ACTIVATIONS as FFN_ACTIVATIONS
from qkv.nn.linear import Linear
from qkv.nn.norms import make_norm
from qkv.nn.positions import LearnedPositionalEmbedding
from qkv.nn.static_cache import StaticKVCache

__all__ = ["SpeechSeq2Seq", "SpeechSeq2SeqConfig", "speech_sinusoids"]


def speech_sinusoids(length: int, d_model: int, max_timescale: float = 10000.0) -> Tensor:
    """Whisper's sinusoidal table ``(length, E)``: sines in the first ``E/2`` columns, cosines
    in the rest, with timescales ``max_timescale^(i / (E/2 - 1))`` for ``i = 0 .. E/2 - 1``
    (so the last column pair has exactly ``max_timescale``; Vaswani et al.'s table interleaves
    the pairs and divides by ``E`` instead). Computed in float64, returned as float32.

    Raises:
        ValueError: ``length < 1`` or ``d_model`` not an even int >= 4.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 4 or d_model % 2:
        raise ValueError(f"d_model must be an even int >= 4, got {d_model!r}")
    half = d_model // 2
    increment = math.log(max_timescale) / (half - 1)
    inv = torch.exp(-increment * torch.arange(half, dtype=torch.float64))  # (E/2,)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]  # (L, E/2)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()  # (L, E)


@dataclass(frozen=True)
class SpeechSeq2SeqConfig(ConfigBase):
    """Configuration of a :class:`SpeechSeq2Seq` (defaults: Whisper tiny.en).

    Attributes:
        vocab_size: ``V``, the decoder's tokens.
        n_mels: mel bins of the input spectrogram (80; 128 for Whisper large-v3).
        d_model: model width ``E``; a multiple of ``num_heads``.
        num_heads: attention heads ``H`` (every attention).
        num_encoder_layers, num_decoder_layers: blocks in each stack.
        d_ff: feed-forward hidden width.
        max_source_len: encoder frames there are positions for (1500 = 30 s at 20 ms a frame);
            the input may have up to ``2 * max_source_len`` spectrogram frames.
        max_len: decoder tokens there are learned positions for (448).
        activation: the feed-forward's and the front-end's activation (``"gelu"``).
        k_bias: whether the key projections have a bias (Whisper's have none: softmax is
            invariant to a bias added to every key's score alike, so it would be redundant;
            passed to :class:`~qkv.nn.TransformerBlock` as ``k_bias``).
        norm_eps: LayerNorm epsilon.
        dropout: on attention weights, feed-forward hidden and residual branches.
        pad_id, bos_id, eos_id: special ids (Whisper: ``<|endoftext|>`` pads and ends,
            ``<|startoftranscript|>`` starts).
    """

    vocab_size: int = 51864
    n_mels: int = 80
    d_model: int = 384
    num_heads: int = 6
    num_encoder_layers: int = 4
    num_decoder_layers: int = 4
    d_ff: int = 1536
    max_source_len: int = 1500
    max_len: int = 448
    activation: str = "gelu"
    k_bias: bool = False
    norm_eps: float = 1e-5
    dropout: float = 0.0
    pad_id: int | None = 50256
    bos_id: int | None = 50257
    eos_id: int | None = 50256

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_mels", "d_model", "num_heads", "num_encoder_layers",
                     "num_decoder_layers", "d_ff", "max_source_len", "max_len"):
            self._int(name)
        self._heads(self.d_model, self.num_heads)
        if self.d_model % 2 or self.d_model < 4:
            self._fail("d_model", "an even int >= 4 (the sinusoidal table has sin|cos halves)",
                       self.d_model)  # fmt: skip
        self._choice("activation", tuple(FFN_ACTIVATIONS))
        self._flag("k_bias")
        self._float("norm_eps", low=0.0)
        self._float("dropout", low=0.0, high=1.0)
        for name in ("pad_id", "bos_id", "eos_id"):
            self._token(name, self.vocab_size)


def _keep_mask(keep: Tensor | None, B: int, L: int) -> Tensor | None:
    """``keep (B, L)`` as the self-attention mask ``(B, 1, 1, L)``, checked."""
    if keep is None:
        return None
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or tuple(keep.shape) != (B, L):
        got = (keep.dtype, tuple(keep.shape)) if isinstance(keep, Tensor) else type(keep)
        raise ValueError(f"keep must be a bool (B, L) = ({B}, {L}) tensor over the cached and "
                         f"new tokens, got {got}")  # fmt: skip
    return keep[:, None, None, :]


class SpeechSeq2Seq(ModelBase):
    """Speech encoder-decoder: ``forward(features, tokens) -> logits``, plus ``encode`` and an
    incremental ``decode`` with a KV cache.

    Args:
        config: a :class:`SpeechSeq2SeqConfig`.

    Submodules: ``conv1`` (``Conv1d(n_mels, E, 3, padding=1)``), ``conv2`` (``Conv1d(E, E, 3,
    stride=2, padding=1)``), ``act`` (the front-end's activation), buffer ``encoder_pos``
    ``(max_source_len, E)`` (:func:`speech_sinusoids`; saved, so a loader can bring the
    checkpoint's own table), ``encoder_blocks`` / ``decoder_blocks`` (``nn.ModuleList`` of
    pre-norm :class:`~qkv.nn.TransformerBlock`, decoder blocks with ``cross_attn``),
    ``encoder_norm``, ``tgt_embed`` (``nn.Embedding(V, E)``), ``tgt_pos``
    (:class:`~qkv.nn.positions.LearnedPositionalEmbedding` ``(max_len, E)``), ``decoder_norm``,
    ``lm_head`` (``Linear(E, V, bias=False)``, its weight *is* ``tgt_embed.weight``).

    Raises:
        TypeError: ``config`` is not a :class:`SpeechSeq2SeqConfig`.
    """

    encoder_pos: Tensor
    # Its encoder reads features, not ids: qkv.generate decodes it from EncodedInputs only.
    encodes_tokens = False

    def __init__(self, config: SpeechSeq2SeqConfig) -> None:
        super().__init__()
        if not isinstance(config, SpeechSeq2SeqConfig):
            raise TypeError(f"config must be a SpeechSeq2SeqConfig, got {type(config).__name__}")
        self.config = c = config
        self.conv1 = nn.Conv1d(c.n_mels, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.act = FFN_ACTIVATIONS[c.activation]()
        self.register_buffer("encoder_pos", speech_sinusoids(c.max_source_len, c.d_model))
        block = {"d_model": c.d_model, "num_heads": c.num_heads, "d_ff": c.d_ff,
                 "dropout": c.dropout, "activation": c.activation, "norm": "pre",
                 "norm_eps": c.norm_eps, "k_bias": c.k_bias}
        self.encoder_blocks = nn.ModuleList(
            TransformerBlock(**block) for _ in range(c.num_encoder_layers)
        )
        self.encoder_norm = make_norm("layernorm", c.d_model, eps=c.norm_eps)
        self.tgt_embed = nn.Embedding(c.vocab_size, c.d_model)
        self.tgt_pos = LearnedPositionalEmbedding(c.max_len, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.decoder_blocks = nn.ModuleList(
            TransformerBlock(**block, cross_attention=True) for _ in range(c.num_decoder_layers)
        )
        self.decoder_norm = make_norm("layernorm", c.d_model, eps=c.norm_eps)
        self.lm_head = Linear(c.d_model, c.vocab_size, bias=False)
        self.lm_head.weight = self.tgt_embed.weight

    def new_cache(self, max_len: int | None = None, *, static: bool = False,
                  batch_size: int | None = None) -> KVCache | StaticKVCache:  # fmt: skip
        """An empty cache for :meth:`decode`, one layer per decoder block (``max_len``:
        preallocate room for that many tokens); ``static=True``: a
        :class:`~qkv.nn.static_cache.StaticKVCache` of ``batch_size`` rows and ``max_len``
        slots, the fixed shape ``torch.compile`` wants.

        Raises:
            ValueError: ``static`` without ``batch_size`` and ``max_len``.
        """
        c = self.config
        if not static:
            return KVCache(c.num_decoder_layers, max_len=max_len)
        return new_static_cache(c.num_decoder_layers, batch_size, max_len, c.num_heads,
                                c.d_model // c.num_heads, self.lm_head.weight)

    def _check_features(self, features: object) -> Tensor:
        c = self.config
        if not isinstance(features, Tensor):
            raise TypeError(f"features must be a torch.Tensor (B, n_mels, F), got "
                            f"{type(features).__name__}")  # fmt: skip
        if features.dim() != 3 or features.shape[1] != c.n_mels or features.shape[2] < 1:
            raise ValueError(f"features must have shape (B, n_mels={c.n_mels}, F) with F >= 1 "
                             f"log-mel frames, got {tuple(features.shape)}")  # fmt: skip
        if features.shape[2] > 2 * c.max_source_len:
            raise ValueError(
                f"features has F={features.shape[2]} frames; the encoder has positions for "
                f"{2 * c.max_source_len} (max_source_len={c.max_source_len} after the stride-2 "
                "convolution); split longer audio into windows"
            )
        weight = self.conv1.weight
        if features.device != weight.device:
            raise ValueError(f"features must be on the model's device {weight.device}, got "
                             f"{features.device}")  # fmt: skip
        if features.dtype != weight.dtype and not torch.is_autocast_enabled(weight.device.type):
            raise TypeError(f"features must have the parameters' dtype {weight.dtype}, got "
                            f"{features.dtype}")  # fmt: skip
        if not values_unknown(features) and not bool(torch.isfinite(features).all()):
            raise ValueError("features holds NaN or infinite values")
        return features

    def encode(self, features: Tensor) -> Tensor:
        """Encode a log-mel spectrogram into the memory the decoder attends to.

        Args:
            features: ``(B, n_mels, F)`` log-mel frames (``F = 3000`` for a 30 s window).

        Returns:
            memory ``(B, S, E)`` with ``S = ceil(F / 2)``.

        Raises:
            TypeError, ValueError: ``features`` of the wrong type, shape, dtype or device,
                longer than ``2 * max_source_len`` frames, or not finite.
        """
        x = self._check_features(features)
        x = self.act(self.conv2(self.act(self.conv1(x))))  # (B, E, S)
        x = x.transpose(1, 2)  # (B, S, E)
        x = self.drop(x + self.encoder_pos[: x.shape[1]].to(x.dtype))  # (B, S, E)
        for block in self.encoder_blocks:
            x = block(x)  # (B, S, E)
        return self.encoder_norm(x)

    def decode(
        self, tokens: Tensor, memory: Tensor, memory_mask: Tensor | None = None, *,
        cache: KVCache | None = None, keep: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """Token logits given the memory; incremental with a cache.

        Args:
            tokens: ``(B, T)`` token ids (the decoder prompt, then the tokens chosen so far).
            memory: ``(B, S, E)`` from :meth:`encode`.
            memory_mask: cross-attention keep mask broadcastable to ``(B, H, T, S)``, or None
                (every frame is seen; what Whisper does).
            cache: from :meth:`new_cache`: new tokens follow the cached ones (positions and
                the causal mask shift by ``cache.length``); the cross-attention keys/values
                are projected from ``memory`` once, at the first call, and reused.
            keep: ``(B, L)`` bool, which of the ``L`` tokens so far (cached and these) are
                real: rows of left-padded prompts of different lengths decode together, the
                padding hidden from every query (with ``positions``; not with a static cache).
            positions: ``(B, T)`` the tokens' positions (each row counted from its first real
                token), or None: ``cache.length`` on.

        Returns:
            ``(B, T, V)`` logits, equal to decoding the whole prefix at once.

        Raises:
            TypeError, ValueError: bad ids, a memory that is not ``(B, S, E)`` with the
                tokens' ``B`` (parameters' dtype and device), a cache of another layer count,
                tokens beyond ``max_len`` positions.
        """
        c = self.config
        B, T = check_ids("tokens", tokens, c.vocab_size).shape
        if tokens.device != self.lm_head.weight.device:
            raise ValueError(f"tokens must be on the model's device {self.lm_head.weight.device}"
                             f", got {tokens.device}")  # fmt: skip
        check_memory(memory, B, self.lm_head.weight, batch_of="tokens")
        cache = check_cache(cache, c.num_decoder_layers)
        if isinstance(cache, StaticKVCache):
            # New tokens at the cache's slots under its keep mask: one shape for every step.
            if tuple(cache.slots.shape) != (T,):
                raise ValueError(f"the static cache's slots {tuple(cache.slots.shape)} must "
                                 f"have one entry per new token (T={T}); call set_slots first")
            y = self.tgt_pos(self.tgt_embed(tokens), positions=cache.slots)  # (B, T, E)
            mask, causal = cache.keep_mask(), False  # (1, 1, T, L)
            if keep is not None or positions is not None:
                raise ValueError("keep= and positions= (ragged rows) need a dynamic cache; "
                                 "the static cache has its own slots")  # fmt: skip
        else:
            offset = 0 if cache is None else cache.length
            if positions is None:
                check_length("tokens", T, offset, c.max_len)
            y = self.tgt_pos(self.tgt_embed(tokens), offset, positions)  # (B, T, E)
            mask, causal = _keep_mask(keep, B, offset + T), T > 1
        y = self.drop(y)
        for i, block in enumerate(self.decoder_blocks):
            y = block(y, memory, mask=mask, is_causal=causal, context_mask=memory_mask,
                      cache=None if cache is None else cache[i])  # (B, T, E)  # fmt: skip
        return self._logits(self.decoder_norm(y))  # (B, T, V)

    # Decoding steps with at most this many rows use a transposed copy of the head's weight:
    # measured (AVX-512, and with MKL/oneDNN held to AVX2) 2x faster for 1-2 rows and no
    # slower for 4 on 51,864 x 384 and 49,152 x 576 heads; at 16 rows it depends on the shape.
    FEW_ROWS = 4

    def _logits(self, h: Tensor) -> Tensor:
        """``lm_head(h)``; for a few rows without gradients on the CPU, ``h @ Wᵀ`` with
        ``Wᵀ (E, V)`` kept contiguous: a (1, E) x (E, V) product streams the 80 MB weight
        about twice as fast as torch's ``linear`` on ``W (V, E)`` (5.9 ms -> 2.9 ms a step
        for tiny.en on the AVX-512 machine; the same sums in another order). The copy is
        remade when the weight changes (its version counter); a trace (torch.compile,
        export, jit) keeps the plain op."""
        w = self.lm_head.weight
        rows = h.shape[0] * h.shape[1]
        if (torch.is_grad_enabled() or h.device.type != "cpu" or rows > self.FEW_ROWS
                or values_unknown(h) or torch.jit.is_tracing()):  # a trace: the plain op
            return self.lm_head(h)
        key = (w.data_ptr(), w._version, w.dtype)
        held = self.__dict__.get("_head_t")
        if held is None or held[0] != key:
            held = self.__dict__["_head_t"] = (key, w.detach().t().contiguous())  # (E, V)
        return h @ held[1]

    def forward(self, features: Tensor, tokens: Tensor) -> Tensor:
        """Teacher-forced logits.

        Args:
            features: ``(B, n_mels, F)`` log-mel frames.
            tokens: ``(B, T)`` decoder input ids.

        Returns:
            ``(B, T, V)`` logits.

        Raises:
            TypeError, ValueError: as :meth:`encode` and :meth:`decode` (a batch size that
                differs between ``features`` and ``tokens`` is named by ``decode``).
        """
        return self.decode(tokens, self.encode(features))

