"""How :func:`~qkv.train.fit` spreads one run over the processes of a job (data parallelism).

:class:`Ranks` is the loop's only contact with :mod:`torch.distributed`. With no process
group, or a group of one, each of its methods is the plain single-process step. With a
group of ``N > 1`` ranks (``torchrun``, or your own ``init_process_group``):

1. **Same start.** Every rank is seeded with ``config.seed`` and the wrapper copies rank 0's
   weights to all, so the model starts the same everywhere even if the caller did not seed.
2. **Shares of one global batch.** Every rank draws the same global batch of
   ``config.batch_size`` (the data order is seeded) and trains on its contiguous share of the
   rows; when ``N`` does not divide ``B`` the first ``B % N`` ranks take one row more. Each
   rank's summed loss is divided by the *global* batch's target tokens and multiplied by
   ``N``; DDP and FSDP average gradients over ranks, so the step's gradient is exactly the
   single-process gradient of the whole batch, however the non-padding tokens fall. A rank
   with no rows (``B < N``) runs one row of rank 0's share with weight 0, so it still joins
   the reduction.
3. **DDP or FSDP2.** DDP by default: every rank holds the caller's module and averages
   gradients. ``config.fsdp``: a copy of the module is sharded with FSDP2 and trained, and
   the caller's module lends it its memory: its parameters are empty during training steps
   and filled with the gathered weights for each evaluation, each checkpoint and at the end
   (so a callback sees empty parameters under FSDP).
4. **Checkpoints in one format.** Rank 0 writes the gathered weights and optimizer state, as a
   single process would, plus each rank's random state; everyone waits at a barrier until the
   folder is in place. Any number of processes can resume it (weights, optimizer and data
   position do not depend on ``N``).
5. **Context parallelism** (``config.context_parallel = N > 1``): the world becomes ``W / N``
   data groups of ``N`` ranks that share each row's sequence (:mod:`qkv.train.context`); the
   rows are shared among the data groups as above among ranks, and the weight stays ``W``.
6. **One set of numbers.** The step's loss and every stop decision (a callback's, the time
   limit's) are reduced across ranks, so all ranks agree on when to evaluate, save and stop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.checkpoint import save_checkpoint
from qkv.data.tokenizers import Tokenizer
from qkv.distributed.data_parallel import (
    World,
    all_gather_json,
    all_reduce_sum,
    barrier,
    batch_rows,
    current_world,
    rank_device,
    share,
    slice_rows,
)
from qkv.distributed.dp_model import (
    full_model_state,
    full_optimizer_state,
    gradient_sync,
    load_optimizer_state,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    shard_fsdp,
    wrap_ddp,
)
from qkv.train.config import TrainConfig
from qkv.train.context import TrainMesh, check_context_world, context_mesh
from qkv.train.schedules import make_optimizer
from qkv.train.state import get_rng, rank_rng, rank_seed, set_rank_rng

__all__ = ["Ranks", "Shard", "train_device"]

# ``(batch, rank, world_size) -> that rank's part of the batch, or None when it has no rows``.
Shard = Callable[[Any, int, int], Any]


def train_device(config: TrainConfig) -> torch.device:
    """The device this process trains on: ``config.device``, ``cuda:LOCAL_RANK`` for
    ``"cuda"`` in a data-parallel run.

    Raises:
        ValueError: a device naming one GPU in a job of several processes.
    """
    return rank_device(config.device, current_world())


def default_shard(batch: Any, rank: int, size: int) -> Any:
    """Rank ``rank``'s contiguous rows of a batch of tensors (see :func:`share`), or None."""
    rows = share(batch_rows(batch), rank, size)
    return slice_rows(batch, rows) if rows.stop > rows.start else None


class Ranks:
    """The data-parallel side of one :func:`~qkv.train.fit` call (see the module docstring).

    Args:
        model: the caller's module; moved to this rank's device.
        config: the run's :class:`TrainConfig`.

    Attributes:
        world: this process's :class:`~qkv.distributed.World`.
        device: where this rank trains.
        model: the caller's module (under FSDP, filled with the weights by :meth:`sync`).
        optimizer: AdamW over ``model`` (the one that steps, except under FSDP).
        train_model, train_optimizer: what forward, backward and the step use: the module
            and ``optimizer``, DDP around the module, or the FSDP-sharded copy and its own
            optimizer; set by :meth:`start`.
    """

    def __init__(self, model: nn.Module, config: TrainConfig) -> None:
        self.world: World = current_world()
        self.device = train_device(config)
        if self.device.type == "cuda" and self.world.parallel:
            torch.cuda.set_device(self.device)
        self.config = config
        check_context_world(config.context_parallel, self.world.size)
        self.mesh = TrainMesh.plain(self.world)  # the 2-D mesh of context parallelism: start()
        self.model = model.to(self.device)
        self.optimizer = make_optimizer(self.model, config)
        self.fsdp = config.fsdp and self.world.parallel
        self.train_model: nn.Module = self.model
        self.train_optimizer: torch.optim.Optimizer = self.optimizer
        self._synced: int | None = None  # the step whose weights ``model`` holds; -1: none
        self._own_rng: dict[str, Tensor] = {}  # this rank's torch states at the last snapshot

    @property
    def parallel(self) -> bool:
        return self.world.parallel

    def seed_rank(self, seed: int, step: int = 0) -> None:
        """Switch rank ``r > 0`` to its own torch stream (:func:`rank_seed` of ``seed + step``)."""
        if self.world.rank > 0:
            torch.manual_seed(rank_seed(seed + step, self.world.rank))

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The random states a checkpoint of this moment keeps (:func:`get_rng`; in a job
        also this rank's own torch states, gathered by :meth:`save`)."""
        if self.parallel:
            self._own_rng = rank_rng(self.world.rank, self.device)
        return get_rng()

    def restore_rank_rng(self, tensors: dict[str, Tensor], seed: int, step: int) -> None:
        """After a resume: this rank's saved stream, or a fresh one of its own if the
        checkpoint was written by fewer processes."""
        if self.world.rank > 0 and not set_rank_rng(tensors, self.world.rank, self.device):
            self.seed_rank(seed, step)

    def start(self) -> None:
        """Wrap the (restored) module: DDP, or an FSDP-sharded copy with its own optimizer
        taking over ``optimizer``'s state. Collective."""
        if not self.parallel:
            return
        self.mesh = context_mesh(self.config, self.world, self.device)
        if not self.fsdp:
            self.train_model = wrap_ddp(self.model, self.device)
            return
        state = optimizer_state_by_name(self.model, self.optimizer)
        work = copy.deepcopy(self.model)
        for p in work.parameters():
            p.grad = None
        self.train_model = shard_fsdp(work)
        self.train_optimizer = make_optimizer(work, self.config)
        if state["state"]:
            load_optimizer_state(work, self.train_optimizer, state)
        self.optimizer.state.clear()  # the shards hold it now
        self.release()

    def share(self, batch: Any, shard: Shard | None,
              positions: Shard | None = None) -> tuple[Any, int]:  # fmt: skip
        """``(this rank's part of batch, weight of its summed loss)``; the weight is the world
        size (gradients are averaged over ranks), 0 for a borrowed row, 1 with one process.

        The rows are this rank's data group's share; with context parallelism ``positions``
        (``(part, rank, size) -> its shard``, see :attr:`~qkv.train.loop.Job.sequence_shard`)
        then cuts them to this rank's positions."""
        if not self.parallel:
            return batch, 1
        cut, mesh = shard or default_shard, self.mesh
        part, weight = cut(batch, mesh.data_rank, mesh.data_size), self.world.size
        if part is None:
            part, weight = cut(batch, 0, mesh.data_size), 0
        if mesh.group is not None:
            assert positions is not None, "Run refuses a job without sequence_shard"
            part = positions(part, mesh.context_rank, mesh.context_size)
        return part, weight

    def context(self) -> AbstractContextManager[Any]:
        """Inside, the model runs on this rank's sequence shards (context parallelism;
        :class:`~qkv.train.context.TrainMesh`); a no-op otherwise."""
        return self.mesh.context(self.train_model)

    def gradient_sync(self, enabled: bool) -> AbstractContextManager[None]:
        """Reduce gradients in this backward pass only if ``enabled`` (the last micro-batch)."""
        return gradient_sync(self.train_model, enabled or not self.parallel)

    def reduce(self, *values: float) -> list[float]:
        """Sums over ranks (the values themselves with one process)."""
        return all_reduce_sum(values)

    def agree(self, flag: bool) -> bool:
        """True on every rank when it is True on any rank."""
        return bool(flag) if not self.parallel else self.reduce(float(flag))[0] > 0

    def sync(self, step: int) -> None:
        """Under FSDP, fill the caller's module with the gathered weights of ``step``.
        Collective."""
        if self.fsdp and self._synced != step:
            full = full_model_state(self.train_model)
            for name, p in self.model.named_parameters():  # a tied weight: once, by its 1st name
                p.data = torch.empty_like(full[name])
            self.model.load_state_dict(full)
            self._synced = step

    def release(self) -> None:
        """Under FSDP, the caller's module gives back its parameter memory while the shards
        train (its parameters are empty until the next :meth:`sync`; buffers stay)."""
        if self.fsdp and self._synced != -1:
            for p in self.model.parameters():
                p.data = p.data.new_empty(0)
            self._synced = -1

    def save(
        self,
        path: Path,
        step: int,
        *,
        tokenizers: dict[str, Tokenizer],
        info: dict[str, Any],
        train_state: dict[str, Any] | None = None,
        rng: dict[str, Tensor] | None = None,
    ) -> None:
        """Write a checkpoint as one process would (rank 0 writes, all wait for it).

        ``train_state`` makes it a training checkpoint: optimizer, state and random states
        (``rng``: rank 0's, plus every other rank's, gathered). Collective.
        """
        self.sync(step)
        tensors: dict[str, Tensor] = {}
        if train_state is not None:
            tensors.update(rng or {})
            tensors.update(self._gather_rank_rng())
            if self.fsdp:
                full = full_optimizer_state(self.train_model, self.train_optimizer)
                if self.world.is_zero:
                    load_optimizer_state_by_name(self.model, self.optimizer, full)
        if self.world.is_zero:
            try:
                save_checkpoint(
                    path, self.model, tokenizers=tokenizers, info=info,
                    optimizer=None if train_state is None else self.optimizer,
                    train_state=train_state, train_tensors=tensors or None,
                )  # fmt: skip
            finally:
                if self.fsdp:
                    self.optimizer.state.clear()
        barrier()

    def _gather_rank_rng(self) -> dict[str, Tensor]:
        """Every rank ``r > 0``'s torch states at its last snapshot (for rank 0 to save).
        Collective."""
        if not self.parallel:
            return {}
        mine = {k: v.tolist() for k, v in self._own_rng.items()}
        out: dict[str, Tensor] = {}
        for r, states in enumerate(all_gather_json(mine)):
            if r > 0:
                out.update({k: torch.tensor(v, dtype=torch.uint8) for k, v in states.items()})
        return out

    def finish(self, step: int) -> None:
        """The caller's module gets the trained weights; the wrappers are dropped."""
        self.sync(step)
        self.train_model, self.train_optimizer = self.model, self.optimizer
