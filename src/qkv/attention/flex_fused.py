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

from qkv.attention.flex_blocks import FULL, tile_keep

__all__ = ["fused_row_block", "fused_serves"]

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fused_serves(query: Tensor, value: Tensor, score_mod, grad: bool) -> bool:
    """Whether the fused path can serve a call: nothing to differentiate, no score_mod, CPU,
    float32/float64, D == Dv."""
    return (
        _CPU_FLASH is not None and score_mod is None and not grad
        and query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)
        and query.shape[-1] == value.shape[-1]
    )


def fused_row_block(q: Tensor, k: Tensor, v: Tensor, i0: int, spans, plan):
    """``(out (B, H, bq, Dv), lse (B, H, bq))`` of one query group, span by span."""
    out = lse = None
    rows = range(i0, i0 + q.shape[2])
    for first, last, kind in spans:
        j0, j1 = first * plan.bk, min(plan.S, last * plan.bk)
        kt, vt = k[:, :, j0:j1], v[:, :, j0:j1]
        if plan.G > 1:
            kt, vt = (t.repeat_interleave(plan.G, dim=1) for t in (kt, vt))  # (B, H, keys, D)
        add = dead = None
        if kind != FULL and plan.mask_mod is not None:
            keep = tile_keep(plan.mask_mod, plan.B, plan.H, rows, range(j0, j1), q.device)
            # The mask as the mod made it (before broadcasting): a mask that does not vary
            # over batch or heads stays (1, 1, bq, keys), and the kernel broadcasts it.
            raw = _unbroadcast(keep)
            add = torch.zeros(raw.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~raw, float("-inf"))  # (B|1, H|1, bq, keys)
            dead = ~raw.any(dim=-1)  # (B|1, H|1, bq)
        o, s_lse = _CPU_FLASH(q, kt, vt, 0.0, False, attn_mask=add, scale=plan.scale)
        if dead is not None:
            s_lse = s_lse.masked_fill(dead.expand(s_lse.shape), float("-inf"))
        out, lse = (o, s_lse) if out is None else _merge(out, lse, o, s_lse)
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


def _merge(out0: Tensor, lse0: Tensor, out1: Tensor, lse1: Tensor):
    new = torch.logaddexp(lse0, lse1)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w0 = torch.exp(lse0 - safe).unsqueeze(-1).to(out0.dtype)  # (B, H, bq, 1)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1).to(out0.dtype)
    return out0 * w0 + out1 * w1, new
