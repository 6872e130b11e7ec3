"""qkv's own flash backend: blockwise attention with the online softmax (Dao et al., 2022).

Queries are cut into blocks of ``bq`` rows and keys into blocks of ``bk``; for each query
block a running row maximum ``m``, running sum ``l`` and unnormalised output ``acc`` are
updated block by key block, so the ``T×S`` score matrix never exists: peak extra memory is a
few ``(B, H, bq, bk)`` tiles. Blocks wholly above the causal diagonal (or left of a sliding
window) are skipped; partial ones get their mask built per tile; dense masks are sliced per
tile; ALiBi is computed per tile. The backward pass is a custom autograd function that
recomputes each tile from the saved log-sum-exp (``lse = m + log l``), as FlashAttention-2
does, so it stores no ``T×S`` matrix either.

Grouped-query attention keeps the ``G = H / Hkv`` query heads of a group together: a query
tile is ``(B, Hkv, G·bq, D)`` against a key tile ``(B, Hkv, bk, D)``; K and V are never
repeated.

Equivalent to the ``math`` backend (the tests hold it to 1e-10 in float64); rows with no
visible key give zero output, ``lse = -inf`` and zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.call import AttentionCall
from qkv.attention.flash_blocks import BlockPlan, block_sizes, plan_blocks

NAME = "flash"


def why_not(call: AttentionCall) -> str | None:
    """Reasons the flash backend cannot honour ``call``, or ``None``."""
    if call.T == 0 or call.S == 0:
        return "empty sequence (T or S is 0)"
    if call.need_weights and call.dropout_p > 0.0:
        return "weights after dropout cannot be rebuilt from the log-sum-exp"
    return None


@dataclass(frozen=True)
class _Spec:
    """Everything about a call that is not a tensor input."""

    scale: float
    causal: int | None
    window: int | None
    dropout_p: float
    seed: int
    bq: int
    bk: int


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """Output ``(B, H, T, Dv)`` and, when asked, exact weights rebuilt from the lse."""
    out, lse = attend(call)
    weights = None
    if call.need_weights:
        from qkv.attention.weights import rebuild

        weights = rebuild(call, lse)
    return out, weights


def attend(call: AttentionCall, *, block_q: int | None = None, block_k: int | None = None):
    """Run flash attention on ``call``: ``(out (B, H, T, Dv), lse (B, H, T))``.

    ``lse`` is float32 for half-precision inputs, else float64.
    """
    bq, bk = block_sizes(call.T, call.S, call.query.shape[-1], call.query.dtype)
    seed = 0
    if call.dropout_p > 0.0:
        # One draw from torch's global generator: manual_seed makes flash dropout repeatable,
        # and the backward pass regenerates each tile's mask from (seed, tile).
        seed = int(torch.randint(0, 2**62, (1,)).item())
    spec = _Spec(
        scale=call.scale, causal=call.causal, window=call.window, dropout_p=call.dropout_p,
        seed=seed, bq=block_q or bq, bk=block_k or bk,
    )
    return _FlashFunction.apply(call.query, call.key, call.value, call.mask, call.alibi, spec)


class _FlashFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, alibi, spec):
        out, lse = _forward(q, k, v, mask, alibi, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.alibi, ctx.spec = mask, alibi, spec
        ctx.set_materialize_grads(False)  # an unused lse needs no zero gradient tensor
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.mask, ctx.alibi, ctx.spec)
        return dq, dk, dv, None, None, None


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _grouped_mask(mask: Tensor | None, Hkv: int, G: int) -> Tensor | None:
    """``(B|1, H|1, T|1, S|1)`` -> ``(B|1, Hkv|1, G|1, T|1, S|1)`` to match grouped tiles."""
    if mask is None:
        return None
    Bm, Hm, Tm, Sm = mask.shape
    if Hm == 1:
        return mask.reshape(Bm, 1, 1, Tm, Sm)  # (B|1, 1, 1, T|1, S|1)
    return mask.reshape(Bm, Hkv, G, Tm, Sm)  # (B|1, Hkv, G, T|1, S|1)


def _tile(mask: Tensor, rows: slice, cols: slice) -> Tensor:
    """Slice a grouped mask to one tile, leaving broadcast (size-1) dimensions alone."""
    r = rows if mask.shape[-2] > 1 else slice(None)
    c = cols if mask.shape[-1] > 1 else slice(None)
    return mask[..., r, c]


def _tile_scores(qs, k_t, plan: BlockPlan, mask, alibi, shape5, spec: _Spec, acc):
    """Masked, scaled scores of one tile: ``(B, Hkv, G, bq, bk)`` in ``acc`` dtype.

    ``qs`` is the query tile already multiplied by the scale, ``(B, Hkv, G·bq, D)``.
    """
    s = (qs @ k_t.transpose(-2, -1)).to(acc)  # (B, Hkv, G·bq, bk)
    s = s.view(shape5)  # (B, Hkv, G, bq, bk)
    i0, i1, j0, j1 = plan.i0, plan.i1, plan.j0, plan.j1
    if plan.partial:
        i = torch.arange(i0, i1, device=s.device)[:, None]  # (bq, 1)
        j = torch.arange(j0, j1, device=s.device)[None, :]  # (1, bk)
        keep = j <= i + spec.causal
        if spec.window is not None:
            keep &= j > i + spec.causal - spec.window
        s.masked_fill_(~keep, float("-inf"))
    if alibi is not None:
        i = torch.arange(i0, i1, device=s.device, dtype=torch.float32)[:, None]  # (bq, 1)
        j = torch.arange(j0, j1, device=s.device, dtype=torch.float32)[None, :]  # (1, bk)
        s += (alibi * (i + plan.alibi_shift - j).abs()).to(acc)  # (Hkv, G, bq, bk), alibi<0
    if mask is not None:
        m = _tile(mask, slice(i0, i1), slice(j0, j1))
        if m.dtype == torch.bool:
            s.masked_fill_(~m, float("-inf"))
        else:
            s += m
    return s


def _dropout_keep(spec: _Spec, qi: int, kj: int, shape, device) -> Tensor:
    """The dropout keep-mask of tile (qi, kj), regenerated identically in the backward."""
    g = torch.Generator(device=device).manual_seed(spec.seed + 1_000_003 * qi + kj)
    return torch.rand(shape, generator=g, device=device) >= spec.dropout_p


def _prepare(q, k, v, mask, alibi, spec):
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    # Half precision is computed in float32: CPUs without bf16 matrix units multiply bf16
    # ~100x slower than float32, and float32 products of bf16 inputs are exact anyway. K and
    # V are converted tile by tile (see _kv), so no float32 copy of the whole cache exists.
    qg = (q.to(acc) * spec.scale).reshape(B, Hkv, G, T, D)  # (B, Hkv, G, T, D), scale folded
    gmask = _grouped_mask(mask, Hkv, G)
    # ALiBi slopes as a negative factor per (Hkv, G) head: bias = -slope · |distance|.
    galibi = None if alibi is None else (-alibi).reshape(Hkv, G, 1, 1).to(acc)
    shift = spec.causal if spec.causal is not None else S - T
    plans = plan_blocks(T, S, spec.bq, spec.bk, spec.causal, spec.window, alibi_shift=shift)
    return B, H, T, D, Hkv, S, G, acc, qg, k, v, gmask, galibi, plans


def _kv(k: Tensor, v: Tensor, j0: int, j1: int, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """Key and value tiles ``(B, Hkv, bk, D|Dv)`` in the accumulation dtype."""
    return k[:, :, j0:j1].to(acc), v[:, :, j0:j1].to(acc)


def _row_max(s: Tensor) -> Tensor:
    """Max over the last dimension, keepdim; a 2-D view takes torch's fast reduction path."""
    return s.reshape(-1, s.shape[-1]).amax(dim=-1).view(*s.shape[:-1], 1)


def _row_sum(s: Tensor) -> Tensor:
    return s.reshape(-1, s.shape[-1]).sum(dim=-1).view(*s.shape[:-1], 1)


@torch.no_grad()
def _forward(q, k, v, mask, alibi, spec: _Spec):
    dtype = q.dtype
    B, H, T, D, Hkv, _, G, acc, qg, k, v, gmask, galibi, plans = _prepare(
        q, k, v, mask, alibi, spec
    )
    Dv = v.shape[-1]
    out = torch.empty(B, Hkv, G, T, Dv, dtype=dtype, device=q.device)  # (B, Hkv, G, T, Dv)
    lse = torch.empty(B, Hkv, G, T, 1, dtype=_lse_dtype(dtype), device=q.device)
    for qi, row in enumerate(plans):
        i0, i1 = row.i0, row.i1
        bq = i1 - i0
        qs = qg[:, :, :, i0:i1].reshape(B, Hkv, G * bq, D)  # (B, Hkv, G·bq, D)
        # Rows of a query block that no tile reaches (all keys hidden) keep these values.
        m = torch.full((B, Hkv, G, bq, 1), float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros(B, Hkv, G, bq, 1, dtype=acc, device=q.device)
        o = torch.zeros(B, Hkv, G, bq, Dv, dtype=acc, device=q.device)
        for t, plan in enumerate(row.tiles):
            j0, j1 = plan.j0, plan.j1
            kt, vt = _kv(k, v, j0, j1, acc)
            s = _tile_scores(qs, kt, plan, gmask, galibi, (B, Hkv, G, bq, j1 - j0), spec, acc)
            # 1) New running maximum; rows still all -inf use 0 so exp gives exact zeros.
            m_new = _row_max(s) if t == 0 else torch.maximum(m, _row_max(s))
            m_safe = torch.nan_to_num(m_new, neginf=0.0)
            # 2) Unnormalised probabilities of this tile, in place over the scores.
            p = s.sub_(m_safe).exp_()  # (B, Hkv, G, bq, bk)
            l_tile = _row_sum(p)  # (B, Hkv, G, bq, 1)
            if spec.dropout_p > 0.0:
                keep = _dropout_keep(spec, qi, plan.index, p.shape, p.device)
                p = p * keep / (1.0 - spec.dropout_p)
            pv = (p.view(B, Hkv, G * bq, j1 - j0) @ vt).view(B, Hkv, G, bq, Dv)
            # 3) Rescale what was accumulated under the old maximum, then add this tile.
            if t == 0:
                l, o = l_tile, pv
            else:
                alpha = torch.exp(m - m_safe)  # (B, Hkv, G, bq, 1)
                l = torch.addcmul(l_tile, l, alpha)
                o = torch.addcmul(pv, o, alpha)
            m = m_new
        # 4) Normalise; rows that saw no key have l = 0 and stay zero.
        out[:, :, :, i0:i1] = (o / l.masked_fill(l == 0, 1.0)).to(dtype)
        # In float64 for float32 inputs: lse ~ the largest score, and its float32 rounding
        # alone would put weights rebuilt from it ~1e-5 off (a weight of 1.00002).
        lse[:, :, :, i0:i1] = m.to(lse.dtype) + torch.log(l.to(lse.dtype))  # -inf where l = 0
    return out.reshape(B, H, T, Dv), lse.reshape(B, H, T)  # (B, H, T, Dv), (B, H, T)


@torch.no_grad()
def _backward(q, k, v, out, lse, dout, dlse, mask, alibi, spec: _Spec):
    dtypes = (q.dtype, k.dtype, v.dtype)
    B, H, T, D, Hkv, S, G, acc, qg, k, v, gmask, galibi, plans = _prepare(
        q, k, v, mask, alibi, spec
    )
    Dv = v.shape[-1]
    dog = dout.to(acc).reshape(B, Hkv, G, T, Dv)  # (B, Hkv, G, T, Dv)
    # D_i = rowsum(dO ∘ O): the softmax Jacobian's correction term, once per query row.
    delta = (dout.to(acc) * out.to(acc)).sum(-1).reshape(B, Hkv, G, T, 1)
    if dlse is not None:
        delta = delta - dlse.to(acc).reshape(B, Hkv, G, T, 1)  # d lse / d s = p
    # Rows with no visible key: lse = -inf; +inf makes every recomputed p exactly 0.
    lse_b = lse.reshape(B, Hkv, G, T, 1)
    lse_b = lse_b.masked_fill(torch.isneginf(lse_b), float("inf")).to(acc)
    dq = torch.zeros(B, Hkv, G, T, D, dtype=acc, device=q.device)
    dk = torch.zeros(B, Hkv, S, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, Hkv, S, v.shape[-1], dtype=acc, device=q.device)
    for qi, row in enumerate(plans):
        i0, i1 = row.i0, row.i1
        bq = i1 - i0
        qs = qg[:, :, :, i0:i1].reshape(B, Hkv, G * bq, D)  # (B, Hkv, G·bq, D), scaled
        do = dog[:, :, :, i0:i1].reshape(B, Hkv, G * bq, Dv)  # (B, Hkv, G·bq, Dv)
        dq_blk = torch.zeros(B, Hkv, G * bq, D, dtype=acc, device=q.device)
        for plan in row.tiles:
            j0, j1 = plan.j0, plan.j1
            bk = j1 - j0
            kt, vt = _kv(k, v, j0, j1, acc)
            s = _tile_scores(qs, kt, plan, gmask, galibi, (B, Hkv, G, bq, bk), spec, acc)
            p = s.sub_(lse_b[:, :, :, i0:i1]).exp_()  # (B, Hkv, G, bq, bk): exact weights
            dp = (do @ vt.transpose(-2, -1)).view(B, Hkv, G, bq, bk)  # dL/d(applied p)
            p_applied = p
            if spec.dropout_p > 0.0:
                keep = _dropout_keep(spec, qi, plan.index, p.shape, p.device) / (1 - spec.dropout_p)
                p_applied = p * keep
                dp = dp * keep
            p2 = p_applied.view(B, Hkv, G * bq, bk)
            dv[:, :, j0:j1] += p2.transpose(-2, -1) @ do  # (B, Hkv, bk, Dv)
            ds = p.mul_(dp.sub_(delta[:, :, :, i0:i1]))  # (B, Hkv, G, bq, bk)
            ds2 = ds.view(B, Hkv, G * bq, bk)
            dq_blk += ds2 @ kt  # (B, Hkv, G·bq, D)
            dk[:, :, j0:j1] += ds2.transpose(-2, -1) @ qs  # (B, Hkv, bk, D)
        dq[:, :, :, i0:i1] = dq_blk.view(B, Hkv, G, bq, D)
    # qs carried the scale, so dK already has it; dQ = scale · dS K.
    dq = (dq * spec.scale).reshape(B, H, T, D)
    return dq.to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])
