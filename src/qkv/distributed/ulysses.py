"""All-to-all context parallelism: trade the sequence split for a head split (Ulysses).

DeepSpeed-Ulysses (Jacobs et al., 2023): each of the ``N`` ranks holds its sequence shard of
all ``H`` heads. One ``all_to_all`` per tensor turns that into the *whole* sequence for
``H / N`` heads; each rank then runs ordinary single-process attention (``auto``: the fastest
exact kernel, causal masks, ALiBi and windows as usual, since every position is present), and
one more ``all_to_all`` returns the output to the sequence split. Autograd runs through the
exchanges (their backward is the reverse exchange), so gradients need nothing extra.

Each rank sends ``(N - 1) / N`` of its query, key, value and output shards, independent of the
ring's ``N - 1`` steps; it needs ``H`` divisible by ``N``. With grouped-query attention whose
``Hkv`` is not divisible by ``N``, keys and values are repeated to ``H`` heads first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from qkv.attention.call import AttentionCall
from qkv.attention.sdpa import run_call
from qkv.distributed.comm import all_to_all, world
from qkv.distributed.layout import agreed_lengths, gather_sequence, shard_index
from qkv.distributed.ring import shard_call

__all__ = ["all_to_all_attention", "all_to_all_call"]


def all_to_all_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    group: dist.ProcessGroup | None = None,
    seq_len: int | None = None,
) -> Tensor:
    """Attention over a sequence sharded across ranks, by exchanging heads; equals one process.

    Args:
        query: ``(B, H, T_r, D)`` this rank's shard (:func:`~qkv.distributed.shard_sequence`),
            ``H`` divisible by the world size ``N``.
        key: ``(B, Hkv, T_r, D)``.
        value: ``(B, Hkv, T_r, Dv)``.
        is_causal: causal over the global sequence.
        scale: factor on ``q·k``; ``1/sqrt(D)`` when None.
        enable_gqa: ``H`` a multiple of ``Hkv``.
        group: the process group (default: the world).
        seq_len: the global length ``T``; None asks every rank (one small all-gather).

    Returns:
        ``(B, H, T_r, Dv)``: this rank's shard of the output, differentiable.

    Raises:
        ValueError: ``H`` not divisible by ``N``, shards that do not form the layout.
    """
    call = shard_call("all_to_all_attention", query, key, value, is_causal, scale, enable_gqa)
    out, _ = all_to_all_call(call, group=group, seq_len=seq_len)
    return out


def all_to_all_call(
    call: AttentionCall,
    *,
    group: dist.ProcessGroup | None = None,
    seq_len: int | None = None,
    backend: str = "auto",
) -> tuple[Tensor, None]:
    """Run a validated local call (this rank's shards) as all-to-all attention.

    Returns ``(out (B, H, T_r, Dv), None)`` like a backend.
    """
    rank, size = world(group)
    H = call.num_heads
    if H % size:
        raise ValueError(
            f"all-to-all attention splits the H={H} query heads over {size} ranks: H must be "
            "divisible by the world size (use ring attention otherwise)"
        )
    if call.dropout_p > 0.0 or call.need_weights or call.T != call.S:
        raise ValueError(
            "all-to-all context parallelism is self-attention without dropout or weights"
        )
    if call.mask is not None and call.mask.shape[2] != 1:
        raise ValueError(
            "context-parallel attention takes no mask or a key-padding mask broadcast over "
            f"queries (shape (B, 1, 1, S)); got a mask of shape {tuple(call.mask.shape)}"
        )
    lengths = agreed_lengths("all-to-all attention", call, seq_len, group)
    T = sum(lengths)
    k, v = call.key, call.value
    if k.shape[1] % size:  # grouped K/V heads that do not split: repeat them to H heads
        k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))  # (B, H, T_r, D)
    # Position of each received row: rank r's shard, in rank order, is that rank's chunks.
    order = torch.cat([shard_index(T, size, r, call.query.device) for r in range(size)])
    q_h, k_h, v_h = (_to_heads(t, lengths, order, group) for t in (call.query, k, v))
    h0, h1 = rank * H // size, (rank + 1) * H // size
    local = AttentionCall(
        query=q_h, key=k_h, value=v_h, mask=_full_mask(call.mask, H, size, rank, group),
        causal=call.causal, window=call.window,
        alibi=None if call.alibi is None else call.alibi[h0:h1], scale=call.scale,
        dropout_p=0.0, need_weights=False, batch_shape=(q_h.shape[0],),
    )
    out, _ = run_call(local, backend)  # (B, H/N, T, Dv)
    return _to_sequence(out, lengths, order, rank, group), None


def _to_heads(x: Tensor, lengths: list[int], order: Tensor, group) -> Tensor:
    """``(B, Hx, T_r, D)`` sequence shard -> ``(B, Hx/N, T, D)`` all positions, my heads."""
    N = len(lengths)
    B, Hx, L, D = x.shape
    parts = x.reshape(B, N, Hx // N, L, D).permute(1, 3, 0, 2, 4)  # (N, L, B, Hx/N, D)
    got = all_to_all(parts.reshape(N * L, B, Hx // N, D), [L] * N, lengths, group)  # (T, ...)
    # One copy into (B, Hx/N, T, D), positions 0..T-1, contiguous for the kernel.
    return got.permute(1, 2, 0, 3).index_select(2, torch.argsort(order))


def _to_sequence(out: Tensor, lengths: list[int], order: Tensor, rank: int, group) -> Tensor:
    """``(B, H/N, T, Dv)`` my heads -> ``(B, H, T_r, Dv)`` my sequence shard, all heads."""
    N = len(lengths)
    B, Hn, _T, Dv = out.shape
    laid = out.permute(2, 0, 1, 3).index_select(0, order)  # (T, B, H/N, Dv), layout order
    L = lengths[rank]
    got = all_to_all(laid.contiguous(), lengths, [L] * N, group)  # (N·L, B, H/N, Dv)
    got = got.reshape(N, L, B, Hn, Dv).permute(2, 0, 3, 1, 4)  # (B, N, H/N, L, Dv)
    return got.reshape(B, N * Hn, L, Dv)  # (B, H, T_r, Dv), head h = j·H/N + i


def _full_mask(mask: Tensor | None, H: int, size: int, rank: int, group) -> Tensor | None:
    """The key mask over the whole sequence, ``(B|1, H/N|1, 1, T)``, for this rank's heads."""
    if mask is None:
        return None
    full = gather_sequence(mask.detach(), dim=3, group=group)  # (B|1, H|1, 1, T)
    if full.shape[1] == H:
        full = full[:, rank * H // size:(rank + 1) * H // size]
    return full
