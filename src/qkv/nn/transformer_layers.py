"""Drop-ins for ``torch.nn.TransformerEncoderLayer`` and ``torch.nn.TransformerDecoderLayer``.

Each sublayer (self-attention, cross-attention, feed-forward) sits in a residual branch with a
LayerNorm, after it (post-norm, the original Transformer) or before it (pre-norm,
``norm_first=True``; Xiong et al., 2020, "On Layer Normalization in the Transformer
Architecture", Fig. 1):

    post-norm:  x = norm(x + sublayer(x))        pre-norm:  x = x + sublayer(norm(x))

Attention is :class:`qkv.nn.MultiheadAttention`. Submodule names, ``state_dict`` keys and
initialisation are torch's, so weights load both ways; masks follow torch's polarity
(bool True = may *not* attend; float masks are added). torch's inference fast path is not
copied: one code path computes the same values.

TorchScript is not supported: ``torch.jit.script`` fails on these modules (the sublayers are
closures, annotations use ``X | None``, and attention dispatches in Python). Capture them with
``torch.export.export`` (tested to equal eager) or compile them with ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.errors import DropInArgumentError, DropInTypeError
from qkv.nn.mha_masks import check_mask, check_types
from qkv.nn.multihead import MultiheadAttention

__all__ = [
    "TransformerDecoderLayer",
    "TransformerEncoderLayer",
    "check_decoder_masks",
    "check_encoder_masks",
    "check_src_tgt",
]

Activation = str | Callable[[Tensor], Tensor]


def _activation(activation: Activation) -> Callable[[Tensor], Tensor]:
    """``"relu"``/``"gelu"`` to torch's functions; a callable (or module) unchanged."""
    if isinstance(activation, str):
        if activation == "relu":
            return F.relu
        if activation == "gelu":
            return F.gelu
        raise ValueError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")
    if not callable(activation):
        raise TypeError(
            f"activation must be 'relu', 'gelu' or a callable, got {type(activation).__name__}"
        )
    return activation


def _check_width(name: str, x: object, d_model: int) -> None:
    if not isinstance(x, Tensor):
        raise DropInTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3) or x.shape[-1] != d_model:
        raise DropInArgumentError(
            f"{name} must be (L, N, E), (N, L, E) or unbatched (L, E) with E = d_model = "
            f"{d_model}, got shape {tuple(x.shape)}"
        )


def _dims(x: Tensor, batch_first: bool) -> tuple[bool, int, int]:
    """``(batched, N, L)`` of a ``(L, N, E)``, ``(N, L, E)`` or unbatched ``(L, E)`` input."""
    if x.dim() == 2:
        return False, 1, x.shape[0]
    N, L = (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])
    return True, N, L


def check_src_tgt(src: object, tgt: object, *, batch_first: bool, d_model: int) -> None:
    """``Transformer.forward``'s inputs: tensors of one rank (2 or 3), one batch size, last
    dimension ``d_model``, on one device.

    Raises:
        TypeError: a non-tensor; ValueError: anything else that does not fit (both shapes
            in the message).
    """
    check_types({"src": src, "tgt": tgt}, {})
    assert isinstance(src, Tensor) and isinstance(tgt, Tensor)
    got = f"got src {tuple(src.shape)} and tgt {tuple(tgt.shape)}"
    batch_dim = 0 if batch_first else 1
    if src.dim() != tgt.dim() or src.dim() not in (2, 3):
        raise DropInArgumentError(f"src and tgt must both be batched (3-D) or both unbatched "
                                  f"(2-D), {got}")  # fmt: skip
    if src.dim() == 3 and src.shape[batch_dim] != tgt.shape[batch_dim]:
        raise DropInArgumentError(f"src and tgt must have the same batch size (dimension "
                                  f"{batch_dim}), {got}")  # fmt: skip
    if src.shape[-1] != d_model or tgt.shape[-1] != d_model:
        raise DropInArgumentError(f"src and tgt must have last dimension d_model={d_model}, "
                                  f"{got}")  # fmt: skip
    if src.device != tgt.device:
        raise DropInArgumentError(f"src and tgt must be on one device, got src on "
                                  f"{src.device} and tgt on {tgt.device}")  # fmt: skip


def check_encoder_masks(
    layer: TransformerEncoderLayer, src: Tensor, mask: Tensor | None,
    src_key_padding_mask: Tensor | None, *, names: tuple[str, str] = ("src_mask",
                                                                       "src_key_padding_mask"),
) -> None:  # fmt: skip
    """Check an encoder's ``src`` and masks under the caller's argument names.

    Raises:
        TypeError, ValueError: a ``src`` that is not ``(S, N, E)``/``(N, S, E)``/``(S, E)``
            with ``E = d_model``; a mask that is not bool/float, not on ``src``'s device, or
            not ``(S, S)``/``(N·H, S, S)`` (``mask``) or ``(N, S)`` (padding).
    """
    attn = layer.self_attn
    _check_width("src", src, attn.embed_dim)
    batched, N, S = _dims(src, attn.batch_first)
    dims = {"batched": batched, "N": N, "H": attn.num_heads, "T": S, "S": S,
            "device": src.device}  # fmt: skip
    check_mask(names[0], mask, kind="attn", **dims)
    check_mask(names[1], src_key_padding_mask, kind="padding", **dims)


def check_decoder_masks(
    layer: TransformerDecoderLayer, tgt: Tensor, memory: Tensor,
    masks: dict[str, Tensor | None],
) -> None:  # fmt: skip
    """Check a decoder's ``tgt``, ``memory`` and masks; ``masks`` maps each of the caller's
    argument names to its mask, in the order ``tgt_mask``, ``memory_mask``,
    ``tgt_key_padding_mask``, ``memory_key_padding_mask``.

    Raises:
        TypeError, ValueError: inputs that are not tensors of width ``d_model``, ``tgt`` and
            ``memory`` of different ranks, batch sizes or devices; masks as
            :func:`check_encoder_masks` (``tgt_mask (T, T)``, ``memory_mask (T, S)``,
            paddings ``(N, T)`` and ``(N, S)``).
    """
    attn = layer.self_attn
    _check_width("tgt", tgt, attn.embed_dim)
    _check_width("memory", memory, attn.embed_dim)
    batched, N, T = _dims(tgt, attn.batch_first)
    batched_m, N_m, S = _dims(memory, attn.batch_first)
    if batched != batched_m or N != N_m or tgt.device != memory.device:
        raise DropInArgumentError(
            f"tgt and memory must have the same batch size N (or both be unbatched) and one "
            f"device, got tgt {tuple(tgt.shape)} on {tgt.device} and memory "
            f"{tuple(memory.shape)} on {memory.device}"
        )
    dims = {"batched": batched, "N": N, "H": attn.num_heads, "device": tgt.device}
    sizes = [("attn", T, T), ("attn", T, S), ("padding", T, T), ("padding", T, S)]
    for (name, mask), (kind, q, k) in zip(masks.items(), sizes, strict=True):
        check_mask(name, mask, kind=kind, T=q, S=k, **dims)


def _residual(
    x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module, norm_first: bool
) -> Tensor:
    """``x + sublayer(norm(x))`` (pre-norm) or ``norm(x + sublayer(x))`` (post-norm)."""
    if norm_first:
        return x + sublayer(norm(x))
    return norm(x + sublayer(x))


def _feed_forward_modules(
    d_model: int, dim_feedforward: int, dropout: float, bias: bool, kw: dict
) -> tuple[nn.Linear, nn.Dropout, nn.Linear]:
    """``linear1``, ``dropout``, ``linear2``, created in torch's order (same initial values)."""
    linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **kw)
    linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **kw)
    return linear1, nn.Dropout(dropout), linear2


def _feed_forward(layer: nn.Module, x: Tensor) -> Tensor:
    """``linear2(dropout(activation(linear1(x))))``: ``(..., E) -> (..., E)``."""
    return layer.linear2(layer.dropout(layer.activation(layer.linear1(x))))


class TransformerEncoderLayer(nn.Module):
    """Self-attention then feed-forward, each with a residual and a LayerNorm.

    Args (torch's names and defaults):
        d_model: model width ``E``.
        nhead: attention heads ``H``; must divide ``d_model``.
        dim_feedforward: hidden width of the feed-forward block.
        dropout: dropout on attention weights, after each sublayer and inside the feed-forward.
        activation: ``"relu"``, ``"gelu"`` or a unary callable.
        layer_norm_eps: LayerNorm epsilon.
        batch_first: ``(N, S, E)`` instead of ``(S, N, E)``.
        norm_first: pre-norm instead of post-norm.
        bias: biases in every Linear and LayerNorm.
        device, dtype: for the parameters.

    Submodules: ``self_attn``, ``linear1``, ``dropout``, ``linear2``, ``norm1``, ``norm2``,
    ``dropout1``, ``dropout2`` (torch's ``state_dict`` keys).

    Raises:
        ValueError: a string activation other than ``"relu"``/``"gelu"``, bad sizes.
        TypeError: an activation that is not callable.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, **kw
        )
        self.linear1, self.dropout, self.linear2 = _feed_forward_modules(
            d_model, dim_feedforward, dropout, bias, kw
        )
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = _activation(activation)

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Encode ``src``.

        Args:
            src: ``(S, N, E)``, ``(N, S, E)`` with ``batch_first``, or ``(S, E)``.
            src_mask: ``(S, S)`` or ``(N·H, S, S)``; bool True = may not attend, or float added.
            src_key_padding_mask: ``(N, S)`` (``(S,)`` unbatched); bool True = padding.
            is_causal: hint that ``src_mask`` is the causal mask (needs ``src_mask``).

        Returns:
            Same shape as ``src``.

        Raises:
            TypeError, ValueError: as :meth:`MultiheadAttention.forward`, and a ``src`` whose
                last dimension is not ``d_model``; mask errors name this method's arguments
                (:func:`check_encoder_masks`).
        """
        check_encoder_masks(self, src, src_mask, src_key_padding_mask)

        def self_attention(x: Tensor) -> Tensor:
            out = self.self_attn(
                x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                need_weights=False, is_causal=is_causal,
            )[0]
            return self.dropout1(out)

        x = _residual(src, self_attention, self.norm1, self.norm_first)
        return _residual(
            x, lambda h: self.dropout2(_feed_forward(self, h)), self.norm2, self.norm_first
        )


class TransformerDecoderLayer(nn.Module):
    """Self-attention, cross-attention to ``memory``, then feed-forward; residuals and norms.

    Args: as :class:`TransformerEncoderLayer` (torch's names and defaults).

    Submodules: ``self_attn``, ``multihead_attn``, ``linear1``, ``dropout``, ``linear2``,
    ``norm1``, ``norm2``, ``norm3``, ``dropout1``, ``dropout2``, ``dropout3``.

    Raises:
        ValueError, TypeError: as :class:`TransformerEncoderLayer`.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        attention = {"dropout": dropout, "batch_first": batch_first, "bias": bias, **kw}
        self.self_attn = MultiheadAttention(d_model, nhead, **attention)
        self.multihead_attn = MultiheadAttention(d_model, nhead, **attention)
        self.linear1, self.dropout, self.linear2 = _feed_forward_modules(
            d_model, dim_feedforward, dropout, bias, kw
        )
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.activation = _activation(activation)

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """Decode ``tgt`` attending to ``memory``.

        Args:
            tgt: ``(T, N, E)``, ``(N, T, E)`` with ``batch_first``, or ``(T, E)``.
            memory: ``(S, N, E)``, ``(N, S, E)`` or ``(S, E)``: the encoder output.
            tgt_mask: ``(T, T)`` or ``(N·H, T, T)``; bool True = may not attend, or float.
            memory_mask: ``(T, S)`` or ``(N·H, T, S)``.
            tgt_key_padding_mask: ``(N, T)`` (``(T,)`` unbatched); bool True = padding.
            memory_key_padding_mask: ``(N, S)`` (``(S,)`` unbatched).
            tgt_is_causal, memory_is_causal: hints that the masks are causal (need the mask).

        Returns:
            Same shape as ``tgt``.

        Raises:
            TypeError, ValueError: as :meth:`MultiheadAttention.forward`, inputs whose last
                dimension is not ``d_model``, ``tgt`` and ``memory`` of different batch sizes;
                mask errors name this method's arguments (:func:`check_decoder_masks`).
        """
        check_decoder_masks(self, tgt, memory, {
            "tgt_mask": tgt_mask, "memory_mask": memory_mask,
            "tgt_key_padding_mask": tgt_key_padding_mask,
            "memory_key_padding_mask": memory_key_padding_mask,
        })  # fmt: skip

        def self_attention(x: Tensor) -> Tensor:
            out = self.self_attn(
                x, x, x, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask,
                need_weights=False, is_causal=tgt_is_causal,
            )[0]
            return self.dropout1(out)

        def cross_attention(x: Tensor) -> Tensor:
            out = self.multihead_attn(
                x, memory, memory, attn_mask=memory_mask,
                key_padding_mask=memory_key_padding_mask, need_weights=False,
                is_causal=memory_is_causal,
            )[0]
            return self.dropout2(out)

        x = _residual(tgt, self_attention, self.norm1, self.norm_first)
        x = _residual(x, cross_attention, self.norm2, self.norm_first)
        return _residual(
            x, lambda h: self.dropout3(_feed_forward(self, h)), self.norm3, self.norm_first
        )
