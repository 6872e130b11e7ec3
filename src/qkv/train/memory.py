"""Memory levers of a training run: activation checkpointing per block, and bfloat16's cost.

**Activation checkpointing** (``TrainConfig.checkpoint_activations``). A block's forward pass
keeps its intermediate tensors (attention scores or their log-sum-exp, the feed-forward's
``(B, T, d_ff)`` hidden activations, the norms' inputs, dropout masks) until backward needs
them, so the memory of a training step grows with ``num_layers * B * T * (E + d_ff + ...)``.
With checkpointing each block keeps only its input ``(B, T, E)``; backward runs the block's
forward again, then its backward. Memory per block falls to one residual stream, at the price
of one more forward pass per step (about a third more compute).

:func:`checkpointed_blocks` applies it for the duration of a ``with`` statement, to each
element of the model's outermost ``nn.ModuleList`` s, the same units FSDP gathers one at a time
(:mod:`qkv.distributed.dp_model`): ``blocks`` of :class:`~qkv.models.DecoderLM`,
:class:`~qkv.models.Encoder` and :class:`~qkv.models.ViT`, ``encoder_blocks`` and
``decoder_blocks`` of :class:`~qkv.models.Seq2SeqTransformer` and
:class:`~qkv.models.SpeechSeq2Seq`. It gives each block an instance ``forward`` that calls the
class's own through :func:`torch.utils.checkpoint.checkpoint` (non-reentrant: safe under DDP
and FSDP2, with gradient accumulation and with keyword arguments; the random state is saved
and restored around the recomputation, so dropout draws the same masks twice and the results
equal the plain forward's). Nothing about the parameters changes, so ``state_dict`` names and
saved checkpoints are those of the plain model, and the instance ``forward`` is deleted again
on exit. Only a block in training mode with gradients enabled checkpoints: evaluation
(``model.eval()``, :func:`torch.no_grad`) and generation run the plain forward. Hooks inside
a block (:mod:`qkv.inspect`'s hook points) fire twice per step while it is on.

**bfloat16 autocast** (``TrainConfig.bf16``) halves the activations autocast stores, but on a
CPU whose oneDNN has no bfloat16 kernels (an AVX2-only CPU) every bfloat16 matmul is emulated
and training gets slower, not faster: :func:`bf16_note` says so in one line.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["bf16_note", "checkpointed_blocks", "native_bf16", "transformer_blocks"]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of ``model``'s outermost ``nn.ModuleList`` s, in module order.

    Args:
        model: any module (a DDP wrapper too: its ``module``'s blocks are found).

    Returns:
        the blocks: for a qkv model, its transformer blocks; ``[]`` when it has no
        ``nn.ModuleList``.
    """
    blocks: list[nn.Module] = []
    taken: set[int] = set()  # modules inside a block already found: not blocks themselves
    for sub in model.modules():
        if id(sub) in taken or not isinstance(sub, nn.ModuleList):
            continue
        for block in sub:
            blocks.append(block)
            taken.update(id(m) for m in block.modules())
    return blocks


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's ``forward`` while checkpointed: the class's own forward, through
    :func:`~torch.utils.checkpoint.checkpoint` when training with gradients, else directly.
    Bound to the block with :class:`types.MethodType`, so a deep copy of the model (FSDP's
    working copy) binds it to the copied block."""
    forward = type(self).forward.__get__(self)
    if self.training and torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)


@contextmanager
def checkpointed_blocks(model: nn.Module, enabled: bool = True) -> Iterator[list[nn.Module]]:
    """Inside, each block of ``model`` (:func:`transformer_blocks`) recomputes its
    activations in backward instead of storing them (see the module docstring).

    Args:
        model: the module being trained (or its DDP wrapper, or its FSDP-sharded copy).
        enabled: False = do nothing (the blocks run as they are).

    Yields:
        the checkpointed blocks (``[]`` when not ``enabled``).

    Raises:
        ValueError: ``model`` has no blocks (no ``nn.ModuleList``), or a block already has a
            ``forward`` of its own (set on the instance, e.g. checkpointed already).
    """
    if not enabled:
        yield []
        return
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(
            f"checkpoint_activations=True checkpoints each element of the model's outermost "
            f"nn.ModuleList (a qkv model's blocks), got a {type(model).__name__} with none"
        )
    for block in blocks:
        if "forward" in vars(block):
            raise ValueError(
                f"checkpoint_activations=True: a {type(block).__name__} block of "
                f"{type(model).__name__} already has a forward of its own (set on the "
                "instance; checkpointed already?), expected the class's"
            )
    try:
        for block in blocks:
            block.forward = types.MethodType(_checkpointed_forward, block)
        yield blocks
    finally:
        for block in blocks:
            vars(block).pop("forward", None)


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bfloat16 matmuls run on kernels of their own on ``device``.

    On a CPU: oneDNN's own answer (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512
    or AVX2-VNNI-2 CPUs; it follows ``ONEDNN_MAX_CPU_ISA``), or, where torch lacks it, an
    AVX-512 ``torch.backends.cpu.get_cpu_capability()``. Other devices: True (nothing to say).
    """
    if torch.device(device).type != "cpu":
        return True
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if supported is not None:
        try:
            return bool(supported())
        except RuntimeError:
            pass
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def bf16_note(device: str | torch.device = "cpu") -> str | None:
    """The one line to print before training with ``bf16`` on ``device``, or None.

    bfloat16 autocast runs everywhere; on a CPU without native bfloat16 kernels
    (:func:`native_bf16`) it is much slower than float32 (``benchmarks/train_memory.py``:
    3.1-3.6x per step on an AMD EPYC held to AVX2, where checkpointing cost 1.0-1.4x and
    saved more memory), so the line says so and what to do instead.
    """
    if native_bf16(device):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"note: bf16 on this CPU ({capability}, no native bfloat16 kernels) is emulated: "
        "training runs, but about 3x slower than float32 (3.1-3.6x measured on an AMD EPYC "
        "held to AVX2, benchmarks/train_memory.py); checkpoint_activations "
        "(--checkpoint-activations) saves more memory at less cost"
    )
