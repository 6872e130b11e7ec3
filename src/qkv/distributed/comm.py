"""Communication pieces of context-parallel attention, on ``torch.distributed``.

Nothing here is home-made transport: the ring exchange is ``torch.distributed.batch_isend_irecv``
(point-to-point, asynchronous, so the next block travels while this one is computed) and the
head exchange is ``torch.distributed.all_to_all_single``. Both work on gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RingExchange", "all_to_all", "require_group", "world"]


def require_group(group: dist.ProcessGroup | None = None) -> None:
    """Raise a clear error when no process group is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context-parallel attention needs an initialised torch.distributed process group: "
            "launch with `torchrun --nproc-per-node N ...` and call "
            "torch.distributed.init_process_group() (backend 'gloo' on CPU, 'nccl' on GPU)"
        )


def world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` inside ``group`` (the world by default)."""
    require_group(group)
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group, rank_in_group: int) -> int:
    """The global rank of ``rank_in_group``, as point-to-point ops need it."""
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)


class RingExchange:
    """Send tensors to the next rank and receive the previous rank's, asynchronously.

    ``start(tensors, shapes)`` posts the sends of ``tensors`` to rank ``r + 1`` and receives of
    tensors of ``shapes`` from rank ``r - 1``; ``wait()`` returns the received tensors.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        rank, size = world(group)
        self.next = _peer(group, (rank + 1) % size)
        self.prev = _peer(group, (rank - 1) % size)
        self._reqs: list = []
        self._recv: list[Tensor] = []

    def start(self, tensors: list[Tensor], like: list[tuple[tuple[int, ...], Tensor]]) -> None:
        """Post sends of ``tensors`` and receives shaped ``like`` = [(shape, dtype source)]."""
        self._recv = [src.new_empty(shape) for shape, src in like]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in self._recv]
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for req in self._reqs:
            req.wait()
        self._reqs = []
        return self._recv


def all_to_all(
    x: Tensor, send_splits: list[int], recv_splits: list[int], group=None
) -> Tensor:
    """Differentiable ``all_to_all_single`` over dimension 0.

    Rank ``r`` sends rows ``send_splits[j]`` (in order) to rank ``j`` and receives
    ``recv_splits[j]`` rows from rank ``j``. The backward pass is the reverse exchange.
    """
    return _AllToAll.apply(x, tuple(send_splits), tuple(recv_splits), group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None


def _exchange(x: Tensor, send_splits, recv_splits, group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *tuple(x.shape[1:])))
    dist.all_to_all_single(
        out, x, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits),
        group=group,
    )
    return out
