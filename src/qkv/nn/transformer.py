"""Drop-ins for ``torch.nn.TransformerEncoder``, ``TransformerDecoder`` and ``Transformer``.

The stacks run deep copies of one layer in turn and apply an optional final norm; the
``Transformer`` is an encoder stack whose output (the *memory*) every decoder layer attends
to (Vaswani et al., 2017, Fig. 1). Names, defaults, ``state_dict`` keys and initialisation are
torch's.

torch's encoder has a nested-tensor path (``enable_nested_tensor``): when it takes it, padded
positions come out as zeros (before the final norm). qkv never builds nested tensors, but it
decides exactly as torch does whether torch *would* take that path
(:meth:`TransformerEncoder.why_not_nested`) and then zeroes the same positions, so outputs
equal torch's at every position, padded ones included, and a decoder reading the memory reads
the same values.

TorchScript is not supported (``torch.jit.script`` fails on the layers, see
:mod:`qkv.nn.transformer_layers`); ``torch.export.export`` and ``torch.compile`` are the
supported ways to capture these modules. Under export torch's encoder does not take its nested
path (with ``mask_check``, or parameters that need grad), and qkv decides the same way.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.mha_masks import check_types
from qkv.nn.transformer_layers import (
    Activation,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
    check_decoder_masks,
    check_encoder_masks,
    check_src_tgt,
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


def _first_layer(stack: nn.Module, cls: type) -> nn.Module | None:
    """The first layer of ``stack`` when it is a qkv stack of qkv ``cls`` layers (whose
    heads and layout are known, so masks can be checked before running), else None."""
    ours = isinstance(stack, (TransformerEncoder, TransformerDecoder)) and len(stack.layers)
    return stack.layers[0] if ours and isinstance(stack.layers[0], cls) else None


def _clones(layer: nn.Module, num_layers: int) -> nn.ModuleList:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be a non-negative int, got {num_layers!r}")
    return nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))


def _is_relu_or_gelu(activation: object) -> bool:
    """torch's ``activation_relu_or_gelu`` test: ``F.relu``/``F.gelu`` or a ReLU/GELU module."""
    return (activation is F.relu or activation is F.gelu
            or isinstance(activation, (nn.ReLU, nn.GELU)))


def _why_not_nested_layer(layer: nn.Module) -> str:
    """Why torch's ``TransformerEncoder.__init__`` turns its nested path off for ``layer``.

    The same checks, in the same order and words, as torch's; ``""`` when none applies.
    """
    if not isinstance(layer, (TransformerEncoderLayer, nn.TransformerEncoderLayer)):
        return "encoder_layer was not TransformerEncoderLayer"
    attn = layer.self_attn
    if layer.norm_first:
        return "encoder_layer.norm_first was True"
    if not attn.batch_first:
        return "encoder_layer.self_attn.batch_first was not True"
    if not attn._qkv_same_embed_dim:
        return "encoder_layer.self_attn._qkv_same_embed_dim was not True"
    if attn.in_proj_bias is None:
        return "encoder_layer.self_attn was passed bias=False"
    if not _is_relu_or_gelu(layer.activation):
        return "encoder_layer.activation_relu_or_gelu was not True"
    if layer.norm1.eps != layer.norm2.eps:
        return "encoder_layer.norm1.eps was not equal to encoder_layer.norm2.eps"
    if attn.num_heads % 2 == 1:
        return "encoder_layer.self_attn.num_heads is odd"
    return ""


def _keep(src_key_padding_mask: Tensor) -> Tensor:
    """torch's ``_canonical_mask(kpm).logical_not()``: True where a bool mask is False, or where
    a float mask is exactly 0 (any other float value counts as padding on the nested path)."""
    if src_key_padding_mask.dtype == torch.bool:
        return ~src_key_padding_mask
    return src_key_padding_mask == 0


class TransformerEncoder(nn.Module):
    """A stack of ``num_layers`` deep copies of ``encoder_layer``, then ``norm`` if given.

    torch's nested-tensor path, reproduced: when ``enable_nested_tensor`` is on and torch would
    convert the batch to a nested tensor (eval mode, ``batch_first``, post-norm, ReLU/GELU,
    even heads, a ``src_key_padding_mask`` and no ``mask``, no gradient needed, ...: the full
    list is :meth:`why_not_nested`), each sequence keeps its first ``L_n`` positions
    (``L_n`` = its count of non-padding positions) and the output is zero at positions
    ``>= L_n`` before ``norm``, as torch's ``to_padded_tensor(0.)`` gives. Real positions are
    unchanged by this (they never see padded keys); only padded positions differ from the
    general path, where they keep computed values. Unlike torch, qkv does not warn at
    construction when the layer rules the nested path out.

    Args:
        encoder_layer: the layer to copy (a :class:`TransformerEncoderLayer` or any module
            with its ``forward`` signature); every copy starts with the same parameters.
        num_layers: number of copies, in ``self.layers``.
        norm: optional final module (usually a LayerNorm) applied to the output.
        enable_nested_tensor: reproduce torch's nested-tensor path (see above). The attribute
            ``use_nested_tensor`` says whether the layer allows it, as in torch.
        mask_check: as torch: check that the padding mask is left-aligned (padding only at
            the end) before taking the nested path. With ``mask_check=False`` and a mask that
            is not left-aligned, torch (and so qkv) keeps the first ``L_n`` positions of
            each sequence, whichever positions the mask marks.

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
        # torch's attribute: whether the layer allows the nested path.
        self.use_nested_tensor = enable_nested_tensor and not _why_not_nested_layer(encoder_layer)
        self.mask_check = mask_check

    def why_not_nested(
        self, src: Tensor, mask: Tensor | None, src_key_padding_mask: Tensor | None
    ) -> str:
        """Why torch's ``TransformerEncoder.forward`` would not take its nested path here.

        torch's checks in torch's order (``why_not_sparsity_fast_path``), each in torch's
        words; ``""`` means torch would convert to nested tensors, and :meth:`forward` zeroes
        the padded positions.
        """
        if not torch.backends.mha.get_fastpath_enabled():
            return "torch.backends.mha.get_fastpath_enabled() was not True"
        if not getattr(self, "use_nested_tensor", False) or not len(self.layers):
            return "self.use_nested_tensor (set in init) was not True"
        first = self.layers[0]
        if first.training:
            return "self.layers[0] was in training mode"
        if src.dim() != 3:
            return f"input not batched; expected src.dim() of 3 but got {src.dim()}"
        if src_key_padding_mask is None:
            return "src_key_padding_mask was None"
        if tuple(src_key_padding_mask.shape) != tuple(src.shape[:2]):
            return "src_key_padding_mask is not (N, S)"  # qkv's: the layers raise the error
        if self.mask_check and torch.compiler.is_compiling():
            return "mask_check enabled with torch.compile or torch.export"
        if self.mask_check:
            keep = _keep(src_key_padding_mask)  # (N, S)
            if bool((keep[:, 1:] > keep[:, :-1]).any()):  # a real position after padding
                return ("mask_check enabled, and src and src_key_padding_mask was not left "
                        "aligned")
        if src.is_nested:
            return "NestedTensor input is not supported"
        if mask is not None:
            return "src_key_padding_mask and mask were both supplied"
        if torch.is_autocast_enabled():
            return "autocast is enabled"
        attn = first.self_attn
        tensor_args = (
            src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
            attn.out_proj.bias, first.norm1.weight, first.norm1.bias, first.norm2.weight,
            first.norm2.bias, first.linear1.weight, first.linear1.bias, first.linear2.weight,
            first.linear2.bias,
        )
        devices = ["cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name]
        if torch.overrides.has_torch_function(tensor_args):
            return "some Tensor argument has_torch_function"
        if src.device.type not in devices:
            return f"src device is neither one of {devices}"
        if torch.is_grad_enabled() and any(x.requires_grad for x in tensor_args):
            return ("grad is enabled and at least one of query or the input/output projection "
                    "weights or biases requires_grad")
        return ""

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
            Same shape as ``src``; zero at padded positions (before ``norm``) where torch's
            nested path would run (see the class docstring).

        Raises:
            TypeError, ValueError: as :func:`~qkv.nn.transformer_layers.check_encoder_masks`
                (a ``mask`` of an integer dtype included), named ``mask`` and
                ``src_key_padding_mask``.
        """
        # 0) the arguments, named as this method names them, before anything reads them
        first = _first_layer(self, TransformerEncoderLayer)
        if first is not None:
            check_encoder_masks(first, src, mask, src_key_padding_mask,
                                names=("mask", "src_key_padding_mask"))  # fmt: skip
        else:
            check_types({"src": src}, {"mask": mask,
                                        "src_key_padding_mask": src_key_padding_mask})
        keep = None  # (N, S): the positions the nested path keeps, when torch would take it
        if not self.why_not_nested(src, mask, src_key_padding_mask):
            # 1) torch keeps the first L_n positions of each sequence, L_n = real positions.
            lengths = _keep(src_key_padding_mask).sum(dim=1, keepdim=True)  # (N, 1)
            keep = torch.arange(src.shape[1], device=src.device) < lengths  # (N, S)
            src_key_padding_mask = ~keep  # (N, S): the same keys hidden as on the nested path
        is_causal = _is_causal_mask(mask, is_causal)
        out = src
        for layer in self.layers:
            out = layer(
                out, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                is_causal=is_causal,
            )
        if keep is not None:
            # 2) to_padded_tensor(0.): zeros after each sequence's kept prefix.
            out = out.masked_fill(~keep[..., None], 0.0)  # (N, S, E)
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

        Raises:
            TypeError, ValueError: as :func:`~qkv.nn.transformer_layers.check_decoder_masks`
                (a ``tgt_mask`` of an integer dtype included).
        """
        masks = {"tgt_mask": tgt_mask, "memory_mask": memory_mask,
                 "tgt_key_padding_mask": tgt_key_padding_mask,
                 "memory_key_padding_mask": memory_key_padding_mask}  # fmt: skip
        first = _first_layer(self, TransformerDecoderLayer)
        if first is not None:
            check_decoder_masks(first, tgt, memory, masks)
        else:
            check_types({"tgt": tgt, "memory": memory}, masks)
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
            TypeError: non-tensor inputs; masks that are neither bool nor floating (torch
                refuses them too, some only deep inside ``torch.full``).
            ValueError: ``src`` and ``tgt`` of different ranks, batch sizes or devices, a
                last dimension other than ``d_model``, masks of the wrong shape or device
                (each message names this method's argument); and the errors of the layers.
        """
        # 1) inputs: tensors of one rank, one batch size, width d_model, on one device
        check_src_tgt(src, tgt, batch_first=self.batch_first, d_model=self.d_model)
        # 2) masks, under this method's names (the stacks would name them mask, ...)
        self._check_masks(src, tgt, {
            "src_mask": src_mask, "src_key_padding_mask": src_key_padding_mask,
            "tgt_mask": tgt_mask, "memory_mask": memory_mask,
            "tgt_key_padding_mask": tgt_key_padding_mask,
            "memory_key_padding_mask": memory_key_padding_mask,
        })  # fmt: skip
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

    def _check_masks(self, src: Tensor, tgt: Tensor, masks: dict[str, Tensor | None]) -> None:
        """Check every mask under :meth:`forward`'s names: shapes too where the stacks are
        qkv's (the memory then has ``src``'s shape), else types, dtypes and devices."""
        enc = _first_layer(self.encoder, TransformerEncoderLayer)
        dec = _first_layer(self.decoder, TransformerDecoderLayer)
        names = list(masks)
        if enc is not None:
            check_encoder_masks(enc, src, masks["src_mask"], masks["src_key_padding_mask"],
                                names=("src_mask", "src_key_padding_mask"))  # fmt: skip
            names = names[2:]
        if dec is not None and enc is not None:
            check_decoder_masks(dec, tgt, src, {n: masks[n] for n in names})
            names = []
        check_types({"src": src}, {n: masks[n] for n in names})

    @staticmethod
    def generate_square_subsequent_mask(
        sz: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        """Float causal mask ``(sz, sz)``; see :func:`generate_square_subsequent_mask`."""
        return generate_square_subsequent_mask(sz, device=device, dtype=dtype)
