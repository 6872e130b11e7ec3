"""How to run a model and where its token sequences live, for traces, plots and the viewer.

Models are told apart by their parts, not their class: an encoder-decoder has
``encoder_blocks`` and ``decoder_blocks`` (:class:`~qkv.models.Seq2SeqTransformer`); every
other qkv model has one ``blocks`` stack (:class:`~qkv.models.DecoderLM`,
:class:`~qkv.models.Encoder`, :class:`~qkv.models.ViT`). A *stack* knows the module that embeds
its tokens and which token sequence (source or target) its layers' queries and keys belong to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Stack", "key_side", "query_side", "run_model", "stack_of", "stacks"]


@dataclass(frozen=True)
class Stack:
    """One stack of transformer blocks.

    Attributes:
        prefix: the blocks' module name (``"blocks"``, ``"encoder_blocks"``,
            ``"decoder_blocks"``); attention layers are ``{prefix}.{i}.self_attn`` etc.
        blocks: the ``nn.ModuleList`` of blocks.
        embed: the module embedding its tokens (an ``nn.Embedding`` or ViT's patch
            ``Conv2d``), or None.
        side: ``"source"`` (the model's input) or ``"target"`` (a decoder's input).
    """

    prefix: str
    blocks: nn.ModuleList
    embed: nn.Module | None
    side: str


def is_encoder_decoder(model: nn.Module) -> bool:
    return hasattr(model, "encoder_blocks") and hasattr(model, "decoder_blocks")


def stacks(model: nn.Module) -> list[Stack]:
    """The model's stacks, source side first.

    Raises:
        ValueError: a model with neither ``blocks`` nor ``encoder_blocks``/``decoder_blocks``.
    """
    if is_encoder_decoder(model):
        return [
            Stack("encoder_blocks", model.encoder_blocks, getattr(model, "src_embed", None),
                  "source"),
            Stack("decoder_blocks", model.decoder_blocks, getattr(model, "tgt_embed", None),
                  "target"),
        ]  # fmt: skip
    if isinstance(getattr(model, "blocks", None), nn.ModuleList):
        embed = getattr(model, "embed", None) or getattr(model, "patch_embed", None)
        return [Stack("blocks", model.blocks, embed, "source")]
    raise ValueError(
        f"{type(model).__name__} has no `blocks` (or `encoder_blocks` and `decoder_blocks`) "
        "stack of qkv.nn.TransformerBlock"
    )


def stack_of(model: nn.Module, layer_name: str) -> Stack:
    """The stack an attention layer (``decoder_blocks.1.cross_attn``) belongs to.

    Raises:
        ValueError: a name outside every stack.
    """
    for stack in stacks(model):
        if layer_name.startswith(stack.prefix + "."):
            return stack
    raise ValueError(f"{layer_name!r} is in none of the model's block stacks")


def query_side(layer_name: str) -> str:
    """``"target"`` for a decoder's layers (``decoder_blocks.*`` in qkv's models,
    ``decoder.layers.*`` in the torch-style :class:`qkv.nn.Transformer`), else ``"source"``."""
    return "target" if layer_name.startswith(("decoder_blocks.", "decoder.")) else "source"


def _torch_style_seq2seq(model: nn.Module) -> bool:
    """A :class:`qkv.nn.Transformer`-like model: ``encoder`` and ``decoder`` stacks, run as
    ``model(src, tgt)``."""
    return all(isinstance(getattr(model, n, None), nn.Module) for n in ("encoder", "decoder"))


def key_side(layer_name: str, kind: str) -> str:
    """Keys of a cross-attention come from the source; others from the queries' side."""
    return "source" if kind == "cross" else query_side(layer_name)


def run_model(
    model: nn.Module, inputs: Any, target: Any = None, kwargs: dict[str, Any] | None = None
) -> Any:
    """Run ``model`` the way its kind is run: ``model(src, tgt_in)`` for an encoder-decoder
    (qkv's, or the torch-style :class:`qkv.nn.Transformer`; only ``model.encode(src)`` when
    ``target`` is None for qkv's), else ``model(inputs, **kwargs)``
    (``kwargs`` such as ``attention_mask`` and ``positions`` of a padded batch).

    Raises:
        ValueError: a ``target`` for a model without a decoder.
    """
    kwargs = kwargs or {}
    if target is not None and _torch_style_seq2seq(model):
        return model(inputs, target, **kwargs)
    if is_encoder_decoder(model):
        return model.encode(inputs, **kwargs) if target is None else model(inputs, target, **kwargs)
    if target is not None:
        raise ValueError(f"target= is only for encoder-decoder models, not {type(model).__name__}")
    return model(inputs, **kwargs)
