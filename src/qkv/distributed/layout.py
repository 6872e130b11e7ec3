"""The sequence layout of context-parallel attention: which positions each rank holds.

A sequence of length ``T`` is cut into ``2N`` chunks (``N`` the world size) whose lengths
differ by at most one (``torch.tensor_split``'s rule: the first ``T mod 2N`` chunks are one
longer). Rank ``r`` holds chunk ``r`` followed by chunk ``2N - 1 - r``: one early and one late
chunk, the zigzag layout of load-balanced ring attention (Brandon et al., 2023; the
ring-flash-attention project). Under a causal mask chunk ``c`` attends to ``c + 1`` chunks, so
every rank's pair attends to ``2N + 1`` chunks: equal work on every rank.

``T`` need not be a multiple of ``2N``: shards then differ in length by at most two positions
(nothing is padded). It must be at least ``2N`` so that no chunk is empty.

:func:`shard_sequence` and :func:`gather_sequence` put a full tensor into this layout and back,
and :func:`sequence_positions` gives the global positions of a rank's shard, so callers never
depend on the layout's details.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from qkv.checks import is_int
from qkv.distributed.comm import world

__all__ = [
    "agreed_lengths",
    "chunk_bounds",
    "gather_sequence",
    "local_lengths",
    "rank_chunks",
    "sequence_positions",
    "shard_index",
    "shard_sequence",
]


def chunk_bounds(T: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of the ``2N`` chunks of a length-``T`` sequence.

    Raises:
        ValueError: ``T < 2N`` (a chunk would be empty).
    """
    n = 2 * world_size
    if not is_int(T) or T < n:
        raise ValueError(
            f"context-parallel attention over {world_size} ranks needs a sequence of at least "
            f"2 x {world_size} = {n} positions (two chunks per rank), got T={T!r}"
        )
    base, extra = divmod(T, n)
    bounds, start = [], 0
    for c in range(n):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def rank_chunks(T: int, world_size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[start, end)`` chunks rank ``rank`` holds, early one first."""
    bounds = chunk_bounds(T, world_size)
    return bounds[rank], bounds[2 * world_size - 1 - rank]


def shard_index(T: int, world_size: int, rank: int, device: torch.device | None = None) -> Tensor:
    """Global positions ``(T_r,)`` (int64) of rank ``rank``'s shard, in shard order."""
    (a0, a1), (b0, b1) = rank_chunks(T, world_size, rank)
    return torch.cat([torch.arange(a0, a1, device=device), torch.arange(b0, b1, device=device)])


def _check_dim(x: Tensor, dim: int, name: str) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not is_int(dim) or not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim must be an int in [{-x.dim()}, {x.dim()}) for {name} of shape "
            f"{tuple(x.shape)}, got {dim!r}"
        )
    return dim % x.dim()


def shard_sequence(x: Tensor, dim: int, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's shard of a full sequence ``x``, in the context-parallel layout.

    Every rank passes the same full tensor; no communication happens. The result is
    differentiable (an index select).

    Args:
        x: any tensor whose dimension ``dim`` is the sequence, length ``T >= 2N``.
        dim: the sequence dimension (e.g. 1 for ``(B, T)`` ids, 2 for ``(B, H, T, D)``).
        group: the process group (default: the world).

    Returns:
        ``x`` with dimension ``dim`` cut to this rank's ``T_r`` positions.
    """
    dim = _check_dim(x, dim, "x")
    rank, size = world(group)
    index = shard_index(x.shape[dim], size, rank, x.device)
    return x.index_select(dim, index)


def sequence_positions(
    T: int, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None
) -> Tensor:
    """Global positions ``(T_r,)`` (int64) of this rank's shard of a length-``T`` sequence.

    Pass them as ``positions=`` to a model so that learned, sinusoidal and rotary positions are
    those of the full sequence.
    """
    rank, size = world(group)
    return shard_index(T, size, rank, device)


def local_lengths(length: int, group: dist.ProcessGroup | None = None, *, device=None) -> list[int]:
    """Every rank's shard length (one all-gather of one integer)."""
    _rank, size = world(group)
    if size == 1:
        return [length]
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    return [int(t) for t in every]


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def agreed_lengths(name: str, call, seq_len: int | None,
                   group: dist.ProcessGroup | None = None) -> list[int]:
    """Every rank's shard length for a context-parallel call, checked before any exchange.

    With ``seq_len`` the lengths follow from the layout and only this rank's is checked.
    Without it one all-gather of this rank's sizes (``T_r, B, H, Hkv, D, Dv``, dtype) tells
    every rank every other's: all of them then refuse alike (nobody is left waiting in a
    send) shards whose other sizes or dtypes differ, and lengths that are not the zigzag
    layout of their sum (rank 0 holding 4 positions and rank 1 holding 3 is no layout of 7:
    ranks 0 and 1 hold 3 and 4).

    Raises:
        ValueError: naming ``name``, every rank's sizes and the expected layout.
    """
    rank, size = world(group)
    q, v, T_r = call.query, call.value, call.T
    if seq_len is not None:
        expected = _layout(seq_len, size)
        if expected[rank] != T_r:
            raise ValueError(
                f"{name}: seq_len={seq_len} over {size} ranks gives rank {rank} a shard of "
                f"{expected[rank]} positions, but its inputs hold {T_r}: shard with "
                "qkv.distributed.shard_sequence"
            )
        return expected
    if size == 1:
        return [T_r]
    code = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else len(_DTYPES)
    mine = torch.tensor([T_r, q.shape[0], q.shape[1], call.key.shape[1], q.shape[3],
                         v.shape[3], code], dtype=torch.int64, device=q.device)
    every = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    if len({tuple(r[1:]) for r in rows}) > 1:
        sizes = "; ".join(f"rank {r}: (B, H, Hkv, D, Dv) = {tuple(row[1:6])}, "
                          f"{str(_DTYPES[row[6]]) if row[6] < len(_DTYPES) else 'other'}"
                          for r, row in enumerate(rows))
        raise ValueError(f"{name}: the ranks' shards differ beyond their lengths ({sizes}); "
                         "every rank must hold a shard of the same sequence")
    lengths = [row[0] for row in rows]
    expected = _layout(sum(lengths), size)
    if lengths != expected:
        raise ValueError(
            f"{name}: the ranks hold shards of {lengths} positions, but the layout of "
            f"T={sum(lengths)} over {size} ranks gives {expected}: shard with "
            "qkv.distributed.shard_sequence"
        )
    return lengths


def _layout(T: int, size: int) -> list[int]:
    """Every rank's shard length for a length-``T`` sequence."""
    return [sum(b - a for a, b in rank_chunks(T, size, r)) for r in range(size)]


def gather_sequence(x: Tensor, dim: int, group: dist.ProcessGroup | None = None) -> Tensor:
    """The full sequence from every rank's shard: the inverse of :func:`shard_sequence`.

    Every rank receives the whole tensor. The backward pass returns this rank's slice of the
    incoming gradient, which is right when every rank computes the same function of the
    gathered tensor (the usual case: one loss over the whole sequence).

    Args:
        x: this rank's shard; dimension ``dim`` has ``T_r`` positions, the other dimensions
            are equal on every rank.
        dim: the sequence dimension.
        group: the process group (default: the world).

    Returns:
        ``x`` with dimension ``dim`` of length ``T = sum of T_r``, in sequence order.
    """
    dim = _check_dim(x, dim, "x")
    return _Gather.apply(x, dim, group)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        _rank, size = world(group)
        lengths = local_lengths(x.shape[dim], group, device=x.device)
        T = sum(lengths)
        chunk_bounds(T, size)  # refuses a sequence too short to be in the layout
        pieces = [
            x.new_empty((*x.shape[:dim], n, *x.shape[dim + 1:])) for n in lengths
        ]
        moved = x.movedim(dim, 0).contiguous()  # (T_r, ...)
        bufs = [p.movedim(dim, 0).contiguous() for p in pieces]
        if size == 1:
            bufs[0].copy_(moved)
        else:
            _all_gather_uneven(bufs, moved, group)
        index = torch.cat([shard_index(T, size, r, x.device) for r in range(size)])
        full = torch.empty((T, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        full[index] = torch.cat(bufs)  # (T, ...) in sequence order
        ctx.dim, ctx.group, ctx.T = dim, group, T
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        rank, size = world(ctx.group)
        index = shard_index(ctx.T, size, rank, grad.device)
        return grad.index_select(ctx.dim, index), None, None


def _all_gather_uneven(bufs: list[Tensor], mine: Tensor, group) -> None:
    """all_gather of first-dimension-uneven tensors: pad to the longest, then trim."""
    if mine.dtype == torch.bool:  # not every backend sends bool: travel as bytes
        got = [b.new_empty(b.shape, dtype=torch.uint8) for b in bufs]
        _all_gather_uneven(got, mine.to(torch.uint8), group)
        for b, g in zip(bufs, got, strict=True):
            b.copy_(g.bool())
        return
    longest = max(b.shape[0] for b in bufs)
    padded = mine.new_zeros((longest, *mine.shape[1:]))
    padded[: mine.shape[0]] = mine
    out = [mine.new_empty((longest, *mine.shape[1:])) for _ in bufs]
    dist.all_gather(out, padded, group=group)
    for b, o in zip(bufs, out, strict=True):
        b.copy_(o[: b.shape[0]])
