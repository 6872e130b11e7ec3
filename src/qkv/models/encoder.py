"""Bidirectional transformer encoder, BERT style, with mean or CLS pooling.

    h_0 = embed_norm(word(ids) + pos(0..S-1) + token_type(type_ids))      (Devlin et al., 2019)
    h_l = block_l(h_{l-1})            self-attention over every real token + feed-forward
    pool(h_L) = mean over real tokens (sentence embeddings) | h_L[:, 0] (the [CLS] token)

The parameter layout holds a BERT checkpoint: word/position/token-type embeddings and their
LayerNorm, then per block separate ``q_proj``/``k_proj``/``v_proj`` with biases, ``out_proj``,
post-norm LayerNorms ``attn_norm`` and ``ffn_norm``, and the feed-forward ``linear1``/
``linear2``. Padding is hidden from every attention through ``attention_mask``; the hidden
states at padded positions are computed but meaningless, and pooling skips them.

Packed rows: ``document_ids (B, S)`` keeps attention inside each document (a document block
mask on the blockwise flex kernel) and restarts positions at 0 in each one, so each document's
hidden states are those it gets alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from qkv.attention.mask_builders import combine
from qkv.models.config import ACTIVATIONS, NORM_PLACEMENTS, POSITIONS, ConfigBase
from qkv.models.parts import (
    ModelBase,
    add_positions,
    check_ids,
    check_length,
    check_positions,
    init_gpt_style,
    make_positions,
    packed_inputs,
    padding_keep_mask,
)
from qkv.nn.block import TransformerBlock
from qkv.nn.norms import make_norm

__all__ = ["POOLINGS", "Encoder", "EncoderConfig"]

POOLINGS = ("mean", "cls")


@dataclass(frozen=True)
class EncoderConfig(ConfigBase):
    """Configuration of an :class:`Encoder`.

    Attributes:
        vocab_size: ``V``.
        d_model: model width ``E``; a multiple of ``num_heads``.
        num_layers: transformer blocks.
        num_heads: attention heads ``H``.
        d_ff: feed-forward hidden width; None = ``4·E``.
        max_len: positions in the learned table (BERT: 512).
        type_vocab_size: token types (segments A/B); 0 = no token-type embedding.
        dropout: on embeddings, attention weights, feed-forward hidden and residual branches.
        norm: ``"post"`` (BERT) or ``"pre"`` (then the stack ends with ``norm_f``).
        activation: feed-forward kind (``"gelu"``, the exact erf form, in BERT).
        norm_eps: LayerNorm epsilon (BERT 1e-12).
        positions: ``"learned"`` (BERT), ``"sinusoidal"``, ``"rope"``, ``"alibi"``
            (symmetric distances), ``"relative"`` (T5's bucketed bias, bidirectional) or None.
        pooling: ``"mean"`` over real tokens or ``"cls"`` (the first token).
        pad_id: padding id, used for the mask when none is given (None: no padding).
        relative_buckets, relative_max_distance: T5's relative bias with
            ``positions="relative"`` (one bias per head, shared by every layer).
    """

    vocab_size: int
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    d_ff: int | None = None
    max_len: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    norm: str = "post"
    activation: str = "gelu"
    norm_eps: float = 1e-12
    positions: str | None = "learned"
    pooling: str = "mean"
    pad_id: int | None = 0
    relative_buckets: int = 32
    relative_max_distance: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_len"):
            self._int(name)
        self._int("d_ff", optional=True)
        self._int("type_vocab_size", minimum=0)
        self._heads(self.d_model, self.num_heads)
        self._float("dropout", low=0.0, high=1.0)
        self._float("norm_eps", low=0.0)
        self._choice("norm", NORM_PLACEMENTS)
        self._choice("activation", ACTIVATIONS)
        self._choice("positions", POSITIONS)
        self._relative()
        self._choice("pooling", POOLINGS)
        self._rope_even(self.positions, self.d_model // self.num_heads)
        self._token("pad_id", self.vocab_size)

    @property
    def ffn_dim(self) -> int:
        """Feed-forward hidden width (``d_ff`` or ``4·d_model``)."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff


class Encoder(ModelBase):
    """BERT-style encoder: token ids to contextual hidden states, and pooled embeddings.

    Args:
        config: an :class:`EncoderConfig`.

    Submodules: ``embed`` (word ``nn.Embedding``), ``pos`` (positions added to the
    embeddings, or None for RoPE/ALiBi/no positions), ``token_type`` (``nn.Embedding``, None
    when ``type_vocab_size == 0``), ``embed_norm`` (LayerNorm), ``drop``, ``blocks``
    (``nn.ModuleList`` of :class:`~qkv.nn.TransformerBlock`), ``norm_f`` (pre-norm only,
    else None). Initialised as BERT: ``N(0, 0.02²)`` weights, zero biases.

    Raises:
        TypeError: ``config`` is not an :class:`EncoderConfig`.
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        if not isinstance(config, EncoderConfig):
            raise TypeError(f"config must be an EncoderConfig, got {type(config).__name__}")
        self.config = c = config
        parts = make_positions(
            c.positions, d_model=c.d_model, d_head=c.d_model // c.num_heads,
            max_len=c.max_len, symmetric=True, num_heads=c.num_heads,
            relative_buckets=c.relative_buckets, relative_max_distance=c.relative_max_distance,
        )
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = parts.added
        self.position_limit = parts.limit  # learned table size; None: any length works
        self.rel_bias = parts.bias  # T5's relative bias (positions="relative"), else None
        self.token_type = (
            nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        )
        self.embed_norm = make_norm("layernorm", c.d_model, eps=c.norm_eps)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                c.d_model, c.num_heads, c.ffn_dim, dropout=c.dropout, activation=c.activation,
                norm=c.norm, norm_eps=c.norm_eps, **parts.attention,
            )
            for _ in range(c.num_layers)
        )
        self.norm_f = (
            make_norm("layernorm", c.d_model, eps=c.norm_eps) if c.norm == "pre" else None
        )
        init_gpt_style(self, c.num_layers)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Contextual hidden states.

        Args:
            input_ids: ``(B, S)`` token ids in ``[0, V)``.
            attention_mask: ``(B, S)`` bool or 0/1, 1 = real token; None builds it from
                ``pad_id`` (every token is real when ``pad_id`` is None).
            token_type_ids: ``(B, S)`` segment ids in ``[0, type_vocab_size)``; None = all 0.
            positions: ``(B, S)`` or ``(S,)`` positions of the tokens; default ``arange(S)``.
                Read by learned, sinusoidal and rotary positions (a shard of a longer
                sequence passes its global positions, as context parallelism does). With
                ``document_ids`` the default restarts at 0 at each document.
            document_ids: ``(B, S)`` integer ids of packed documents (each one contiguous
                run): a position attends only to its own document. ``pad_id`` then builds
                no mask (padding is a document of its own), and ``attention_mask`` is refused.

        Returns:
            ``(B, S, E)``.

        Raises:
            TypeError, ValueError: bad ids, token types or document ids (type, shape, range),
                an input (a document, when packed) beyond ``max_len`` with learned positions,
                a mask of the wrong shape, ``document_ids`` with an ``attention_mask``.
        """
        c = self.config
        B, S = check_ids("input_ids", input_ids, c.vocab_size).shape
        block_mask = None
        if document_ids is not None:
            if attention_mask is not None:
                raise ValueError(
                    "document_ids (packed rows) cannot be combined with an attention_mask: "
                    "give padding a document id of its own instead of masking it"
                )
            block_mask, positions = packed_inputs(document_ids, positions, B, S)
        positions = check_positions(positions, B, S, max_len=self.position_limit)
        if positions is None:
            check_length("input_ids", S, 0, self.position_limit)
        mask = None
        if attention_mask is not None:
            mask = padding_keep_mask("attention_mask", attention_mask, B, S)
        elif c.pad_id is not None and block_mask is None:  # packed: the documents separate
            mask = (input_ids != c.pad_id)[:, None, None, :]  # (B, 1, 1, S)

        h = add_positions(self.pos, self.embed(input_ids), positions=positions,
                          checked=True)  # (B, S, E)
        h = h + self._token_types(token_type_ids, B, S)
        h = self.drop(self.embed_norm(h))
        if self.rel_bias is not None:  # computed once, every block adds it to its scores
            mask = combine(self.rel_bias(S, S, dtype=h.dtype), mask)  # (B|1, H, S, S) float
        for block in self.blocks:
            h = block(h, mask=mask, positions=positions, block_mask=block_mask)  # (B, S, E)
        return h if self.norm_f is None else self.norm_f(h)

    def _token_types(self, token_type_ids: Tensor | None, B: int, S: int) -> Tensor | float:
        """Token-type embeddings ``(B, S, E)`` (type 0 ``(E,)`` when no ids are given)."""
        if self.token_type is None:
            if token_type_ids is not None:
                raise ValueError("token_type_ids given but this encoder has type_vocab_size=0")
            return 0.0
        if token_type_ids is None:
            return self.token_type.weight[0]  # (E,), broadcast over (B, S)
        check_ids("token_type_ids", token_type_ids, self.config.type_vocab_size)
        if tuple(token_type_ids.shape) != (B, S):
            raise ValueError(
                f"token_type_ids must have the shape of input_ids ({B}, {S}), got "
                f"{tuple(token_type_ids.shape)}"
            )
        return self.token_type(token_type_ids)  # (B, S, E)

    def pool(
        self, hidden: Tensor, attention_mask: Tensor | None = None, *, pooling: str | None = None
    ) -> Tensor:
        """One vector per sequence.

        Args:
            hidden: ``(B, S, E)`` from :meth:`forward`.
            attention_mask: ``(B, S)`` bool or 0/1 (1 = real token) for mean pooling; None =
                every position is real.
            pooling: ``"mean"`` or ``"cls"``; None uses ``config.pooling``.

        Returns:
            ``(B, E)``: the mean of the real tokens' states (a row with no real token gives
            zeros), or the first token's state.

        Raises:
            TypeError, ValueError: ``hidden`` not ``(B, S, E)``, a mask of the wrong shape,
                an unknown ``pooling``.
        """
        pooling = self.config.pooling if pooling is None else pooling
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if not isinstance(hidden, Tensor) or hidden.dim() != 3 or (
            hidden.shape[2] != self.config.d_model
        ):
            got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
            raise ValueError(f"hidden must have shape (B, S, E={self.config.d_model}), got {got}")
        if pooling == "cls":
            return hidden[:, 0]  # (B, E)
        B, S, _ = hidden.shape
        if attention_mask is None:
            return hidden.mean(dim=1)  # (B, E)
        keep = padding_keep_mask("attention_mask", attention_mask, B, S)[:, 0, 0, :, None]
        weights = keep.to(hidden.dtype)  # (B, S, 1)
        total = (hidden * weights).sum(dim=1)  # (B, E)
        return total / weights.sum(dim=1).clamp_min(1.0)  # (B, E)
