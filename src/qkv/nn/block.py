"""The transformer block: attention, optional cross-attention, feed-forward; residuals and norms.

Each sublayer sits in a residual branch with a normalisation, after the sum (post-norm, the
original Transformer, BERT) or before the sublayer (pre-norm, GPT-2, Llama, ViT; Xiong et al.,
2020, "On Layer Normalization in the Transformer Architecture"):

    post-norm:  x = norm(x + dropout(sublayer(x)))
    pre-norm:   x = x + dropout(sublayer(norm(x)))

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
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from qkv.attention.flex_blocks import BlockMask
from qkv.nn.attention import Attention
from qkv.nn.cache import LayerKVCache
from qkv.nn.feedforward import make_feedforward
from qkv.nn.hooks import HookPoint
from qkv.nn.norms import make_norm
from qkv.nn.rope import RotaryEmbedding

__all__ = ["NORM_PLACEMENTS", "TransformerBlock"]

NORM_PLACEMENTS = ("post", "pre")


def _post_norm(x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module) -> Tensor:
    return norm(x + sublayer(x))  # (B, T, E)


def _pre_norm(x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module) -> Tensor:
    return x + sublayer(norm(x))  # (B, T, E)


_RESIDUALS = {"post": _post_norm, "pre": _pre_norm}


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
        alibi: ALiBi biases in the self-attention.
        alibi_symmetric: ALiBi with ``-|i - j|`` distances (encoders).

    Submodules: ``self_attn`` (:class:`Attention`), ``attn_norm``, ``cross_attn`` and
    ``cross_norm`` (None without cross-attention), ``ffn`` (``FeedForward`` with
    ``linear1``/``linear2`` or ``SwiGLU`` with ``gate_proj``/``up_proj``/``down_proj``),
    ``ffn_norm``, ``dropout`` (on the residual branches).

    Raises:
        ValueError: unknown ``norm``, ``norm_kind`` or ``activation``; bad sizes or dropout
            (from the sublayers, naming the argument).
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
        alibi: bool = False,
        alibi_symmetric: bool = False,
    ) -> None:
        super().__init__()
        if norm not in NORM_PLACEMENTS:
            raise ValueError(f"norm must be one of {NORM_PLACEMENTS}, got {norm!r}")
        self.norm = norm
        self._residual = _RESIDUALS[norm]
        attn = {"d_head": d_head, "bias": bias, "dropout": dropout}
        self.self_attn = Attention(
            d_model, num_heads, num_kv_heads=num_kv_heads, rope=rope, alibi=alibi,
            alibi_symmetric=alibi_symmetric, **attn,
        )
        self.attn_norm = make_norm(norm_kind, d_model, eps=norm_eps, bias=bias)
        self.cross_attn: Attention | None = None
        self.cross_norm: nn.Module | None = None
        if cross_attention:
            self.cross_attn = Attention(d_model, num_heads, **attn)
            self.cross_norm = make_norm(norm_kind, d_model, eps=norm_eps, bias=bias)
        self.ffn = make_feedforward(activation, d_model, d_ff, dropout=dropout, bias=bias)
        self.ffn_norm = make_norm(norm_kind, d_model, eps=norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)
        # Identity hook points on the residual stream (see the module docstring).
        self.hook_resid_pre, self.hook_attn_out = HookPoint(), HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_cross_out: HookPoint | None = HookPoint() if cross_attention else None
        self.hook_resid_cross: HookPoint | None = HookPoint() if cross_attention else None
        self.hook_ffn_out, self.hook_resid_post = HookPoint(), HookPoint()

    def extra_repr(self) -> str:
        return f"norm={self.norm!r}, cross_attention={self.cross_attn is not None}"

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
            return self.dropout(self.hook_attn_out(out))

        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(self._residual(x, self_attention, self.attn_norm))
        if self.cross_attn is not None:
            cross_attn, hook_out = self.cross_attn, self.hook_cross_out
            assert hook_out is not None and self.hook_resid_cross is not None

            def cross_attention(h: Tensor) -> Tensor:
                out, _ = cross_attn(h, context, mask=context_mask, cache=cache)
                return self.dropout(hook_out(out))

            x = self.hook_resid_cross(self._residual(x, cross_attention, self.cross_norm))

        def feed_forward(h: Tensor) -> Tensor:
            return self.dropout(self.hook_ffn_out(self.ffn(h)))

        return self.hook_resid_post(self._residual(x, feed_forward, self.ffn_norm))
