"""Convert qkv's torch drop-ins to and from the ``torch.nn`` modules they replace.

    torch_layer = qkv.nn.to_torch(qkv_layer)        # a torch.nn.TransformerEncoderLayer
    qkv_mha = qkv.nn.from_torch(torch.nn.MultiheadAttention(64, 8))

Pairs: :class:`~qkv.nn.MultiheadAttention` <-> ``torch.nn.MultiheadAttention``, and
``TransformerEncoderLayer``, ``TransformerDecoderLayer``, ``TransformerEncoder``,
``TransformerDecoder``, ``Transformer`` (qkv's, in :mod:`qkv.nn.transformer_layers` and
:mod:`qkv.nn.transformer`) <-> torch's classes of the same names. The drop-ins keep torch's
constructor arguments, submodule names and ``state_dict`` keys, so a conversion is: read the
constructor arguments back from the module (widths from the parameters, ``dropout`` from the
``Dropout`` modules, ``layer_norm_eps`` from the norms, ...), build the other class with them on
the same device and dtype, then ``load_state_dict(strict=True)`` (a copy: the two modules share
no tensors) and the same ``training`` mode. Outputs are then equal, forward and backward (the
tests hold them to 1e-10 in float64).

A qkv-only extra with no torch equivalent is refused by name (``num_kv_heads`` != ``num_heads``:
torch's ``MultiheadAttention`` has no grouped-query heads).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

from qkv.nn.errors import DropInArgumentError, DropInTypeError
from qkv.nn.multihead import MultiheadAttention
from qkv.nn.transformer import Transformer, TransformerDecoder, TransformerEncoder
from qkv.nn.transformer_layers import TransformerDecoderLayer, TransformerEncoderLayer

__all__ = ["from_torch", "to_torch"]


def _factory(module: nn.Module) -> dict:
    """``device`` and ``dtype`` of the module's first parameter (torch's defaults if none)."""
    p = next(module.parameters(), None)
    return {} if p is None else {"device": p.device, "dtype": p.dtype}


def _finish(source: nn.Module, target: nn.Module) -> nn.Module:
    """Copy the weights (strict: every key must match) and the training mode."""
    target.load_state_dict(source.state_dict(), strict=True)
    return target.train(source.training)


def _mha(source: nn.Module, target_cls: type) -> nn.Module:
    """A multi-head attention module of ``target_cls`` built from ``source``'s arguments."""
    H = source.num_heads
    Hkv = getattr(source, "num_kv_heads", H)
    if Hkv != H and target_cls is nn.MultiheadAttention:
        raise DropInArgumentError(
            f"cannot convert qkv.nn.MultiheadAttention with num_kv_heads={Hkv} (grouped-query "
            f"heads) != num_heads={H} to torch.nn.MultiheadAttention, which has none"
        )
    target = target_cls(
        source.embed_dim, H, dropout=source.dropout, bias=source.in_proj_bias is not None,
        add_bias_kv=source.bias_k is not None, add_zero_attn=source.add_zero_attn,
        kdim=source.kdim, vdim=source.vdim, batch_first=source.batch_first, **_factory(source),
    )
    return _finish(source, target)


def _activation(layer: nn.Module) -> Callable | nn.Module:
    """The layer's activation: the function itself, or a copy of an activation module."""
    act = layer.activation
    return copy.deepcopy(act) if isinstance(act, nn.Module) else act


def _layer(source: nn.Module, target_cls: type) -> nn.Module:
    """An encoder or decoder layer of ``target_cls`` built from ``source``'s arguments."""
    attn = source.self_attn
    target = target_cls(
        attn.embed_dim, attn.num_heads, dim_feedforward=source.linear1.out_features,
        dropout=source.dropout.p, activation=_activation(source), layer_norm_eps=source.norm1.eps,
        batch_first=attn.batch_first, norm_first=source.norm_first,
        bias=source.linear1.bias is not None, **_factory(source),
    )
    return _finish(source, target)


def _layers_of(source: nn.Module, convert_layer: Callable) -> tuple[nn.Module, int]:
    """The converted first layer of a stack and the layer count (each layer must be of one
    class, as the stack's deep copies are; their weights come with ``load_state_dict``)."""
    layers = list(source.layers)
    if not layers:
        raise DropInArgumentError(f"cannot convert a {type(source).__name__} with no layers")
    kinds = {type(layer) for layer in layers}
    if len(kinds) > 1:
        names = sorted(k.__name__ for k in kinds)
        raise DropInArgumentError(
            f"cannot convert a {type(source).__name__} whose layers are of several classes "
            f"{names}"
        )
    return convert_layer(layers[0]), len(layers)


def _same_activations(source: nn.Module, target: nn.Module) -> nn.Module:
    """Give each of the stack's layers its source layer's activation again.

    The stacks deep-copy their layer, and ``torch.nn.TransformerDecoderLayer.__setstate__``
    puts ``F.relu`` in the copy's ``__dict__`` when the activation is a module (it looks for
    it in the state, where a module is not), so a torch decoder built from a layer with
    ``nn.GELU()`` runs ReLU. Re-assigning makes the converted stack compute what the source
    computes, in both directions.
    """
    for src_layer, tgt_layer in zip(source.layers, target.layers, strict=True):
        if tgt_layer.activation is not src_layer.activation:
            tgt_layer.activation = _activation(src_layer)
    return target


def _encoder(source: nn.Module, target_cls: type, layer_to: Callable) -> nn.Module:
    layer, n = _layers_of(source, layer_to)
    norm = copy.deepcopy(source.norm)
    nested = {"enable_nested_tensor": getattr(source, "enable_nested_tensor", True),
              "mask_check": getattr(source, "mask_check", True)}
    target = _same_activations(source, target_cls(layer, n, norm, **nested))
    return _finish(source, target)


def _decoder(source: nn.Module, target_cls: type, layer_to: Callable) -> nn.Module:
    layer, n = _layers_of(source, layer_to)
    target = target_cls(layer, n, copy.deepcopy(source.norm))
    return _finish(source, _same_activations(source, target))


def _transformer(source: nn.Module, target_cls: type, convert: Callable) -> nn.Module:
    encoder, decoder = convert(source.encoder), convert(source.decoder)
    target = target_cls(
        source.d_model, source.nhead, custom_encoder=encoder, custom_decoder=decoder,
        batch_first=source.batch_first, **_factory(source),
    )
    return _finish(source, target)


def to_torch(module: nn.Module) -> nn.Module:
    """The ``torch.nn`` module equivalent to a qkv drop-in, with a copy of its weights.

    Args:
        module: a qkv ``MultiheadAttention``, ``TransformerEncoderLayer``,
            ``TransformerDecoderLayer``, ``TransformerEncoder``, ``TransformerDecoder`` or
            ``Transformer``.

    Returns:
        The torch module of the same name: same constructor arguments, device, dtype,
        ``state_dict`` (values copied) and training mode.

    Raises:
        DropInTypeError: (a ``TypeError``) any other module.
        DropInArgumentError: (a ``ValueError``) a qkv extra torch lacks (``num_kv_heads``), a
            stack with no layers or with layers of several classes.
    """
    if isinstance(module, MultiheadAttention):
        return _mha(module, nn.MultiheadAttention)
    if isinstance(module, TransformerEncoderLayer):
        return _layer(module, nn.TransformerEncoderLayer)
    if isinstance(module, TransformerDecoderLayer):
        return _layer(module, nn.TransformerDecoderLayer)
    if isinstance(module, TransformerEncoder):
        return _encoder(module, nn.TransformerEncoder, to_torch)
    if isinstance(module, TransformerDecoder):
        return _decoder(module, nn.TransformerDecoder, to_torch)
    if isinstance(module, Transformer):
        return _transformer(module, nn.Transformer, to_torch)
    raise DropInTypeError(
        f"to_torch converts qkv.nn.{', '.join(_NAMES)}; got {type(module).__module__}."
        f"{type(module).__name__}"
    )


def from_torch(module: nn.Module) -> nn.Module:
    """The qkv drop-in equivalent to a ``torch.nn`` module, with a copy of its weights.

    Args:
        module: a ``torch.nn.MultiheadAttention``, ``TransformerEncoderLayer``,
            ``TransformerDecoderLayer``, ``TransformerEncoder``, ``TransformerDecoder`` or
            ``Transformer`` (or a subclass: its extra behaviour is not carried over).

    Returns:
        The ``qkv.nn`` module of the same name, as :func:`to_torch` describes.

    Raises:
        DropInTypeError: (a ``TypeError``) any other module (qkv modules included: use
            :func:`to_torch` for those).
        DropInArgumentError: (a ``ValueError``) a stack with no layers or with layers of
            several classes.
    """
    if isinstance(module, nn.MultiheadAttention):
        return _mha(module, MultiheadAttention)
    if isinstance(module, nn.TransformerEncoderLayer):
        return _layer(module, TransformerEncoderLayer)
    if isinstance(module, nn.TransformerDecoderLayer):
        return _layer(module, TransformerDecoderLayer)
    if isinstance(module, nn.TransformerEncoder):
        return _encoder(module, TransformerEncoder, from_torch)
    if isinstance(module, nn.TransformerDecoder):
        return _decoder(module, TransformerDecoder, from_torch)
    if isinstance(module, nn.Transformer):
        return _transformer(module, Transformer, from_torch)
    raise DropInTypeError(
        f"from_torch converts torch.nn.{', '.join(_NAMES)}; got {type(module).__module__}."
        f"{type(module).__name__}"
    )


_NAMES = (
    "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer",
    "TransformerEncoder", "TransformerDecoder", "Transformer",
)
