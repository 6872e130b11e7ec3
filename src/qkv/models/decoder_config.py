"""The configuration of :class:`~qkv.models.decoder_lm.DecoderLM`: one frozen record, checked
before anything is built, and its GPT-2 and Llama presets. Its serialised field names are
those of every checkpoint written so far; :attr:`DecoderLMConfig.attention` gathers the
attention options into one :class:`~qkv.nn.options.AttentionOptions`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkv.models.config import ACTIVATIONS, NORM_KINDS, NORM_PLACEMENTS, POSITIONS, ConfigBase
from qkv.nn.options import AttentionOptions
from qkv.nn.rope_scaling import RopeScaling

__all__ = ["DecoderLMConfig"]


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
        attention_options: further :class:`~qkv.nn.options.AttentionOptions` fields by name
            (a JSON object), for options without a field above; :attr:`attention` is the
            record every layer is built with.
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
    attention_options: dict[str, Any] | None = None

    @property
    def attention(self) -> AttentionOptions:
        """The attention options of every layer (a layer's window apart), as one record."""
        return AttentionOptions.build(
            scale=self.attn_scale, softcap=self.attn_softcap, qk_norm=self.qk_norm,
            norm_eps=self.norm_eps, **(self.attention_options or {}),
        )

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

    def _check_attention_options(self) -> None:
        """``attention_options``: further :class:`AttentionOptions` fields by name, for the
        options that have no config field of their own (those that do are refused here)."""
        extra = self.attention_options
        if extra is None:
            return
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            self._fail("attention_options", "None or a dict of AttentionOptions fields", extra)
        own = {"scale": "attn_scale", "softcap": "attn_softcap", "qk_norm": "qk_norm",
               "norm_eps": "norm_eps", "window": "window", "alibi": "positions='alibi'",
               "alibi_symmetric": "positions='alibi'"}
        taken = sorted(k for k in extra if k in own)
        if taken:
            self._fail("attention_options", "no " + ", ".join(taken) + " (set " + ", ".join(
                own[k] for k in taken) + " instead)", extra)
        try:
            self.attention  # noqa: B018 - validates the fields
        except (TypeError, ValueError) as e:
            raise ValueError(f"attention_options: {e}") from None

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
        self._check_attention_options()
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
