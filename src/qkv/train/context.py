"""Context parallelism in training: several processes share each sequence (``--context-parallel``).

Under ``torchrun`` with ``W`` processes and ``config.context_parallel = N`` (``W`` a multiple
of ``N``), the world is a 2-D device mesh
(:func:`torch.distributed.device_mesh.init_device_mesh`) of ``W / N`` data-parallel groups
by ``N`` context ranks: rank ``r`` is context rank ``r mod N`` of data group ``r // N``.

1. **Rows.** Each data group trains on its share of the global batch of ``B`` rows, exactly
   as ``W / N`` ranks of plain data parallelism would share it (:mod:`qkv.train.parallel`).
2. **Positions.** Inside a context group every rank holds the same rows and its own shard of
   every sequence, inputs and targets alike: ``(B_g, T) -> (B_g, T_r)``, ``T_r`` about
   ``T / N``, in the load-balanced layout of :mod:`qkv.distributed.layout` (one early and one
   late chunk per rank, so causal attention costs every rank the same).
3. **Attention.** The model's forward runs inside
   :func:`~qkv.distributed.context_parallel` over the context group (``config.context_method``:
   ring or all-to-all), which feeds it the shard's global positions; everything but
   attention works on each position alone and runs on the shard unchanged.
4. **Loss and gradients.** Each rank sums the loss of its own positions and divides by the
   target tokens of the whole step (weighted by ``W``: DDP averages over the whole world), so
   the losses of all ranks add up to the single-process loss. Attention's backward returns
   to every rank the gradients its keys and values received from the other ranks' queries,
   hence the gradients summed over all ranks equal one process's gradient.

Evaluation does not shard sequences: every rank evaluates its share of the validation
windows whole, as plain data parallelism does. A job opts in by giving
:attr:`~qkv.train.loop.Job.sequence_shard` (:func:`train_lm` on a token stream does).
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from qkv.distributed.context import context_parallel
from qkv.distributed.data_parallel import World, map_batch
from qkv.distributed.dp_model import unwrap
from qkv.distributed.layout import shard_index

__all__ = ["TrainMesh", "check_context_world", "context_mesh", "shard_positions"]


@dataclasses.dataclass(frozen=True)
class TrainMesh:
    """Where this rank sits in a run: its data-parallel share and its context-parallel shard.

    Attributes:
        data_rank, data_size: this rank's data group and the number of groups (the batch's
            rows are shared among ``data_size``).
        context_rank, context_size: this rank's place in its context group and the group's
            size ``N`` (1: whole sequences).
        group: the context group's process group; None without context parallelism.
        method: ``"auto"``, ``"ring"`` or ``"all_to_all"``.
    """

    data_rank: int = 0
    data_size: int = 1
    context_rank: int = 0
    context_size: int = 1
    group: Any = None
    method: str = "auto"

    def __str__(self) -> str:
        return (
            f"context parallel: {self.data_size} data-parallel group(s) x "
            f"{self.context_size} ranks sharing each sequence (method {self.method})"
        )

    @classmethod
    def plain(cls, world: World) -> TrainMesh:
        """Data parallelism alone: every rank its own rows, whole sequences."""
        return cls(data_rank=world.rank, data_size=world.size)

    def context(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Inside, ``model`` (or the module a DDP wrapper holds) runs on sequence shards over
        the context group; a no-op without context parallelism."""
        if self.group is None:
            return nullcontext()
        return context_parallel(unwrap(model), group=self.group, method=self.method)


def check_context_world(n: int, world_size: int) -> None:
    """Refuse ``--context-parallel n`` on ``world_size`` processes that cannot host it.

    Raises:
        ValueError: ``n > 1`` on one process (no ``torchrun``), or ``n`` not dividing the
            world size; the message names the flag.
    """
    if n == 1:
        return
    if world_size == 1:
        raise ValueError(
            f"--context-parallel {n} (config.context_parallel) shares each sequence among {n} "
            f"processes, but this is one process: launch with torchrun --nproc-per-node {n} "
            "(or a multiple of it)"
        )
    if world_size % n:
        fits = [d for d in range(2, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"--context-parallel {n} must divide the number of processes, {world_size}: "
            f"choose one of {fits}, or start a multiple of {n} processes"
        )


def context_mesh(config: Any, world: World, device: torch.device) -> TrainMesh:
    """The mesh of a run: ``(W / N, N)`` named ``("data", "context")``, or plain data
    parallelism when ``config.context_parallel`` is 1. Collective when ``N > 1``.

    Raises:
        ValueError: as :func:`check_context_world`.
    """
    n = config.context_parallel
    check_context_world(n, world.size)
    if n == 1:
        return TrainMesh.plain(world)
    from torch.distributed.device_mesh import init_device_mesh  # DTensor: 2 s, only here

    mesh = init_device_mesh(device.type, (world.size // n, n),
                            mesh_dim_names=("data", "context"))  # fmt: skip
    return TrainMesh(
        data_rank=mesh.get_local_rank("data"), data_size=world.size // n,
        context_rank=mesh.get_local_rank("context"), context_size=n,
        group=mesh.get_group("context"), method=config.context_method,
    )  # fmt: skip


def shard_positions(batch: Any, rank: int, size: int) -> Any:
    """Rank ``rank``'s positions (of ``size``) of every sequence in a batch.

    Every tensor of two or more dimensions is cut along dimension 1, the sequence:
    ``(B, T, ...) -> (B, T_r, ...)`` with the positions of
    :func:`~qkv.distributed.layout.shard_index` (``T_r`` is ``T / size`` give or take two).
    A batch is a dataclass (e.g. :class:`~qkv.data.LMBatch`), dict, tuple or list of tensors;
    other values are kept.

    Raises:
        ValueError: a sequence shorter than ``2 * size`` positions.
    """

    def cut(v: Any) -> Any:
        if not isinstance(v, Tensor) or v.dim() < 2:
            return v
        return v.index_select(1, shard_index(v.shape[1], size, rank, v.device))

    return map_batch(batch, cut, "cut the sequences of")
