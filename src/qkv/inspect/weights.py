"""Exact attention weights of one recorded call, for chosen heads and query rows only.

The model's own call ran on whatever backend ``auto`` chose and kept no weights. From its
:class:`~qkv.nn.hooks.AttentionInputs` (queries and keys after rotary positions and the cache,
and the mask parts) the weights are rebuilt in two passes over just the requested heads:

1. the flash kernel gives the softmax log-sum-exp ``lse (B, H', T')`` of the requested rows
   only, a block of rows at a time (its output is not needed, so the values are replaced by
   one zero column);
2. :func:`qkv.attention.weights.rebuild` turns ``exp(s - lse)`` into the weights of that
   block. Asking for the last row of 4,096 costs one row, not 4,096.

A programmable-attention call (a ``score_mod`` or block mask: a flex record) is rebuilt by
:func:`qkv.flex_attention` itself with ``need_weights=True`` (``exp(s - lse)`` tile by tile,
empty tiles skipped) on the requested heads (the mods see the original head indices) and on the
requested rows from the start of their first query block, so the block mask still lines up.

Nothing here touches the model: the output the model computed is unchanged, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from qkv.attention.backends import flash
from qkv.attention.call import AttentionCall
from qkv.attention.flex import flex_attention
from qkv.attention.flex.blocks import DEFAULT_BLOCK, BlockMask
from qkv.attention.weights import rebuild
from qkv.nn.hooks import AttentionInputs

__all__ = ["check_heads", "check_rows", "weight_blocks", "weights_of"]


def check_heads(heads: object, H: int, where: str = "") -> list[int]:
    """Heads as a list of ints in ``[0, H)`` (None: all; negative ints count from the end).

    Raises:
        TypeError: not None, an int or a sequence of ints.
        ValueError: a head out of range, or duplicated.
    """
    if heads is None:
        return list(range(H))
    items = [heads] if isinstance(heads, int) else heads
    if not isinstance(items, Sequence) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in items
    ):
        raise TypeError(f"heads must be None, an int or a sequence of ints, got {heads!r}")
    out = []
    for h in items:
        if not -H <= h < H:
            raise ValueError(f"heads holds {h}, but {where or 'the layer'} has H={H} heads")
        out.append(h % H)
    if len(set(out)) != len(out):
        raise ValueError(f"heads must not repeat a head, got {heads!r}")
    return out


def check_rows(rows: object, T: int) -> slice:
    """Query rows as ``slice(start, stop)`` with ``0 <= start <= stop <= T``.

    ``rows`` is None (all), an int (one row; negative counts from the end) or a slice with
    step 1 (negative bounds count from the end).

    Raises:
        TypeError: another type.
        ValueError: an int out of range, or a slice step other than 1.
    """
    if rows is None:
        return slice(0, T)
    if isinstance(rows, int) and not isinstance(rows, bool):
        if not -T <= rows < T:
            raise ValueError(f"rows={rows} is out of range for T={T} query rows")
        r = rows % T
        return slice(r, r + 1)
    if isinstance(rows, slice):
        if rows.step not in (None, 1):
            raise ValueError(f"rows must be a slice with step 1, got step {rows.step}")
        r = range(T)[rows]
        return slice(r.start, max(r.start, r.stop))
    raise TypeError(f"rows must be None, an int or a slice, got {rows!r}")


def _head_call(inputs: AttentionInputs, heads: list[int]) -> AttentionCall:
    """The call restricted to ``heads``, each query head paired with its key/value head."""
    q, k = inputs.query.detach(), inputs.key.detach()
    # The values only feed the output, which is not needed: one zero column keeps it cheap.
    v = k.new_zeros((*k.shape[:-1], 1))  # (B, Hkv, S, 1)
    call = dataclasses.replace(inputs.to_call(), query=q, key=k, value=v, dropout_p=0.0)
    idx = torch.tensor(heads, dtype=torch.long, device=q.device)
    kv = idx // call.groups  # the key/value head each chosen query head reads
    mask = call.mask
    if mask is not None and mask.shape[1] > 1:
        mask = mask[:, idx]  # (B|1, H', T|1, S|1)
    return dataclasses.replace(
        call,
        query=call.query[:, idx],  # (B, H', T, D)
        key=call.key[:, kv],  # (B, H', S, D)
        value=call.value[:, kv],  # (B, H', S, 1)
        mask=mask,
        alibi=None if call.alibi is None else call.alibi[idx],
    )


def _row_call(call: AttentionCall, i0: int, i1: int) -> AttentionCall:
    """``call`` restricted to query rows ``i0 .. i1 - 1``: the causal diagonal (and with it the
    window and ALiBi distances) moves by ``i0`` so every row sees exactly the keys it saw."""
    mask = call.mask
    if mask is not None and mask.shape[2] > 1:
        mask = mask[:, :, i0:i1]  # (B|1, H'|1, rows, S|1)
    return dataclasses.replace(
        call,
        query=call.query[:, :, i0:i1],  # (B, H', rows, D)
        mask=mask,
        causal=None if call.causal is None else call.causal + i0,
    )


@torch.no_grad()
def weight_blocks(
    inputs: AttentionInputs,
    heads: object = None,
    rows: object = None,
    *,
    block_rows: int | None = None,
) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(first_row, weights (B, H', rows_in_block, S))`` covering the chosen rows.

    Args:
        inputs: a recorded call.
        heads: query heads (None: all); see :func:`check_heads`.
        rows: query rows (None: all); see :func:`check_rows`.
        block_rows: rows per block (None: all rows in one block); peak memory is one block.

    Raises:
        TypeError, ValueError: bad ``heads``, ``rows`` or ``block_rows``.
    """
    inputs = inputs.checked()  # records may come from user code, not only from a module
    B, H, T, _ = inputs.query.shape
    S = inputs.key.shape[2]
    head_list = check_heads(heads, H)
    span = check_rows(rows, T)
    if block_rows is not None and (
        isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1
    ):
        raise ValueError(f"block_rows must be a positive int or None, got {block_rows!r}")
    n = span.stop - span.start
    step = block_rows or max(n, 1)
    if T == 0 or S == 0 or n == 0:
        # Nothing to attend to, or no row asked for: all-zero weights, as SDPA gives.
        yield span.start, inputs.query.new_zeros((B, len(head_list), n, S))
        return
    if inputs.is_flex:
        yield from _flex_blocks(inputs, head_list, span, step)
        return
    call = _head_call(inputs, head_list)
    if call.alibi is not None and call.causal is None:
        # ALiBi distances without a causal diagonal are measured from S - T, which a call on
        # fewer rows would change: one lse pass over every row, then the blocks.
        _, lse = flash.attend(call)  # (B, H', T)
        for i0 in range(span.start, span.stop, step):
            i1 = min(i0 + step, span.stop)
            yield i0, rebuild(call, lse, rows=slice(i0, i1))  # (B, H', i1 - i0, S)
        return
    for i0 in range(span.start, span.stop, step):
        # Only the asked rows cost anything: each block is a call of its own.
        block = _row_call(call, i0, min(i0 + step, span.stop))
        _, lse = flash.attend(block)  # (B, H', rows)
        yield i0, rebuild(block, lse)  # (B, H', rows, S)


def _flex_blocks(
    inputs: AttentionInputs, heads: list[int], span: slice, step: int
) -> Iterator[tuple[int, Tensor]]:
    """Weight blocks of a flex record: :func:`qkv.flex_attention` on the chosen heads and rows."""
    score_mod, block_mask = inputs.flex_parts()
    q, k = inputs.query.detach(), inputs.key.detach()
    idx = torch.tensor(heads, dtype=torch.long, device=q.device)
    kv = idx // (q.shape[1] // k.shape[1])  # the key/value head each chosen query head reads
    qh, kh = q[:, idx], k[:, kv]  # (B, H', T, D), (B, H', S, D)
    v = k.new_zeros((*kh.shape[:-1], 1))  # (B, H', S, 1): the output is not needed
    bq = DEFAULT_BLOCK if block_mask is None else block_mask.block_size[0]
    for i0 in range(span.start, span.stop, step):
        i1 = min(i0 + step, span.stop)
        a0 = i0 // bq * bq  # the first row of i0's query block: the tiles keep their rows
        mod = None if score_mod is None else _moved_score(score_mod, idx, a0)
        bm = None if block_mask is None else _moved_mask(block_mask, idx, a0, i1)
        _, w = flex_attention(qh[:, :, a0:i1], kh, v, mod, bm, inputs.scale,
                              need_weights=True)  # fmt: skip
        yield i0, w[:, :, i0 - a0 :]  # (B, H', i1 - i0, S)


def _moved_score(score_mod, idx: Tensor, a0: int):
    """``score_mod`` seen from heads ``idx`` and queries starting at row ``a0``."""
    return lambda s, b, h, q_idx, kv_idx: score_mod(s, b, idx[h], q_idx + a0, kv_idx)


def _moved_mask(block_mask: BlockMask, idx: Tensor, a0: int, i1: int) -> BlockMask:
    """``block_mask`` restricted to heads ``idx`` and query rows ``a0 .. i1 - 1`` (``a0`` on a
    block boundary, so the tile states are a slice of the original ones)."""
    bq = block_mask.block_size[0]
    state = block_mask.state
    if state.shape[1] > 1:
        state = state[:, idx.cpu()]  # (B|1, H', nQ, nK)
    state = state[:, :, a0 // bq : -(-i1 // bq)]  # (B|1, H'|1, rows' blocks, nK)
    mod = block_mask.mask_mod
    return BlockMask(state, lambda b, h, q_idx, kv_idx: mod(b, idx[h], q_idx + a0, kv_idx),
                     i1 - a0, block_mask.kv_len, block_mask.block_size)  # fmt: skip


def weights_of(inputs: AttentionInputs, heads: object = None, rows: object = None) -> Tensor:
    """Exact softmax weights ``(B, H', T', S)`` of a recorded call (before any dropout).

    Equal to the weights ``qkv.scaled_dot_product_attention(..., need_weights=True,
    backend="math")`` returns for the same inputs, restricted to ``heads`` and ``rows``.

    Raises:
        TypeError, ValueError: bad ``heads`` or ``rows``.
    """
    blocks = [w for _, w in weight_blocks(inputs, heads, rows)]
    return blocks[0]
