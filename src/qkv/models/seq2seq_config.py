"""The configuration of :class:`~qkv.models.Seq2SeqTransformer`: the paper's model by default,
and every option a pretrained encoder-decoder needs (BART, T5, Marian) as a generic switch.

Nothing here names a model family. BART is learned positions with an offset of 2, a LayerNorm
on the embeddings, no embedding scale and GELU; Marian (Opus-MT) is sinusoidal positions in
the ``[sin | cos]`` layout, the ``sqrt(E)`` scale and SiLU; T5 is pre-norm RMSNorm without
biases, relative position biases, unscaled attention scores and a scaled output. The Hugging
Face adapters (:mod:`qkv.pretrained.hf.bart`, ``hf.marian``, ``hf.t5``) only set these fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.models.config import ACTIVATIONS, NORM_KINDS, NORM_PLACEMENTS, POSITIONS, ConfigBase

__all__ = ["SINUSOIDAL_LAYOUTS", "Seq2SeqConfig"]

# Column order of sinusoidal positions: "interleaved" = sin, cos, sin, cos, ... (Vaswani et al.);
# "split" = all sines, then all cosines (fairseq, Marian).
SINUSOIDAL_LAYOUTS = ("interleaved", "split")


@dataclass(frozen=True)
class Seq2SeqConfig(ConfigBase):
    """Configuration of a :class:`Seq2SeqTransformer`.

    Attributes:
        src_vocab_size, tgt_vocab_size: source and target vocabularies.
        d_model: model width ``E``; a multiple of ``num_heads`` unless ``d_head`` is given.
        num_heads: attention heads ``H`` (self- and cross-attention).
        num_encoder_layers, num_decoder_layers: blocks in each stack.
        d_ff: feed-forward hidden width.
        dropout: on embeddings, attention weights, feed-forward hidden and residual branches.
        max_len: longest sequence (a hard limit only for learned positions).
        norm: ``"post"`` (the paper) or ``"pre"`` (then each stack ends with a norm).
        activation: feed-forward kind (``"relu"`` in the paper; see ``ACTIVATIONS``).
        positions: ``"sinusoidal"`` (the paper), ``"learned"``, ``"rope"``, ``"alibi"``,
            ``"relative"`` (T5's bucketed bias: bidirectional in the encoder, causal in the
            decoder, one table per stack shared by its blocks) or None; for RoPE, ALiBi and
            relative biases only the self-attentions see positions.
        tie_embeddings: the output projection's weight is the target embedding's.
        share_embeddings: one embedding for source and target (needs equal vocabularies).
        pad_id, bos_id, eos_id: special ids, valid in both vocabularies; ``pad_id`` builds the
            source padding mask (None: no padding); ``bos_id`` is the decoder's start token
            (what ``tgt_in`` begins with; BART starts from its EOS, T5 and Marian from PAD).
        norm_eps: epsilon of every norm.
        d_head: head width ``D`` (default ``E / H``; T5's ``d_kv`` may differ).
        norm_kind: ``"layernorm"`` (default) or ``"rmsnorm"`` (T5).
        bias: biases in the attention projections, feed-forwards and LayerNorms (T5: none).
        output_bias: a bias on the output projection ``lm_head`` (BART's and Marian's
            ``final_logits_bias``; T5: none).
        embed_scale: token embeddings are multiplied by this (None: ``sqrt(E)``, the paper and
            Marian; BART-base and T5: 1.0).
        embed_norm: a norm (``norm_kind``) on the embeddings after positions are added
            (BART's ``layernorm_embedding``), in both stacks.
        position_offset: learned and sinusoidal positions read row ``offset + p`` for position
            ``p`` (BART's learned table starts at row 2); a learned table then has
            ``max_len + position_offset`` rows.
        sinusoidal_layout: ``"interleaved"`` (sin, cos, sin, cos: the paper) or ``"split"``
            (all sines, then all cosines: fairseq, Marian).
        relative_buckets, relative_max_distance: the relative bias's buckets and the offset
            from which all share the last one (T5: 32 and 128).
        attn_scale: the factor on ``q·k`` scores (None: ``1/sqrt(D)``; T5: 1.0).
        head_scale: the decoder output is multiplied by this before ``lm_head`` (T5 with tied
            embeddings: ``E ** -0.5``).
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 128
    num_heads: int = 4
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    d_ff: int = 512
    dropout: float = 0.1
    max_len: int = 512
    norm: str = "post"
    activation: str = "relu"
    positions: str | None = "sinusoidal"
    tie_embeddings: bool = False
    share_embeddings: bool = False
    pad_id: int | None = 0
    bos_id: int | None = 1
    eos_id: int | None = 2
    norm_eps: float = 1e-5
    d_head: int | None = None
    norm_kind: str = "layernorm"
    bias: bool = True
    output_bias: bool = True
    embed_scale: float | None = None
    embed_norm: bool = False
    position_offset: int = 0
    sinusoidal_layout: str = "interleaved"
    relative_buckets: int = 32
    relative_max_distance: int = 128
    attn_scale: float | None = None
    head_scale: float = 1.0

    @property
    def head_width(self) -> int:
        """``D``: ``d_head``, or ``d_model / num_heads``."""
        return self.d_head if self.d_head is not None else self.d_model // self.num_heads

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads",
                     "num_encoder_layers", "num_decoder_layers", "d_ff", "max_len"):
            self._int(name)
        self._int("d_head", optional=True)
        self._int("position_offset", minimum=0)
        self._heads(self.d_model, self.num_heads, d_head=self.d_head)
        self._float("dropout", low=0.0, high=1.0)
        self._float("norm_eps", low=0.0)
        self._float("head_scale", low=0.0)
        for name in ("attn_scale", "embed_scale"):
            if getattr(self, name) is not None:
                self._float(name, low=0.0)
        self._choice("norm", NORM_PLACEMENTS)
        self._choice("norm_kind", NORM_KINDS)
        self._choice("activation", ACTIVATIONS)
        self._choice("positions", POSITIONS)
        self._choice("sinusoidal_layout", SINUSOIDAL_LAYOUTS)
        self._rope_even(self.positions, self.head_width)
        self._relative()
        for name in ("tie_embeddings", "share_embeddings", "bias", "output_bias",
                     "embed_norm"):
            self._flag(name)
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "Seq2SeqConfig.share_embeddings=True needs src_vocab_size == tgt_vocab_size, "
                f"got {self.src_vocab_size} and {self.tgt_vocab_size}"
            )
        for name in ("pad_id", "bos_id", "eos_id"):
            self._token(name, min(self.src_vocab_size, self.tgt_vocab_size))
