"""Ring attention: the sequence split across ranks, keys and values passed round a ring.

Each of the ``N`` ranks holds its shard of queries, keys and values in the zigzag layout of
:mod:`qkv.distributed.layout` (two chunks, one early and one late). In ``N`` steps every
rank's key/value shard visits every rank (``torch.distributed`` point-to-point sends, posted
before the step's compute so the next shard travels while this one is attended to). At each
step a rank attends its two query chunks to the visiting two key chunks with a kernel that
also returns the log-sum-exp (:mod:`qkv.distributed.blocks`: torch's CPU flash kernel for plain
blocks, qkv's flash kernel for the rest), and merges the partial results exactly:

    lse = logaddexp(lse_a, lse_b),  out = out_a · exp(lse_a - lse) + out_b · exp(lse_b - lse)

Chunk pairs are classified by global position: keys wholly before the queries are attended
without a mask, the diagonal pair with the causal mask, keys wholly after skipped; ALiBi and
sliding windows use the pair's global offsets. The zigzag layout gives every rank the same
number of unmasked tiles under a causal mask.

The backward pass is its own (no autograd through communication): the key/value shards go
round the ring again, each with its gradient accumulators ``dK, dV``; every rank adds its
queries' share (FlashAttention-2's backward of one block given the *global* output and
log-sum-exp, which is exactly that block's share) and passes them on; after ``N`` steps each
shard's gradients are back at its owner. ``dQ`` accumulates locally.

Supported: causal or not, grouped-query attention (K/V travel with ``Hkv`` heads), ALiBi,
sliding windows, a key-padding mask (broadcast over queries: it travels with its keys).
Not supported (a clear error): dense ``(T, S)`` masks, dropout, returning the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from qkv.attention.call import AttentionCall, make_call
from qkv.attention.masks import accumulation_dtype
from qkv.attention.weights import merge_partials
from qkv.distributed.blocks import block_backward, block_forward
from qkv.distributed.comm import RingExchange, world
from qkv.distributed.layout import agreed_lengths, rank_chunks

__all__ = ["ring_attention", "ring_call", "shard_call"]


def ring_attention(
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
    """Attention over a sequence sharded across the ranks of ``group``; equals one process.

    Args:
        query: ``(B, H, T_r, D)``, this rank's shard (:func:`~qkv.distributed.shard_sequence`
            along dimension 2).
        key: ``(B, Hkv, T_r, D)``, the same positions' keys.
        value: ``(B, Hkv, T_r, Dv)``.
        is_causal: causal over the global sequence (query ``i`` sees keys ``j <= i``).
        scale: factor on ``q·k``; ``1/sqrt(D)`` when None.
        enable_gqa: ``H`` a multiple of ``Hkv`` (grouped-query attention).
        group: the process group (default: the world).
        seq_len: the global length ``T``; None asks every rank for its shard length (one
            small all-gather).

    Returns:
        ``(B, H, T_r, Dv)``: this rank's shard of the output, differentiable with respect to
        all three inputs.

    Raises:
        RuntimeError: no process group is initialised.
        AttentionArgumentError, AttentionTypeError: inputs that single-process attention
            would refuse; ValueError: shards that do not make a sequence of the layout.
    """
    call = shard_call("ring_attention", query, key, value, is_causal, scale, enable_gqa)
    out, _ = ring_call(call, group=group, seq_len=seq_len)
    return out


def shard_call(name: str, query, key, value, is_causal, scale, enable_gqa) -> AttentionCall:
    """The validated local call of a context-parallel function: 4-D shards of one sequence."""
    call = make_call(
        query, key, value, None, 0.0, is_causal, scale, enable_gqa, need_weights=False
    )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or call.T != call.S:
        raise ValueError(
            f"{name} takes 4-D shards (B, H, T_r, D) of one sequence (self-attention: "
            f"queries and keys of the same positions), got query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}, value {tuple(value.shape)}"
        )
    return call


@dataclass(frozen=True)
class _Plan:
    """What a ring call needs besides its tensors."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    lengths: tuple[int, ...]  # every rank's shard length
    causal: bool
    window: int | None
    scale: float

    def chunks(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        return rank_chunks(sum(self.lengths), self.size, rank)


def ring_call(
    call: AttentionCall, *, group: dist.ProcessGroup | None = None, seq_len: int | None = None
) -> tuple[Tensor, None]:
    """Run a validated local call as ring attention over the global sequence.

    ``call`` holds this rank's shards (``T = S = T_r``); ``call.causal`` set means causal over
    the whole sequence (it must be 0: top-left, queries and keys of the same positions).
    Returns ``(out (B, H, T_r, Dv), None)`` like a backend.
    """
    _check_ring_call(call)
    rank, size = world(group)
    lengths = agreed_lengths("ring_attention", call, seq_len, group)
    plan = _Plan(group, rank, size, tuple(lengths), call.causal is not None, call.window,
                 call.scale)
    mask = _key_mask(call)
    out = _RingFunction.apply(call.query, call.key, call.value, mask, call.alibi, plan)
    return out, None


def _check_ring_call(call: AttentionCall) -> None:
    if call.T != call.S:
        raise ValueError(f"ring attention is self-attention: T ({call.T}) must equal S ({call.S})")
    if call.causal not in (None, 0):
        raise ValueError("ring attention's causal mask is top-left over the global sequence")
    if call.dropout_p > 0.0:
        raise ValueError(
            "context-parallel attention has no attention dropout: set the attention dropout "
            "to 0 (or call model.eval())"
        )
    if call.need_weights:
        raise ValueError(
            "context-parallel attention cannot return the (T, S) weights: each rank only "
            "ever holds its own rows' statistics; capture on one process instead"
        )
    if call.mask is not None and call.mask.shape[2] != 1:
        raise ValueError(
            "context-parallel attention takes no mask or a key-padding mask broadcast over "
            f"queries (shape (B, 1, 1, S)); got a mask of shape {tuple(call.mask.shape)}"
        )


def _key_mask(call: AttentionCall) -> Tensor | None:
    """The key mask ``(B|1, H|1, 1, T_r)`` made explicit along keys (it travels with them)."""
    if call.mask is None:
        return None
    m = call.mask
    return m.expand(*m.shape[:3], call.S).contiguous()  # (B|1, H|1, 1, S)


def _split(t: Tensor | None, bounds, dim: int = 2) -> list[Tensor | None]:
    """A shard's two chunks along ``dim``."""
    (a0, a1), (b0, b1) = bounds
    if t is None:
        return [None, None]
    n = a1 - a0
    return [t.narrow(dim, 0, n), t.narrow(dim, n, b1 - b0)]


def _pair_call(q, k, v, mask, alibi, qb: tuple[int, int], kb: tuple[int, int], plan: _Plan):
    """The call of one query chunk against one key chunk, or None when it sees none of them.

    Global positions decide: under a causal mask keys wholly after the queries are skipped,
    keys wholly before (and inside any window) need no mask, the rest get the causal diagonal
    shifted by the chunks' offsets.
    """
    (q0, q1), (k0, k1) = qb, kb
    causal = None
    if plan.causal:
        shift, w = q0 - k0, plan.window
        if k0 > q1 - 1:
            return None  # every key after every query
        if w is not None and k1 - 1 <= q0 - w:
            return None  # every key older than every query's window
        if not (k1 - 1 <= q0 and (w is None or k0 > q1 - 1 - w)):
            causal = shift
    return AttentionCall(
        query=q, key=k, value=v, mask=mask, causal=causal,
        window=plan.window if causal is not None else None, alibi=alibi, scale=plan.scale,
        dropout_p=0.0, need_weights=False, batch_shape=(q.shape[0],), alibi_offset=q0 - k0,
    )


def _merge(acc, out: Tensor, lse: Tensor):
    """Merge a partial ``(out, lse)`` into ``acc`` (None or ``(out, lse)``), exactly, in place.

    ``out`` is kept in the accumulation dtype (float32 for half inputs, else the input's) and
    ``lse`` in the kernel's (float64 for float32 inputs), so no copy of the output is widened.
    """
    out = out.to(accumulation_dtype(out.dtype))
    return (out, lse) if acc is None else merge_partials(*acc, out, lse)


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, alibi, plan: _Plan):
        out, lse = _forward(q, k, v, mask, alibi, plan)
        ctx.save_for_backward(q, k, v, mask, alibi, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, alibi, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, mask, alibi, out, lse, dout.contiguous(), ctx.plan)
        return dq, dk, dv, None, None, None


def _travel_shapes(k: Tensor, v: Tensor, mask: Tensor | None, length: int):
    """Shapes of a shard of ``length`` positions of K, V (and the key mask)."""
    shapes = [
        ((*k.shape[:2], length, *k.shape[3:]), k),  # (B, Hkv, length, D)
        ((*v.shape[:2], length, *v.shape[3:]), v),  # (B, Hkv, length, Dv)
    ]
    if mask is not None:
        shapes.append(((*mask.shape[:3], length), mask))
    return shapes


@torch.no_grad()
def _forward(q, k, v, mask, alibi, plan: _Plan):
    rank, size = plan.rank, plan.size
    mine = plan.chunks(rank)
    qs, accs = _split(q, mine), [None, None]
    ring = RingExchange(plan.group)
    travel = [k, v] + ([mask] if mask is not None else [])
    for step in range(size):
        src = (rank - step) % size
        if step < size - 1:  # the next shard travels while this one is attended to
            ring.start(travel, _travel_shapes(k, v, mask, plan.lengths[(src - 1) % size]))
        kb = plan.chunks(src)
        ks, vs, ms = _split(travel[0], kb), _split(travel[1], kb), _split(
            travel[2] if mask is not None else None, kb, dim=3
        )
        for i in range(2):
            for j in range(2):
                pc = _pair_call(qs[i], ks[j], vs[j], ms[j], alibi, mine[i], kb[j], plan)
                if pc is not None:
                    accs[i] = _merge(accs[i], *block_forward(pc))
        if step < size - 1:
            travel = ring.wait()
    del travel
    out = torch.cat([a[0] for a in accs], dim=2).to(q.dtype)  # (B, H, T_r, Dv)
    lse = torch.cat([a[1] for a in accs], dim=2)  # (B, H, T_r)
    return out, lse


@torch.no_grad()
def _backward(q, k, v, mask, alibi, out, lse, dout, plan: _Plan):
    rank, size = plan.rank, plan.size
    mine = plan.chunks(rank)
    qs, outs, lses, douts = _split(q, mine), _split(out, mine), _split(lse, mine), _split(
        dout, mine
    )
    dq_all = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))  # (B, H, T_r, D)
    dqs = _split(dq_all, mine)
    kv_ring, grad_ring = RingExchange(plan.group), RingExchange(plan.group)
    travel = [k, v] + ([mask] if mask is not None else [])
    for step in range(size):
        src = (rank - step) % size
        nxt = plan.lengths[(src - 1) % size]
        if step < size - 1:
            kv_ring.start(travel, _travel_shapes(k, v, mask, nxt))
        kb = plan.chunks(src)
        ks, vs = _split(travel[0], kb), _split(travel[1], kb)
        ms = _split(travel[2] if mask is not None else None, kb, dim=3)
        # The visiting shard's gradient accumulators: received from the rank that held it last
        # (waiting here rather than overlapping keeps two accumulator sets alive, not three).
        if step == 0:
            acc = accumulation_dtype(k.dtype)
            dk_shard = torch.zeros_like(travel[0], dtype=acc)  # (B, Hkv, T_src, D)
            dv_shard = torch.zeros_like(travel[1], dtype=acc)  # (B, Hkv, T_src, Dv)
        else:
            dk_shard, dv_shard = grad_ring.wait()
        dks, dvs = _split(dk_shard, kb), _split(dv_shard, kb)
        for i in range(2):
            for j in range(2):
                pc = _pair_call(qs[i], ks[j], vs[j], ms[j], alibi, mine[i], kb[j], plan)
                if pc is None:
                    continue
                dq, dk, dv = block_backward(pc, outs[i], lses[i], douts[i])
                dqs[i] += dq
                dks[j] += dk
                dvs[j] += dv
                del dq, dk, dv
        if size == 1:
            return dq_all.to(q.dtype), dk_shard.to(k.dtype), dv_shard.to(v.dtype)
        # The accumulators move on with their shard (after the last step: home to the owner).
        grad_ring.start(
            [dk_shard, dv_shard],
            [((*dk_shard.shape[:2], nxt, *dk_shard.shape[3:]), dk_shard),
             ((*dv_shard.shape[:2], nxt, *dv_shard.shape[3:]), dv_shard)],
        )
        del dk_shard, dv_shard, dks, dvs
        if step < size - 1:
            travel = kv_ring.wait()
    dk, dv = grad_ring.wait()
    return dq_all.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
