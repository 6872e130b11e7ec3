"""Data parallelism, the process-group side: who am I, which device, my share, reductions.

``torchrun`` starts one process per device and tells each its place through the environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). This module turns
that into a :class:`World`, starts the process group with a timeout (gloo on CPU, NCCL on
GPU, each rank on ``cuda:LOCAL_RANK``), splits a batch into per-rank shares and reduces
numbers and JSON-able values across ranks (never pickle: values travel as JSON bytes).

With no process group every function is the single-process identity: ``World()`` is rank 0
of 1, a share is the whole batch, a reduction returns its input, a barrier does nothing.

Wrapping a module for DDP or FSDP2 and gathering its full state: :mod:`.dp_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DEFAULT_TIMEOUT",
    "PeerError",
    "World",
    "all_gather_json",
    "all_reduce_sum",
    "backend_for",
    "barrier",
    "batch_rows",
    "current_world",
    "init_distributed",
    "is_peer_failure",
    "launched",
    "leave",
    "map_batch",
    "planned_world_size",
    "rank_device",
    "share",
    "shutdown",
    "slice_rows",
]

# Seconds a collective may wait for the other ranks before it fails (torch's own default is
# 30 minutes for gloo): long enough for rank 0 to write a checkpoint, short enough that a
# rank stuck for good ends the job.
DEFAULT_TIMEOUT = 600.0
# Seconds rank 0 waits for every rank to join (and a rank waits to reach rank 0) when the job
# starts: ``torchrun`` starts them together, so a rank missing after this long was never
# started (WORLD_SIZE too large) or cannot reach MASTER_ADDR:MASTER_PORT. QKV_RENDEZVOUS_TIMEOUT
# overrides it.
RENDEZVOUS_TIMEOUT = 120.0
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class PeerError(RuntimeError):
    """A collective failed: another rank stopped (its own error says why) or timed out."""


@dataclasses.dataclass(frozen=True)
class World:
    """One process's place in a data-parallel job.

    Attributes:
        rank: this process, ``0 <= rank < size``.
        size: processes in the job (the world size ``N``).
        local_rank: this process on its node (its GPU index).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def parallel(self) -> bool:
        """More than one process."""
        return self.size > 1

    @property
    def is_zero(self) -> bool:
        """Rank 0: the one that prints and writes files."""
        return self.rank == 0

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.size}"


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (its rendezvous variables are set)."""
    return all(k in os.environ for k in _ENV)


def current_world() -> World:
    """The :class:`World` of the initialised process group, or ``World()`` (rank 0 of 1)."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    rank, size = dist.get_rank(), dist.get_world_size()
    local = os.environ.get("LOCAL_RANK")
    local_rank = int(local) if local is not None and local.isdigit() else rank
    return World(rank, size, local_rank)


def planned_world_size() -> int | None:
    """The number of processes of this job, known before its process group starts: the
    group's size once started, else ``WORLD_SIZE`` under ``torchrun``, else 1. None when
    ``WORLD_SIZE`` is not a positive integer (:func:`init_distributed` names that error)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if not launched():
        return 1
    text = os.environ["WORLD_SIZE"]
    return int(text) if text.isdigit() and int(text) > 0 else None


def backend_for(device: str | torch.device) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` for everything else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str | torch.device, world: World) -> torch.device:
    """The device this rank trains on: ``"cuda"`` means ``cuda:LOCAL_RANK`` in a job (or
    ``cuda:0`` when each process sees a single GPU, e.g. through ``CUDA_VISIBLE_DEVICES``).

    Raises:
        ValueError: a device naming one GPU (``"cuda:1"``) in a job of several processes,
            each of which needs its own; a local rank with no GPU of its own.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or not world.parallel:
        return dev
    if dev.index is not None:
        raise ValueError(
            f"device {str(device)!r} names one GPU, but each of the {world.size} processes "
            "needs its own: pass device='cuda' (each rank then uses cuda:LOCAL_RANK)"
        )
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 1:
        return torch.device("cuda", 0)
    if visible and world.local_rank >= visible:
        raise ValueError(f"LOCAL_RANK {world.local_rank} has no GPU of its own: this node shows "
                         f"{visible}; start at most {visible} processes per node")  # fmt: skip
    return torch.device("cuda", world.local_rank)


def init_distributed(device: str | torch.device = "cpu", *,
                     timeout: float = DEFAULT_TIMEOUT) -> World:  # fmt: skip
    """Start the process group that ``torchrun`` described, if any, and return this :class:`World`.

    The backend follows the device (:func:`backend_for`); on CUDA the rank's device becomes
    the current one. Without ``torchrun``'s variables nothing starts and ``World()`` comes back;
    an already initialised group is kept.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (each rank then uses ``cuda:LOCAL_RANK``).
        timeout: seconds a collective waits for the other ranks before it fails.

    Raises:
        ValueError: a timeout that is not a positive number, a bad device (see
            :func:`rank_device`), or CUDA asked for but not available.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if dist.is_available() and dist.is_initialized():
        return current_world()
    if not launched():
        return World()
    size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    if rank >= size:
        raise ValueError(f"environment variable RANK={rank} must be below WORLD_SIZE={size} "
                         "(ranks are 0 .. WORLD_SIZE-1)")
    local = _env_int("LOCAL_RANK", 0) if "LOCAL_RANK" in os.environ else rank
    world = World(rank, size, local)
    dev = rank_device(device, world)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} asked for, but CUDA is not available")
        torch.cuda.set_device(dev)
    store = _rendezvous(rank, size, timeout)
    dist.init_process_group(backend_for(dev), store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))  # fmt: skip
    return world


def _rendezvous(rank: int, size: int, timeout: float) -> dist.Store:
    """torchrun's ``env://`` rendezvous (its agent's store, or rank 0's), bounded by
    :data:`RENDEZVOUS_TIMEOUT` instead of the collectives' ``timeout``.

    Raises:
        RuntimeError: a rank missing or unreachable, naming the variables to check.
    """
    text = os.environ.get("QKV_RENDEZVOUS_TIMEOUT")
    try:
        wait = RENDEZVOUS_TIMEOUT if text is None else float(text)
    except ValueError:
        wait = -1.0
    if not wait > 0 or not math.isfinite(wait):
        raise ValueError(f"environment variable QKV_RENDEZVOUS_TIMEOUT={text!r} must be a "
                         "number of seconds > 0")
    where = f"MASTER_ADDR:MASTER_PORT={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, size,
                                           timeout=timedelta(seconds=wait)))
    except (RuntimeError, TimeoutError) as err:  # DistStoreError, DistNetworkError, ...
        if rank == 0:
            why = (f"rank 0 waited {wait:g} s for all WORLD_SIZE={size} ranks to join at "
                   f"{where}; start every rank (torchrun --nproc-per-node={size}) or lower "
                   "WORLD_SIZE")
        else:
            why = (f"rank {rank} of WORLD_SIZE={size} could not join rank 0 at {where} within "
                   f"{wait:g} s; check that rank 0 runs and the address is reachable")
        raise RuntimeError(f"{why} (QKV_RENDEZVOUS_TIMEOUT sets the wait; {err})") from None
    store.set_timeout(timedelta(seconds=timeout))
    return store


def _env_int(name: str, minimum: int) -> int:
    """The integer environment variable ``name`` (set by torchrun), >= ``minimum``.

    Raises:
        ValueError: naming the variable, what it holds and what was expected.
    """
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} must be an integer "
                         f">= {minimum}") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def shutdown(*, together: bool = False) -> None:
    """Destroy the process group, if one is initialised.

    Args:
        together: the run ended normally: every rank first waits for the others (a barrier,
            bounded by the group's timeout), so no rank tears gloo down while another still
            talks to it (that race aborted a rank with "terminate called without an active
            exception" under load). After a failure there is no barrier: a peer may be gone.
    """
    if dist.is_available() and dist.is_initialized():
        if together:
            with contextlib.suppress(RuntimeError):
                dist.barrier()
        dist.destroy_process_group()


def leave(code: int = 0) -> NoReturn:
    """End this torchrun rank now, after :func:`shutdown`, skipping interpreter finalisation.

    Destroying the process group does not join gloo's worker threads while anything in C++
    still holds the group; a worker that frees its last work's tensors while the interpreter
    finalises must take the GIL, and CPython ends such a thread mid-destructor, which aborts
    the rank ("terminate called without an active exception", exit -6) after a run that
    succeeded (seen under load in two full test runs). Every file a run writes is written and
    closed before this point (atomic renames), so nothing is lost by not finalising; stdout,
    stderr and the logging handlers are flushed first.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because another rank died or timed out."""
    if isinstance(err, PeerError | dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out",
                            "timed out", "gloo", "NCCL", "ProcessGroup")
    )  # fmt: skip


def share(n: int, rank: int, size: int) -> slice:
    """The contiguous rows of ``rank`` among ``n`` split over ``size`` ranks.

    The first ``n % size`` ranks get one row more; a rank gets none when ``n < size``. The
    shares of ranks ``0 .. size - 1`` cover ``0 .. n - 1`` in order.
    """
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def batch_rows(batch: Any) -> int:
    """Rows (``B``, the leading size) of a tensor, or of the first tensor in a dataclass,
    tuple, list or dict of tensors.

    Raises:
        TypeError: no tensor in ``batch``.
    """
    for value in _values(batch):
        if isinstance(value, Tensor) and value.dim() > 0:
            return value.shape[0]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}: it holds no tensor")


def slice_rows(batch: Any, rows: slice) -> Any:
    """``batch`` with every tensor cut to ``rows`` along its first dimension ``B``.

    A batch is a tensor ``(B, ...)``, or a dataclass, tuple, list or dict of them (other
    values are kept as they are).
    """
    return map_batch(batch, lambda v: v[rows] if isinstance(v, Tensor) and v.dim() > 0 else v,
                     "split")  # fmt: skip


def map_batch(batch: Any, fn: Any, what: str = "map") -> Any:
    """``fn`` applied to every value of ``batch``: a tensor, or the fields of a dataclass, the
    items of a tuple, list or dict (one level).

    Raises:
        TypeError: another kind of batch (``what`` says what was being done to it).
    """
    if isinstance(batch, Tensor):
        return fn(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {f.name: fn(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
        return dataclasses.replace(batch, **fields)
    if isinstance(batch, dict):
        return {k: fn(v) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(fn(v) for v in batch)
    raise TypeError(f"cannot {what} a batch of type {type(batch).__name__}: expected a tensor "
                    "or a dataclass, tuple, list or dict of tensors")  # fmt: skip


def _values(batch: Any) -> list[Any]:
    if isinstance(batch, Tensor):
        return [batch]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    if isinstance(batch, dict):
        return list(batch.values())
    if isinstance(batch, tuple | list):
        return list(batch)
    return []


def _comm_device() -> torch.device:
    """Where tensors for a collective live: NCCL needs the rank's GPU, gloo takes the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """The sums of ``values`` over all ranks (float64), in one collective; every rank gets them."""
    if not current_world().parallel:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def all_gather_json(value: Any) -> list[Any]:
    """``[value of rank 0, value of rank 1, ...]`` on every rank; values travel as JSON.

    Raises:
        TypeError: a value that JSON cannot hold.
    """
    world = current_world()
    if not world.parallel:
        return [value]
    data = json.dumps(value, allow_nan=True).encode("utf-8")
    device = _comm_device()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world.size)]
    dist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.zeros_like(mine) for _ in range(world.size)]
    dist.all_gather(out, mine)
    pairs = zip(out, sizes, strict=True)
    return [json.loads(t[: int(n)].cpu().numpy().tobytes()) for t, n in pairs]


def barrier() -> None:
    """Wait until every rank is here (no-op without a process group)."""
    if not current_world().parallel:
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
