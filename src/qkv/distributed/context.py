"""Run a whole model with its sequence sharded across processes; say what a call costs.

:func:`context_parallel` installs a context-parallel kernel in every attention module of a
model (each :class:`~qkv.nn.core.AttentionCore`'s ``kernel``) for the duration of a ``with``
block, and makes the model see global positions:

    with context_parallel(model) as cp:
        ids = cp.shard(full_ids)             # (B, T_r): this rank's positions
        logits = model(ids)                  # (B, T_r, V), equal to those rows of one process
        full = cp.gather(logits)             # (B, T, V) on every rank

Everything that is not attention (embeddings, norms, feed-forward, the LM head) works on each
position alone, so it runs on the shard unchanged; only attention needs the other ranks. The
model's ``positions`` argument (``DecoderLM``, ``Encoder``) is filled with the shard's global
positions, so learned, sinusoidal and rotary positions are those of the full sequence, and
ALiBi uses global distances inside the kernel.

:func:`explain` reports which method serves a call and what each rank sends.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkv.attention.call import AttentionCall
from qkv.checks import is_int
from qkv.distributed.comm import world
from qkv.distributed.layout import (
    chunk_bounds,
    gather_sequence,
    local_lengths,
    sequence_positions,
    shard_sequence,
)
from qkv.distributed.ring import ring_call
from qkv.distributed.ulysses import all_to_all_call
from qkv.nn.core import AttentionCore

__all__ = ["METHODS", "ContextParallel", "ParallelPlan", "choose_method", "context_parallel",
           "explain_parallel", "traffic"]

METHODS = ("auto", "ring", "all_to_all")


def traffic(H: int, Hkv: int, D: int, Dv: int, world_size: int) -> dict[str, tuple[float, float]]:
    """Bytes each rank sends forward and backward, per position of its shard and per byte of
    element, for each method that can serve the call: ``{method: (forward, backward)}``.

    The ring sends its K/V shard ``N - 1`` times forward; backward the K/V again plus ``N``
    hops of dK/dV. All-to-all sends ``(N - 1) / N`` of Q, K, V (repeated to ``H`` heads when
    ``Hkv`` does not split) and of the output forward, and the same of their gradients backward.
    """
    N = world_size
    kv = Hkv * (D + Dv)
    out = {"ring": (float((N - 1) * kv), float((N - 1) * kv + N * kv))}
    if H % N == 0:
        heads_kv = Hkv if Hkv % N == 0 else H
        moved = (N - 1) / N * (H * D + heads_kv * (D + Dv) + H * Dv)
        out["all_to_all"] = (moved, moved)
    return out


def choose_method(
    method: str, num_heads: int, world_size: int, *, num_kv_heads: int | None = None,
    head_dim: int = 64, value_dim: int | None = None,
) -> str:
    """The method that serves a call: ``"ring"`` or ``"all_to_all"``.

    ``auto`` takes the method whose ranks send fewer bytes forward and backward together
    (:func:`traffic`; all-to-all on a tie: its local attention is one single-process call on the
    fastest kernel); all-to-all needs ``H`` divisible by the world size, the ring serves any.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "all_to_all" and num_heads % world_size:
        raise ValueError(
            f"method='all_to_all' splits H={num_heads} heads over {world_size} ranks: H must be "
            "divisible by the world size; use method='ring' or 'auto'"
        )
    if method != "auto":
        return method
    Hkv = num_heads if num_kv_heads is None else num_kv_heads
    Dv = head_dim if value_dim is None else value_dim
    volumes = traffic(num_heads, Hkv, head_dim, Dv, world_size)
    if "all_to_all" in volumes and sum(volumes["all_to_all"]) <= sum(volumes["ring"]):
        return "all_to_all"
    return "ring"


@dataclass
class ContextParallel:
    """The state of one :func:`context_parallel` block; ``shard``/``gather`` use its group."""

    group: dist.ProcessGroup | None
    method: str
    seq_dim: int
    seq_len: int | None = None  # the global length of the forward pass under way

    def shard(self, x: Tensor, dim: int | None = None) -> Tensor:
        """This rank's shard of a full tensor (:func:`~qkv.distributed.shard_sequence`)."""
        return shard_sequence(x, self.seq_dim if dim is None else dim, self.group)

    def gather(self, x: Tensor, dim: int | None = None) -> Tensor:
        """The full tensor from every rank's shard (:func:`~qkv.distributed.gather_sequence`)."""
        return gather_sequence(x, self.seq_dim if dim is None else dim, self.group)

    def kernel(self, call: AttentionCall):
        """The kernel installed in every attention module: ``(out, None)`` for ``call``."""
        _, size = world(self.group)
        chosen = choose_method(
            self.method, call.num_heads, size, num_kv_heads=call.num_kv_heads,
            head_dim=call.query.shape[-1], value_dim=call.value.shape[-1],
        )
        run = ring_call if chosen == "ring" else all_to_all_call
        return run(call, group=self.group, seq_len=self.seq_len)


@contextmanager
def context_parallel(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    method: str = "auto",
    seq_dim: int = 1,
) -> Iterator[ContextParallel]:
    """Run ``model`` with its sequence sharded over the ranks of ``group`` inside the block.

    Args:
        model: any module holding qkv attention modules (self-attention only), e.g.
            ``DecoderLM`` or ``Encoder``; called with this rank's shard of the inputs.
        group: the process group (default: the world).
        method: ``"auto"``, ``"ring"`` or ``"all_to_all"`` (see :func:`choose_method`).
        seq_dim: the sequence dimension of the model's first input (1 for ``(B, T)`` ids).

    Yields:
        a :class:`ContextParallel` with ``shard``/``gather`` for the model's inputs/outputs.

    Raises:
        RuntimeError: no process group; ValueError: a bad ``method``, or (on a forward pass)
        a KV cache, a sequence shorter than two positions per rank, or anything attention
        across ranks cannot honour (dense masks, dropout, weights).
    """
    world(group)  # a clear error without a process group
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not is_int(seq_dim):
        raise ValueError(f"seq_dim must be an int, got {seq_dim!r}")
    state = ContextParallel(group, method, seq_dim)
    cores = [m for m in model.modules() if isinstance(m, AttentionCore)]
    previous = [core.kernel for core in cores]
    takes_positions = "positions" in inspect.signature(model.forward).parameters
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: _before_forward(state, takes_positions, args, kwargs),
        with_kwargs=True,
    )
    for core in cores:
        core.kernel = state.kernel
    try:
        yield state
    finally:
        handle.remove()
        for core, kernel in zip(cores, previous, strict=True):
            core.kernel = kernel


def _before_forward(state: ContextParallel, takes_positions: bool, args, kwargs):
    """Learn the global length (one all-gather per forward) and pass global positions."""
    if kwargs.get("cache") is not None:
        raise ValueError(
            "context parallelism shards a whole sequence; it takes no KV cache (decode on one "
            "process)"
        )
    x = args[0] if args else kwargs.get("input_ids", kwargs.get("x"))
    if not isinstance(x, Tensor) or x.dim() <= state.seq_dim:
        raise ValueError(
            f"context_parallel needs the model's first input to be a tensor with a sequence "
            f"dimension {state.seq_dim}, got {type(x).__name__}"
        )
    T = sum(local_lengths(x.shape[state.seq_dim], state.group, device=x.device))
    chunk_bounds(T, world(state.group)[1])
    state.seq_len = T
    if takes_positions and kwargs.get("positions") is None:
        kwargs = {**kwargs, "positions": sequence_positions(T, state.group, device=x.device)}
    return args, kwargs


@dataclass(frozen=True)
class ParallelPlan:
    """What context-parallel attention does for one call, per rank (:func:`explain_parallel`)."""

    method: str
    reason: str
    world_size: int
    shard_len: int
    bytes_forward: int  # sent by each rank in the forward pass
    bytes_backward: int  # sent by each rank in the backward pass
    ring_bytes: tuple[int, int]
    all_to_all_bytes: tuple[int, int] | None

    def __str__(self) -> str:
        mib = 1 << 20
        lines = [
            f"context-parallel attention over {self.world_size} ranks: {self.method} "
            f"({self.reason})",
            f"  each rank holds ~{self.shard_len} positions and sends "
            f"{self.bytes_forward / mib:.2f} MiB forward, {self.bytes_backward / mib:.2f} MiB "
            "backward",
            f"  ring: {self.ring_bytes[0] / mib:.2f} + {self.ring_bytes[1] / mib:.2f} MiB "
            "(K/V round the ring; dK/dV back)",
        ]
        if self.all_to_all_bytes is not None:
            a, b = self.all_to_all_bytes
            lines.append(f"  all_to_all: {a / mib:.2f} + {b / mib:.2f} MiB (Q, K, V, out swapped"
                         " for heads)")
        else:
            lines.append("  all_to_all: not possible (H not divisible by the world size)")
        return "\n".join(lines)


def explain_parallel(
    *, B: int, H: int, Hkv: int, T: int, D: int, world_size: int,
    dtype: torch.dtype = torch.float32, method: str = "auto", Dv: int | None = None,
) -> ParallelPlan:
    """Which method serves a context-parallel call of these sizes, and its traffic per rank.

    Needs no process group. Volumes count tensor bytes sent by one rank holding the longest
    shard (:func:`traffic`).
    """
    for name, value in (("B", B), ("H", H), ("Hkv", Hkv), ("T", T), ("D", D),
                        ("world_size", world_size)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if H % Hkv:
        raise ValueError(f"H ({H}) must be a multiple of Hkv ({Hkv})")
    Dv = D if Dv is None else Dv
    N = world_size
    chunk_bounds(T, N)
    L = -(-T // (2 * N)) * 2  # the longest shard
    scale = B * L * torch.empty((), dtype=dtype).element_size()
    volumes = {m: (int(f * scale), int(b * scale)) for m, (f, b) in
               traffic(H, Hkv, D, Dv, N).items()}
    chosen = choose_method(method, H, N, num_kv_heads=Hkv, head_dim=D, value_dim=Dv)
    if method != "auto":
        reason = f"method={method!r}"
    elif "all_to_all" not in volumes:
        reason = f"auto: H={H} does not split over {N} ranks"
    else:
        reason = "auto: fewer bytes sent per rank"
    fwd, bwd = volumes[chosen]
    return ParallelPlan(chosen, reason, N, L, fwd, bwd, volumes["ring"], volumes.get("all_to_all"))
