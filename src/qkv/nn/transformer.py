"""Drop-ins for ``torch.nn.TransformerEncoder``, ``TransformerDecoder`` and ``Transformer``.

The stacks run deep copies of one layer in turn and apply an optional final norm; the
``Transformer`` is an encoder stack whose output (the *memory*) every decoder layer attends
to (Vaswani et al., 2017, Fig. 1). Names, defaults, ``state_dict`` keys and initialisation are
torch's. Unlike torch, the encoder never converts padded batches to nested tensors: padded
positions are computed like real ones, so outputs at real positions equal torch's, while at
padded positions torch's nested-tensor path (eval mode, ``batch_first``, a padding mask)
returns zeros before the final norm and qkv returns ordinary values.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.transformer_layers import (
    Activation,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
)

__all__ = [
    "Transformer",
    "TransformerDecoder",
    "TransformerEncoder",
    "generate_square_subsequent_mask",
]


def generate_square_subsequent_mask(
    sz: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """Float causal mask ``(sz, sz)``: ``-inf`` above the diagonal, ``0`` on and below it.

    Torch's polarity-free form: added to the scores it hides the keys after each query.
    ``dtype`` defaults to torch's default float dtype.

    Raises:
        ValueError: ``sz`` is not a non-negative int.
    """
    if isinstance(sz, bool) or not isinstance(sz, int) or sz < 0:
        raise ValueError(f"sz must be a non-negative int, got {sz!r}")
    return torch.full((sz, sz), float("-inf"), dtype=dtype, device=device).triu(1)  # (sz, sz)


def _is_causal_mask(mask: Tensor | None, is_causal: bool | None) -> bool:
    """torch's causal-mask detection: the hint when given, else whether ``mask`` is causal.

    A mask is causal when it is 2-D square and equals :func:`generate_square_subsequent_mask`
    (float) or its boolean form (True above the diagonal). A detected mask lets attention
    take the fused causal path; the values do not change.
    """
    if is_causal is not None:
        return is_causal is True
    if mask is None or mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        return False
    if mask.dtype == torch.bool:
        above = torch.ones(mask.shape, dtype=torch.bool, device=mask.device).triu(1)  # (L, L)
        return torch.equal(mask, above)
    causal = generate_square_subsequent_mask(len(mask), mask.device, mask.dtype)  # (L, L)
    return torch.equal(mask, causal)


def _clones(layer: nn.Module, num_layers: int) -> nn.ModuleList:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be a non-negative int, got {num_layers!r}")
    return nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))


class TransformerEncoder(nn.Module):
    """A stack of ``num_layers`` deep copies of ``encoder_layer``, then ``norm`` if given.

    Args:
        encoder_layer: the layer to copy (a :class:`TransformerEncoderLayer` or any module
            with its ``forward`` signature); every copy starts with the same parameters.
        num_layers: number of copies, in ``self.layers``.
        norm: optional final module (usually a LayerNorm) applied to the output.
        enable_nested_tensor: accepted for compatibility and stored; qkv never converts to
            nested tensors (see the module docstring for what that changes at padded positions).
        mask_check: accepted for compatibility and stored (torch uses it only on the nested
            path).

    Raises:
        ValueError: ``num_layers`` is not a non-negative int.
    """

    def __init__(
        self,
        encoder_layer: nn.Module,
        num_layers: int,
        norm: nn.Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ) -> None:
        super().__init__()
        self.layers = _clones(encoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.use_nested_tensor = False  # torch's attribute: whether the nested path is used
        self.mask_check = mask_check

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        """Encode ``src`` through every layer.

        Args:
            src: ``(S, N, E)``, ``(N, S, E)`` with ``batch_first``, or ``(S, E)``.
            mask: ``(S, S)`` or ``(N·H, S, S)``; bool True = may not attend, or float added.
            src_key_padding_mask: ``(N, S)`` (``(S,)`` unbatched); bool True = padding.
            is_causal: hint that ``mask`` is causal; ``None`` detects it from ``mask``.

        Returns:
            Same shape as ``src``.
        """
        is_causal = _is_causal_mask(mask, is_causal)
        out = src
        for layer in self.layers:
            out = layer(
                out, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                is_causal=is_causal,
            )
        return out if self.norm is None else self.norm(out)


class TransformerDecoder(nn.Module):
    """A stack of ``num_layers`` deep copies of ``decoder_layer``, then ``norm`` if given.

    Args:
        decoder_layer: the layer to copy (a :class:`TransformerDecoderLayer` or any module with
            its ``forward`` signature).
        num_layers: number of copies, in ``self.layers``.
        norm: optional final module applied to the output.

    Raises:
        ValueError: ``num_layers`` is not a non-negative int.
    """

    def __init__(
        self, decoder_layer: nn.Module, num_layers: int, norm: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.layers = _clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """Decode ``tgt`` through every layer, each attending to ``memory``.

        Args: as :meth:`TransformerDecoderLayer.forward`, except that ``tgt_is_causal=None``
        (the default) detects a causal ``tgt_mask``.

        Returns:
            Same shape as ``tgt``.
        """
        tgt_is_causal = _is_causal_mask(tgt_mask, tgt_is_causal)
        out = tgt
        for layer in self.layers:
            out = layer(
                out, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask,
                tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal,
            )
        return out if self.norm is None else self.norm(out)


class Transformer(nn.Module):
    """Encoder-decoder Transformer with the interface of ``torch.nn.Transformer``.

    Args (torch's names and defaults): ``d_model=512``, ``nhead=8``, ``num_encoder_layers=6``,
        ``num_decoder_layers=6``, ``dim_feedforward=2048``, ``dropout=0.1``,
        ``activation=F.relu`` (or ``"relu"``/``"gelu"``/a callable), ``custom_encoder`` and
        ``custom_decoder`` (modules used instead of the built stacks), ``layer_norm_eps=1e-5``,
        ``batch_first=False``, ``norm_first=False``, ``bias=True``, ``device``, ``dtype``.

    Submodules: ``encoder`` (a :class:`TransformerEncoder` with a final LayerNorm) and
    ``decoder`` (a :class:`TransformerDecoder` with a final LayerNorm). Every parameter with
    more than one dimension is re-initialised Xavier-uniform, as in torch.
    """

    def __init__(
        self,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = F.relu,
        custom_encoder: nn.Module | None = None,
        custom_decoder: nn.Module | None = None,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        layer_args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                      batch_first, norm_first, bias)
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            layer = TransformerEncoderLayer(*layer_args, **kw)
            norm = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
            self.encoder = TransformerEncoder(layer, num_encoder_layers, norm)
        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            layer = TransformerDecoderLayer(*layer_args, **kw)
            norm = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
            self.decoder = TransformerDecoder(layer, num_decoder_layers, norm)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        self.d_model = d_model
        self.nhead = nhead
        self.batch_first = batch_first

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """Encode ``src``, then decode ``tgt`` attending to the encoding.

        Args:
            src: ``(S, N, E)``, ``(N, S, E)`` with ``batch_first``, or ``(S, E)``.
            tgt: ``(T, N, E)``, ``(N, T, E)`` or ``(T, E)``.
            src_mask ``(S, S)``, tgt_mask ``(T, T)``, memory_mask ``(T, S)`` (or with a leading
                ``N·H``): bool True = may not attend, or float added to the scores.
            src_key_padding_mask ``(N, S)``, tgt_key_padding_mask ``(N, T)``,
                memory_key_padding_mask ``(N, S)``: bool True = padding.
            src_is_causal, tgt_is_causal: hints; ``None`` detects a causal mask.
            memory_is_causal: hint that ``memory_mask`` is causal.

        Returns:
            ``(T, N, E)``, ``(N, T, E)`` or ``(T, E)``, like ``tgt``.

        Raises:
            ValueError: ``src`` and ``tgt`` with different batch sizes, or a last dimension
                other than ``d_model``; and the errors of the layers.
        """
        batch_dim = 0 if self.batch_first else 1
        if src.dim() == 3 and src.shape[batch_dim] != tgt.shape[batch_dim]:
            raise ValueError(
                f"src and tgt must have the same batch size (dimension {batch_dim}), got src "
                f"{tuple(src.shape)} and tgt {tuple(tgt.shape)}"
            )
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise ValueError(
                f"src and tgt must have last dimension d_model={self.d_model}, got src "
                f"{tuple(src.shape)} and tgt {tuple(tgt.shape)}"
            )
        memory = self.encoder(
            src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
            is_causal=src_is_causal,
        )
        return self.decoder(
            tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal,
        )

    @staticmethod
    def generate_square_subsequent_mask(
        sz: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        """Float causal mask ``(sz, sz)``; see :func:`generate_square_subsequent_mask`."""
        return generate_square_subsequent_mask(sz, device=device, dtype=dtype)
