"""The transformer block: attention, optional cross-attention, feed-forward; residuals and norms.

Each sublayer sits in a residual branch with a normalisation, after the sum (post-norm, the
original Transformer, BERT) or before the sublayer (pre-norm, GPT-2, Llama, ViT; Xiong et al.,
2020, "On Layer Normalization in the Transformer Architecture"):

    post-norm:  x = norm(x + dropout(sublayer(x)))
    pre-norm:   x = x + dropout(sublayer(norm(x)))
    sandwich:   x = x + dropout(norm_out(sublayer(norm(x))))   (pre-norm with
                                                  ``sandwich_norm=True``: Gemma 2, CogView)

The sublayers are, in order: self-attention (:class:`~qkv.nn.attention.Attention`), then, in
an encoder-decoder's decoder, cross-attention to a context (the encoder output), then the
position-wise feed-forward (:func:`~qkv.nn.feedforward.make_feedforward`). Norms come from
:func:`~qkv.nn.norms.make_norm`. One ``dropout`` rate is used as ``torch.nn.TransformerEncoder
Layer`` uses it: on the attention weights, on the feed-forward's hidden activations and on each
residual branch.

Masks are keep masks (True = may attend) or float masks added to the scores, as everywhere in
qkv. With a :class:`~qkv.nn.cache.LayerKVCache` one cache serves the block: self-attention
appends the new keys/values, cross-attention stores the projected context once
(``set_static``) and reuses it.

Hook points (:class:`~qkv.nn.hooks.HookPoint`, ``(B, T, E)`` each): ``hook_resid_pre`` (the
block's input), ``hook_attn_out`` (the self-attention sublayer's output, before dropout and the
residual sum), ``hook_resid_mid`` (the stream after it, normalised for post-norm), with
cross-attention ``hook_cross_out`` and ``hook_resid_cross``, then ``hook_ffn_out`` and
``hook_resid_post`` (the block's output). The feed-forward's hidden activations are
``ffn.hook_hidden``; the attention's own are in ``self_attn`` / ``cross_attn``.

The attention options of :class:`~qkv.nn.attention.Attention` pass through: ``scale``, the bias
overrides ``qkv_bias`` / ``k_bias`` / ``out_bias``, ``qk_norm`` and ``softcap`` apply to self-
and cross-attention alike; ``window`` to self-attention only.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from qkv.attention.flex.blocks import BlockMask
from qkv.nn.attention import Attention
from qkv.nn.cache import LayerKVCache
from qkv.nn.dropout import Dropout
from qkv.nn.feedforward import make_feedforward
from qkv.nn.hooks import HookPoint
from qkv.nn.norms import make_norm
from qkv.nn.options import AttentionOptions
from qkv.nn.rope import RotaryEmbedding

__all__ = ["NORM_PLACEMENTS", "TransformerBlock"]

NORM_PLACEMENTS = ("post", "pre")


def _post_norm(x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module) -> Tensor:
    return norm(x + sublayer(x))  # (B, T, E)


def _pre_norm(x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module) -> Tensor:
    return x + sublayer(norm(x))  # (B, T, E)


_RESIDUALS = {"post": _post_norm, "pre": _pre_norm}


def _maybe(norm: nn.Module | None, x: Tensor) -> Tensor:
    """``norm(x)``, or ``x`` without a norm (the sublayer-output norm is optional)."""
    return x if norm is None else norm(x)  # (B, T, E)


class TransformerBlock(nn.Module):
    """Self-attention (+ cross-attention) + feed-forward, each in a normalised residual branch.

    Args:
        d_model: model width ``E``.
        num_heads: query heads ``H``.
        d_ff: hidden width of the feed-forward layer.
        num_kv_heads: key/value heads ``Hkv`` of the self-attention (grouped-query attention;
            default ``H``). Cross-attention always uses ``H`` heads.
        d_head: head width ``D`` (default ``E / H``).
        dropout: rate on attention weights, feed-forward hidden activations and residual
            branches (training mode only).
        activation: feed-forward kind: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` or
            ``"swiglu"`` (see :func:`~qkv.nn.feedforward.make_feedforward`).
        norm: ``"post"`` (normalise after each residual sum) or ``"pre"`` (normalise each
            sublayer's input).
        norm_kind: ``"layernorm"`` or ``"rmsnorm"``.
        norm_eps: epsilon of the norms.
        bias: biases in the attention projections, the feed-forward and LayerNorms.
        cross_attention: add a cross-attention sublayer (a decoder of an encoder-decoder).
        rope: rotary embedding for the self-attention (shared between blocks is fine).
        qkv_bias, k_bias, out_bias: passed to the attention sublayers (see
            :class:`~qkv.nn.attention.Attention`).
        sandwich_norm: pre-norm only: also normalise each sublayer's output before the
            residual sum (submodules ``attn_out_norm``, ``cross_out_norm``, ``ffn_out_norm``;
            Gemma 2's post-attention and post-feed-forward norms).
        options: the attention's :class:`~qkv.nn.options.AttentionOptions`, or its fields as
            keywords (``alibi``, ``alibi_symmetric``, ``scale``, ``qk_norm``, ``window``,
            ``softcap``, ...; ``qk_norm`` takes ``norm_eps`` unless given). The
            self-attention takes them all; the cross-attention all but ALiBi and the window,
            which work on positions within one sequence.

    Submodules: ``self_attn`` (:class:`Attention`), ``attn_norm``, ``cross_attn`` and
    ``cross_norm`` (None without cross-attention), ``attn_out_norm``, ``cross_out_norm`` and
    ``ffn_out_norm`` (None without ``sandwich_norm``), ``ffn`` (``FeedForward`` with
    ``linear1``/``linear2`` or ``SwiGLU`` with ``gate_proj``/``up_proj``/``down_proj``),
    ``ffn_norm``, ``dropout`` (on the residual branches).

    Raises:
        ValueError: unknown ``norm``, ``norm_kind`` or ``activation``; bad sizes or dropout
            (from the sublayers, naming the argument); ``sandwich_norm`` with post-norm.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        num_kv_heads: int | None = None,
        d_head: int | None = None,
        dropout: float = 0.0,
        activation: str = "relu",
        norm: str = "post",
        norm_kind: str = "layernorm",
        norm_eps: float = 1e-5,
        bias: bool = True,
        cross_attention: bool = False,
        rope: RotaryEmbedding | None = None,
        qkv_bias: bool | None = None,
        k_bias: bool | None = None,
        out_bias: bool | None = None,
        sandwich_norm: bool = False,
        options: AttentionOptions | None = None,
        **option_fields,
    ) -> None:
        super().__init__()
        if norm not in NORM_PLACEMENTS:
            raise ValueError(f"norm must be one of {NORM_PLACEMENTS}, got {norm!r}")
        if not isinstance(sandwich_norm, bool) or (sandwich_norm and norm != "pre"):
            raise ValueError(
                f"sandwich_norm must be a bool, True only with norm='pre'; got {sandwich_norm!r} "
                f"with norm={norm!r}"
            )
        self.norm = norm
        self._residual = _RESIDUALS[norm]
        if options is None and "norm_eps" not in option_fields:
            option_fields["norm_eps"] = norm_eps  # qk_norm follows the block's norms
        opts = AttentionOptions.build(options, **option_fields)
        attn = {"d_head": d_head, "bias": bias, "dropout": dropout, "qkv_bias": qkv_bias,
                "k_bias": k_bias, "out_bias": out_bias}  # fmt: skip
        self.self_attn = Attention(
            d_model, num_heads, num_kv_heads=num_kv_heads, rope=rope, options=opts, **attn,
        )

        def norm_layer() -> nn.Module:
            return make_norm(norm_kind, d_model, eps=norm_eps, bias=bias)

        def out_norm() -> nn.Module | None:
            return norm_layer() if sandwich_norm else None

        self.attn_norm = norm_layer()
        self.attn_out_norm: nn.Module | None = out_norm()
        self.cross_attn: Attention | None = None
        self.cross_norm: nn.Module | None = None
        self.cross_out_norm: nn.Module | None = None
        if cross_attention:
            self.cross_attn = Attention(d_model, num_heads, options=opts.for_cross_attention(),
                                        **attn)
            self.cross_norm = norm_layer()
            self.cross_out_norm = out_norm()
        self.ffn = make_feedforward(activation, d_model, d_ff, dropout=dropout, bias=bias)
        self.ffn_norm = norm_layer()
        self.ffn_out_norm: nn.Module | None = out_norm()
        self.sandwich_norm = sandwich_norm
        self.dropout = Dropout(dropout)
        # Identity hook points on the residual stream (see the module docstring).
        self.hook_resid_pre, self.hook_attn_out = HookPoint(), HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_cross_out: HookPoint | None = HookPoint() if cross_attention else None
        self.hook_resid_cross: HookPoint | None = HookPoint() if cross_attention else None
        self.hook_ffn_out, self.hook_resid_post = HookPoint(), HookPoint()

    def extra_repr(self) -> str:
        sandwich = ", sandwich_norm=True" if self.sandwich_norm else ""
        return f"norm={self.norm!r}, cross_attention={self.cross_attn is not None}{sandwich}"

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        context_mask: Tensor | None = None,
        cache: LayerKVCache | None = None,
        positions: Tensor | None = None,
        score_mod: Callable | None = None,
        block_mask: BlockMask | None = None,
    ) -> Tensor:
        """Run the block on ``x``.

        Args:
            x: ``(B, T, E)``.
            context: ``(B, S_ctx, E)`` for the cross-attention (required exactly when the
                block has one).
            mask: self-attention keep mask (True = may attend) or float mask, broadcastable
                to ``(B, H, T, S)`` where ``S`` counts cached keys too (e.g. padding
                ``(B, 1, 1, S)``).
            is_causal: hide later keys in the self-attention (aligned bottom-right when a
                cache holds earlier keys).
            context_mask: cross-attention mask broadcastable to ``(B, H, T, S_ctx)`` (e.g. the
                source padding ``(B, 1, 1, S_ctx)``).
            cache: this layer's cache (self-attention appends; cross-attention keys/values
                are stored once and reused).
            positions: ``(T,)`` or ``(B, T)`` integer positions for RoPE (default: after the
                cached tokens).
            score_mod: the self-attention's ``score_mod`` (:func:`qkv.flex_attention`).
            block_mask: the self-attention's block mask for ``(T, S)`` (e.g. a document mask
                for packed rows); ``is_causal`` is AND-ed into it. The cross-attention takes
                neither.

        Returns:
            ``(B, T, E)``.

        Raises:
            ValueError: a context given to a block without cross-attention or missing for one
                with it; the errors of :meth:`Attention.forward` (shapes, masks, cache).
            TypeError: as :meth:`Attention.forward`.
        """
        if (context is None) != (self.cross_attn is None):
            need = "needs a context (B, S, E)" if context is None else "takes no context"
            raise ValueError(
                f"this block {'has' if self.cross_attn is not None else 'has no'} "
                f"cross-attention, so it {need}"
            )

        def self_attention(h: Tensor) -> Tensor:
            out, _ = self.self_attn(
                h, mask=mask, is_causal=is_causal, cache=cache, positions=positions,
                score_mod=score_mod, block_mask=block_mask,
            )
            return self.dropout(self.hook_attn_out(_maybe(self.attn_out_norm, out)))

        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(self._residual(x, self_attention, self.attn_norm))
        if self.cross_attn is not None:
            cross_attn, hook_out = self.cross_attn, self.hook_cross_out
            out_norm = self.cross_out_norm
            assert hook_out is not None and self.hook_resid_cross is not None

            def cross_attention(h: Tensor) -> Tensor:
                out, _ = cross_attn(h, context, mask=context_mask, cache=cache)
                return self.dropout(hook_out(_maybe(out_norm, out)))

            x = self.hook_resid_cross(self._residual(x, cross_attention, self.cross_norm))

        def feed_forward(h: Tensor) -> Tensor:
            return self.dropout(self.hook_ffn_out(_maybe(self.ffn_out_norm, self.ffn(h))))

        return self.hook_resid_post(self._residual(x, feed_forward, self.ffn_norm))
