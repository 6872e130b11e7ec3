"""Data parallelism, the module side: DDP or FSDP2 around a module, gradient sync, full state.

* :func:`wrap_ddp`: :class:`~torch.nn.parallel.DistributedDataParallel`; every rank holds the
  whole module and gradients are averaged across ranks in the backward pass.
* :func:`shard_fsdp`: FSDP2 (:func:`torch.distributed.fsdp.fully_shard`) in place: each
  element of an ``nn.ModuleList`` (a transformer block) is one unit, the root holds the rest
  (embeddings, tied heads, final norm); parameters, gradients and optimizer state are split
  across ranks, each unit gathered just for its forward and backward.
* :func:`broadcast_module`: rank 0's weights on every rank (both wrappers start from them).
* :func:`gradient_sync`: skip the gradient reduction on micro-batches but the last.
* :func:`full_model_state`, :func:`full_optimizer_state`, :func:`load_optimizer_state`: whole
  tensors gathered from (or split into) shards, through
  :mod:`torch.distributed.checkpoint.state_dict`, so checkpoints keep one format whatever the
  number of processes.
* :func:`optimizer_state_by_name`, :func:`load_optimizer_state_by_name`: torch's
  index-keyed optimizer state of a plain module to and from the parameter-name-keyed form
  those functions use.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# torch.distributed.fsdp and .checkpoint are imported where used: they pull in DTensor and
# torch.fx's symbolic shapes (2 s), which `qkv train --help` and single-process runs never need.

__all__ = [
    "broadcast_module",
    "full_model_state",
    "full_optimizer_state",
    "gradient_sync",
    "is_fsdp",
    "load_optimizer_state",
    "load_optimizer_state_by_name",
    "optimizer_state_by_name",
    "shard_fsdp",
    "unwrap",
    "wrap_ddp",
]


def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module``, in place."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src)


def wrap_ddp(module: nn.Module, device: torch.device) -> DistributedDataParallel:
    """``module`` (already on ``device``) under DDP; it starts from rank 0's weights.

    The wrapper's ``.module`` is ``module`` itself: its parameters are the ones trained.
    """
    ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids)


def _units(module: nn.Module) -> list[nn.Module]:
    """Elements of the outermost ``nn.ModuleList`` s: the blocks FSDP gathers one at a time."""
    units: list[nn.Module] = []
    taken: set[int] = set()
    for sub in module.modules():
        if id(sub) in taken:
            continue
        if isinstance(sub, nn.ModuleList):
            for block in sub:
                units.append(block)
                taken.update(id(m) for m in block.modules())
    return units


def shard_fsdp(module: nn.Module) -> nn.Module:
    """Shard ``module`` (on the rank's device) with FSDP2 in place and return it.

    Rank 0's weights are broadcast first, so every rank starts from them. Afterwards the
    module's class is FSDP's subclass of its own and its parameters are ``DTensor`` shards;
    build the optimizer over them after this call.
    """
    from torch.distributed.fsdp import fully_shard

    broadcast_module(module)
    for unit in _units(module):
        fully_shard(unit)
    fully_shard(module)
    return module


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by :func:`shard_fsdp` (only possible once FSDP's module
    is imported, so nothing is imported to answer)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (anything else is returned as it is)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Inside, backward passes reduce gradients across ranks only if ``enabled``.

    Accumulating micro-batches: all but the last run with ``enabled=False`` (each rank sums
    its own gradients), the last with ``True`` (one reduction of the sums).
    """
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` of a sharded (or plain) ``model`` on every rank.

    Collective for a sharded model: every rank must call it.
    """
    if not is_fsdp(model):
        return unwrap(model).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole optimizer state of a sharded ``model``, keyed by parameter name, on rank 0
    (CPU tensors); ``{}`` on the other ranks. Collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:  # fmt: skip
    """Split the whole name-keyed optimizer ``state`` (the same on every rank) into the shards
    of ``optimizer``, a fresh optimizer over the sharded ``model``. Collective."""
    for p in model.parameters():
        p.grad = None  # torch sizes the shards from a state it makes with zero gradients
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, state, options=options)


def _names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter name of each of the optimizer's parameters, in its index order."""
    name_of = {id(p): n for n, p in module.named_parameters()}  # a tied weight: its first name
    try:
        return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not the module's") from None


def optimizer_state_by_name(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` of a plain ``module`` with parameter names for indices."""
    names = _names(module, optimizer)
    sd = optimizer.state_dict()
    return {
        "state": {names[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                         for g in sd["param_groups"]],
    }  # fmt: skip


def load_optimizer_state_by_name(module: nn.Module, optimizer: torch.optim.Optimizer,
                                 state: dict[str, Any]) -> None:  # fmt: skip
    """Load a name-keyed optimizer ``state`` into ``optimizer`` over the plain ``module``.

    Raises:
        ValueError: a parameter name the optimizer does not hold.
    """
    index = {n: i for i, n in enumerate(_names(module, optimizer))}
    try:
        sd = {
            "state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in state["param_groups"]],
        }  # fmt: skip
    except KeyError as err:
        raise ValueError(f"optimizer state for an unknown parameter {err}") from None
    optimizer.load_state_dict(sd)
