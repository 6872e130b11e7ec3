"""Inference path of :func:`qkv.flex_attention` without a ``score_mod``: spans on torch's
fused CPU kernel.

When nothing needs gradients and there is no ``score_mod``, each visited span of keys is plain
attention (a full span) or attention under a mask (a partial span: ``mask_mod`` evaluated on
the span's grid, passed as an additive mask). torch's CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``) computes it and returns the span's
log-sum-exp; spans are merged exactly by log-sum-exp, as the online softmax does. Rows a
partial span hides entirely are given ``lse = -inf`` (the kernel reports 0 there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.backends.torch_kernel import CPU_FLASH, CPU_FLASH_BACKWARD
from qkv.attention.flex.blocks import FULL, tile_keep
from qkv.attention.weights import merge_partials

__all__ = ["assemble", "fused_attention", "fused_row_block", "fused_serves"]



def fused_serves(query: Tensor, value: Tensor, score_mod, grad: bool, return_lse: bool) -> bool:
    """Whether the fused path can serve a call: no score_mod, CPU, float32/float64, D == Dv,
    and no gradient asked of the log-sum-exp."""
    return (
        CPU_FLASH is not None and CPU_FLASH_BACKWARD is not None and score_mod is None
        and not (grad and return_lse)
        and query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)
        and query.shape[-1] == value.shape[-1]
    )


def fused_attention(q: Tensor, k: Tensor, v: Tensor, groups, plan) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, Dv), lse (B, H, T))`` over every query group, differentiable in q, k, v.

    The backward runs torch's fused flash backward span by span with the *whole row's* output
    and log-sum-exp, which gives exactly that span's share of dQ, dK, dV (as in
    FlashAttention-2); ``lse`` is not differentiable.
    """
    return _FusedFlex.apply(q, k, v, groups, plan)


class _FusedFlex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, groups, plan):
        out, lse = assemble(groups, lambda i0, i1, spans: fused_row_block(
            q[:, :, i0:i1], k, v, i0, spans, plan))  # (B, H, T, Dv), (B, H, T)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.groups, ctx.plan = groups, plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return _fused_backward(ctx, dout)


def assemble(groups, row_block) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, Dv), lse (B, H, T))`` from ``row_block(i0, i1, spans)`` of every query
    group, written into one output as they come (no list of parts and copy: the peak is the
    output and one group's tiles)."""
    out = lse = None
    for i0, i1, spans in groups:
        o, g_lse = row_block(i0, i1, spans)
        if out is None:
            T = groups[-1][1]
            out = o.new_empty((*o.shape[:2], T, o.shape[3]))  # (B, H, T, Dv)
            lse = g_lse.new_empty((*g_lse.shape[:2], T))  # (B, H, T)
        out[:, :, i0:i1] = o
        lse[:, :, i0:i1] = g_lse
    return out, lse


def _fused_backward(ctx, dout):
    """dq, dk, dv of :class:`_FusedFlex` (and None for its other inputs)."""
    q, k, v, out, lse = ctx.saved_tensors
    plan = ctx.plan
    dout = dout.contiguous()
    # Rows that see no key: +inf makes every weight exp(s - lse) exactly 0.
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i0, i1, spans in ctx.groups:
        rows = range(i0, i1)
        qg, og, dog, lg = (t[:, :, i0:i1] for t in (q, out, dout, lse))
        for first, last, kind in spans:
            j0, j1 = first * plan.bk, min(plan.S, last * plan.bk)
            kt, vt = k[:, :, j0:j1], v[:, :, j0:j1]
            if plan.G > 1:
                kt, vt = (t.repeat_interleave(plan.G, dim=1) for t in (kt, vt))
            add = _additive(plan, kind, rows, range(j0, j1), q)[0]
            gq, gk, gv = CPU_FLASH_BACKWARD(dog, qg, kt, vt, og, lg, 0.0, False, attn_mask=add,
                                        scale=plan.scale)
            dq[:, :, i0:i1] += gq
            if plan.G > 1:  # (B, H, keys, D) -> (B, Hkv, keys, D): sum each group
                gk = gk.unflatten(1, (-1, plan.G)).sum(dim=2)
                gv = gv.unflatten(1, (-1, plan.G)).sum(dim=2)
            dk[:, :, j0:j1] += gk
            dv[:, :, j0:j1] += gv
    return dq, dk, dv, None, None


def _additive(plan, kind, rows: range, cols: range, q: Tensor):
    """``(additive mask (B|1, H|1, bq, keys) or None, dead rows or None)`` of a span."""
    if kind == FULL or plan.mask_mod is None:
        return None, None
    keep = tile_keep(plan.mask_mod, plan.B, plan.H, rows, cols, q.device)
    # The mask as the mod made it (before broadcasting): a mask that does not vary over
    # batch or heads stays (1, 1, bq, keys), and the kernel broadcasts it.
    raw = _unbroadcast(keep)
    add = torch.zeros(raw.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~raw, float("-inf"))  # (B|1, H|1, bq, keys)
    return add, ~raw.any(dim=-1)  # dead rows (B|1, H|1, bq)


def fused_row_block(q: Tensor, k: Tensor, v: Tensor, i0: int, spans, plan):
    """``(out (B, H, bq, Dv), lse (B, H, bq))`` of one query group, span by span."""
    out = lse = None
    rows = range(i0, i0 + q.shape[2])
    for first, last, kind in spans:
        j0, j1 = first * plan.bk, min(plan.S, last * plan.bk)
        kt, vt = k[:, :, j0:j1], v[:, :, j0:j1]
        if plan.G > 1:
            kt, vt = (t.repeat_interleave(plan.G, dim=1) for t in (kt, vt))  # (B, H, keys, D)
        add, dead = _additive(plan, kind, rows, range(j0, j1), q)
        o, s_lse = CPU_FLASH(q, kt, vt, 0.0, False, attn_mask=add, scale=plan.scale)
        if dead is not None:
            s_lse = s_lse.masked_fill(dead.expand(s_lse.shape), float("-inf"))
        out, lse = (o, s_lse) if out is None else merge_partials(out, lse, o, s_lse)
    if out is None:  # a query group that sees no key at all: zero rows, lse -inf
        B, H, bq = q.shape[:3]
        out = q.new_zeros((B, H, bq, v.shape[-1]))
        lse = torch.full((B, H, bq), float("-inf"), dtype=torch.float32 if q.dtype in (
            torch.float16, torch.bfloat16) else q.dtype, device=q.device)
    return out, lse


def _unbroadcast(keep: Tensor) -> Tensor:
    """``keep`` without the dimensions it was broadcast along (stride 0), as a real tensor."""
    index = tuple(0 if st == 0 and n > 1 else slice(None) for st, n in
                  zip(keep.stride(), keep.shape, strict=True))
    raw = keep[index]
    for d, i in enumerate(index):
        if i == 0:
            raw = raw.unsqueeze(d)
    return raw.contiguous()
