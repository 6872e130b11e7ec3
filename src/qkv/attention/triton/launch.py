"""Launching the Triton kernels of :mod:`qkv.attention.triton.kernels` and
:mod:`qkv.attention.triton.backward`: grids, strides, tile sizes, and the log-sum-exp merge of
flash-decoding's key splits.

Shapes: ``q (B, H, T, D)``, ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``, ``mask`` 4-D
broadcastable to ``(B, H, T, S)`` (bool keep or float added), ``alibi (H,)`` float32,
``keep`` dropout's ``(B, H, T, S)`` bool mask or ``(2,)`` int64 Philox state
(:mod:`qkv.attention.dropout`), ``lse (B, H, T)`` float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.triton import backward as triton_backward
from qkv.attention.triton import fast as triton_fast
from qkv.attention.triton import flex as triton_flex
from qkv.attention.triton import kernels as triton_kernels
from qkv.attention.triton import paged as triton_paged
from qkv.attention.triton import plan as triton_plan
from qkv.attention.triton.plan import (
    Plan,
    dropout_kind,
    kept,
    merge_launch,
    pow2,
    split_keys,
    splits,
    tile_options,
    width_flags,
)

__all__ = ["backward", "flex_backward", "flex_forward", "forward", "paged_forward"]


# Kernels (by name and compile-time options) whose launch fell back to fewer pipeline stages:
# the number that fit this GPU's shared memory.
_FEWER_STAGES: dict[tuple, int] = {}


def _launch(kernel, grid: tuple[int, ...], args: tuple, options: dict) -> None:
    """``kernel[grid](*args, **options)``; where this GPU's shared memory cannot hold
    ``num_stages`` pipelined tiles (Triton's OutOfResources, raised when compiling: H100/H200
    have 227 KiB a block, A100 163, many consumer GPUs 99), again with one stage fewer, and
    that number remembered."""
    from triton.runtime.errors import OutOfResources

    key = None
    if _FEWER_STAGES:  # (empty on a GPU that fits every tile: no key to build a launch)
        key = (kernel.__name__, *sorted(options.items()))
        options = options | {"num_stages": _FEWER_STAGES.get(key, options["num_stages"])}
    while True:
        try:
            triton_fast.launch(kernel, grid, args, options)
            return
        except OutOfResources:
            if options["num_stages"] <= 1:
                raise
            key = key or (kernel.__name__, *sorted(options.items()))
            options = options | {"num_stages": options["num_stages"] - 1}
            _FEWER_STAGES[key] = options["num_stages"]


def _mask_args(mask: Tensor | None, q: Tensor) -> tuple[Tensor, int, tuple[int, ...]]:
    """``(tensor, kind, strides)``: kind 0 none, 1 bool keep (as uint8), 2 float added;
    a broadcast (size-1) dimension gets stride 0."""
    if mask is None:
        return q, 0, (0, 0, 0, 0)
    strides = tuple(0 if n == 1 else s for n, s in zip(mask.shape, mask.stride(), strict=True))
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), 1, strides
    return mask, 2, strides


def _call_args(q, mask, alibi, keep, spec):
    """What the dense kernels read of a call besides q, k, v: ``(extras, mask kind, mask
    strides, scalars)``, the extras the mask, dropout's keep mask or state and the ALiBi
    slopes (``q`` where absent)."""
    m, kind, mstrides = _mask_args(mask, q)
    keep_scale = 1.0 / (1.0 - spec.dropout_p) if keep is not None else 1.0
    scalars = (spec.scale, spec.causal or 0, spec.window or 0, spec.alibi_shift, keep_scale)
    keep = keep.view(torch.uint8) if keep is not None and keep.dtype == torch.bool else keep
    extras = (m, q if keep is None else keep, q if alibi is None else alibi)
    return extras, kind, mstrides, scalars


def _flags(q, v, kind: int, alibi, keep, spec) -> dict:
    """The dense kernels' constexprs for mask ``kind`` (:func:`_mask_args`)."""
    return dict(MASK_KIND=kind, IS_CAUSAL=spec.causal is not None,
                HAS_WINDOW=spec.window is not None, HAS_ALIBI=alibi is not None,
                DROPOUT=dropout_kind(keep)) | width_flags(q.dtype, q.shape[-1], v.shape[-1])


def _unit_last(t: Tensor) -> Tensor:
    """``t`` with its last dimension contiguous, as the kernels read it (an expanded
    gradient, such as that of ``out.sum()``, has stride 0 there)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def forward(q, k, v, mask, alibi, keep, spec) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, Dv) in q's dtype, lse (B, H, T) float32)``."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, H, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    extras, kind, mstrides, scalars = _call_args(q, mask, alibi, keep, spec)
    plan = kept((q.shape, k.shape, v.shape, q.dtype, q.device, kind, mstrides, alibi is None,
                  dropout_kind(keep), spec.causal is None, spec.window is None),
                 lambda: _forward_plan(q, k, v, kind, alibi, keep, spec))
    o_buf, l_buf = _split_outputs(plan.splits, (B, H, T), Dv, q)
    _launch(triton_kernels.attention_forward, plan.grid, (
        q, k, v, o_buf, l_buf, *extras,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_buf.stride()[1:4],
        *l_buf.stride()[1:3], *mstrides, o_buf.stride(0), l_buf.stride(0),
        H, H // Hkv, T, S, D, Dv, plan.split_len, *scalars,
    ), plan.options)
    return _merged(o_buf, l_buf, q.dtype, plan)


def _forward_plan(q, k, v, kind: int, alibi, keep, spec) -> Plan:
    """Grid, key splits, tiles and flags of a forward launch, and of its merge (of ``spec``
    only whether there is a causal diagonal and a window: the key :func:`forward` keeps it
    by)."""
    B, H, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    flags = _flags(q, v, kind, alibi, keep, spec)
    t = triton_plan.tiles("forward", G * T, max(D, Dv), q.dtype,
                          kind != 0 or alibi is not None or keep is not None, keep is not None)
    row_blocks = -(-G * T // t.block_m)
    n = splits(q, row_blocks * B * Hkv, S, t.block_n, t.resident) if keep is None else 1
    n, split_len = split_keys(S, n, t.block_n)
    return Plan((row_blocks, B * Hkv, n), n, split_len, flags | tile_options(t),
                 *merge_launch(B * H * T, Dv))


def _split_outputs(n: int, rows: tuple[int, int, int], Dv: int, q: Tensor):
    """Where ``n`` key splits write: ``(o (n, B, H, T, Dv), lse (n, B, H, T))``, float32
    partials for several splits (one allocation: views of one buffer, each 16-byte aligned),
    the final output (q's dtype) and lse for one."""
    if n == 1:
        o_buf = torch.empty(1, *rows, Dv, dtype=q.dtype, device=q.device)
        return o_buf, torch.empty(1, *rows, dtype=torch.float32, device=q.device)
    count = n * rows[0] * rows[1] * rows[2]
    at = -(-count * Dv // 4) * 4  # (floats: a multiple of 16 bytes)
    scratch = torch.empty(at + count, dtype=torch.float32, device=q.device)
    return scratch[:count * Dv].view(n, *rows, Dv), scratch[at:].view(n, *rows)


def _merged(o_buf: Tensor, l_buf: Tensor, dtype: torch.dtype,
            plan: Plan) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, Dv) in dtype, lse (B, H, T))`` of the splits in ``o_buf``/``l_buf``."""
    n = plan.splits
    if n == 1:
        return o_buf[0], l_buf[0]
    out = o_buf.new_empty(o_buf.shape[1:], dtype=dtype)
    lse = l_buf.new_empty(l_buf.shape[1:])
    _launch(triton_kernels.merge_splits, plan.merge_grid,
            (o_buf, l_buf, out, lse, n, lse.numel(), o_buf.shape[-1]), plan.merge_options)
    return out, lse


def paged_forward(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor,
                  positions: Tensor, scale: float) -> Tensor:
    """Paged attention (:mod:`qkv.attention.triton.paged`): ``q (B, H, T, D)`` over the
    pages of pools ``(N, Hkv, P, D|Dv)`` named by ``tables (B, W)`` (int64), each query at
    ``positions (B, T)`` (int64) seeing its sequence's keys up to it; ``(B, H, T, Dv)``."""
    q = _unit_last(q)
    B, H, T, D = q.shape
    Hkv, Dv = k_pool.shape[1], v_pool.shape[3]
    W = tables.shape[1]
    plan = kept((q.shape, k_pool.shape, v_pool.shape, W, q.dtype, q.device, "paged"),
                 lambda: _paged_plan(q, k_pool, v_pool, W))
    o_buf, l_buf = _split_outputs(plan.splits, (B, H, T), Dv, q)
    _launch(triton_paged.paged_forward, plan.grid, (
        q, k_pool, v_pool, tables.contiguous(), positions.contiguous(), o_buf, l_buf,
        *q.stride()[:3], *k_pool.stride()[:3], *v_pool.stride()[:3], *o_buf.stride()[1:4],
        *l_buf.stride()[1:3], o_buf.stride(0), l_buf.stride(0),
        H, H // Hkv, T, D, Dv, W, plan.split_len, scale,
    ), plan.options)
    return _merged(o_buf, l_buf, q.dtype, plan)[0]


def _paged_plan(q: Tensor, k_pool: Tensor, v_pool: Tensor, W: int) -> Plan:
    """Grid, key splits, tiles and flags of a paged launch over ``W`` pages a sequence."""
    B, H, T, D = q.shape
    Hkv, P, Dv = k_pool.shape[1], k_pool.shape[2], v_pool.shape[3]
    G, S = H // Hkv, W * P  # the tables cover every position a query of the batch sees
    t = triton_plan.tiles("paged", G * T, max(D, Dv), q.dtype)
    row_blocks = -(-G * T // t.block_m)
    n, split_len = split_keys(S, splits(q, row_blocks * B * Hkv, S, t.block_n, t.resident),
                              t.block_n)
    flags = dict(P=P) | width_flags(q.dtype, D, Dv)
    return Plan((row_blocks, B * Hkv, n), n, split_len, flags | tile_options(t),
                 *merge_launch(B * H * T, Dv))


def _delta(out: Tensor, dout: Tensor, dlse: Tensor | None) -> Tensor:
    """``δ (B, H, T)`` float32 contiguous: ``rowsum(dO ∘ O)`` less the lse's own gradient
    (``d lse / d s = p``), what both backward kernels subtract from ``dP``; one kernel
    (:func:`qkv.attention.triton.backward.row_deltas`) reading ``O`` and ``dO`` once."""
    B, H, T, Dv = out.shape
    delta = torch.empty(B, H, T, dtype=torch.float32, device=out.device)
    rows = B * H * T
    dlse_at = delta if dlse is None else dlse.float().contiguous()  # (unread without one)
    block = max(1, min(64, 8192 // pow2(Dv)))  # rows a program: 8K elements of each
    _launch(triton_backward.row_deltas, (-(-rows // block),), (
        out, dout, dlse_at, delta, rows, H, T, Dv, *out.stride()[:3], *dout.stride()[:3],
    ), dict(HAS_DLSE=dlse is not None, BLOCK_R=block, BLOCK_DV=pow2(Dv), num_warps=4,
            num_stages=1))
    return delta


def backward(q, k, v, out, lse_safe, dout, dlse, mask, alibi, keep, spec):
    """``(dq, dk, dv)`` from the forward's output and lse (``+inf`` on dead rows)."""
    q, k, v, dout = (_unit_last(t) for t in (q, k, v, dout))
    B, H, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    delta, lse_safe = _delta(out, dout, dlse), lse_safe.float().contiguous()
    extras, kind, mstrides, scalars = _call_args(q, mask, alibi, keep, spec)
    dq = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, S, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, Hkv, S, Dv, dtype=v.dtype, device=q.device)
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
              *mstrides, H, G, T, S, D, Dv, *scalars)
    t = triton_plan.tiles("backward", G * T, max(D, Dv), q.dtype,
                          mask is not None or alibi is not None or keep is not None)
    options = _flags(q, v, kind, alibi, keep, spec) | tile_options(t)
    _launch(triton_backward.attention_backward_dkdv, (-(-S // t.block_n), B * Hkv),
            (q, k, v, dout, lse_safe, delta, dk, dv, *extras, *common), options)
    _launch(triton_backward.attention_backward_dq, (-(-G * T // t.block_m), B * Hkv),
            (q, k, v, dout, lse_safe, delta, dq, *extras, *common), options)
    return dq, dk, dv


def _flex_args(q, k, v, tab, block_mask, mod, kind, dropout=False):
    """Arguments the three flex kernels share (after their tensors and strides), and the
    launch options of ``kind``."""
    H, T, D = q.shape[1:]
    Bt, Ht, nq, nk = tab.slot.shape
    flags = width_flags(q.dtype, D, v.shape[-1])
    bq, bk = block_mask.block_size
    # T and S whole blocks: every tile lies inside T × S, so no load or score needs the edge
    # masks (torch's flex kernels' IS_DIVISIBLE).
    flags["EVEN"] = T % bq == 0 and k.shape[2] % bk == 0
    t = triton_plan.flex_tiles(kind, (bq, bk), max(D, v.shape[-1]), q.dtype, dropout)
    launch = dict(SPARSE_M=bq, SPARSE_N=bk, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                  num_warps=t.warps, num_stages=t.stages)
    sizes = (H, H // k.shape[1], T, k.shape[2], D, v.shape[-1], nq, nk, int(Bt > 1),
             int(Ht > 1), Ht)
    flags["SCORE_MOD"] = mod.kind
    data = q if mod.data is None else mod.data
    return sizes, data, (mod.offset, mod.cap), flags | launch


def _flex_dropout(q: Tensor, drop: Tensor | None, dropout_p: float) -> tuple[Tensor, float]:
    """The flex kernels' ``(DROP, keep_scale)``: the Philox state (or any pointer without
    dropout) and ``1 / (1 - p)``."""
    return (q, 1.0) if drop is None else (drop, 1.0 / (1.0 - dropout_p))


def flex_forward(q, k, v, tab, block_mask, scale, mod, drop=None,
                 dropout_p=0.0) -> tuple[Tensor, Tensor]:
    """Block-sparse flex forward: ``(out (B, H, T, Dv), lse (B, H, T) float32)``; ``drop``:
    None, or dropout's ``(2,)`` int64 Philox state (:mod:`qkv.attention.dropout`) with
    ``dropout_p``, the mask computed in the kernel."""
    q, k, v = (_unit_last(t) for t in (q, k, v))
    B, H, T, _ = q.shape
    out = torch.empty(B, H, T, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    sizes, slopes, mod_args, options = _flex_args(q, k, v, tab, block_mask, mod, "forward")
    tiles_m = tab.slot.shape[2] * (options["SPARSE_M"] // options["BLOCK_M"])
    dropper, keep_scale = _flex_dropout(q, drop, dropout_p)
    _launch(triton_flex.flex_forward, (tiles_m, B * H), (
        q, k, v, out, lse, tab.kv_count, tab.kv_part, tab.kv_idx, tab.slot, tab.keep, slopes,
        dropper, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        *sizes, scale, *mod_args, keep_scale), options | {"DROPOUT": int(drop is not None)})
    return out, lse


def flex_backward(q, k, v, out, lse_safe, dout, dlse, tab, block_mask, scale, mod,
                  grad_mod: bool = False, drop=None, dropout_p=0.0):
    """``(dq, dk, dv, d mod.data)`` of the block-sparse flex call (``lse_safe``: ``+inf`` on
    dead rows); the last None unless ``grad_mod`` (learned ALiBi slopes or relative bias).
    ``drop``/``dropout_p``: the forward's (its mask computed again)."""
    q, k, v, dout = (_unit_last(t) for t in (q, k, v, dout))
    B, H, T, D = q.shape
    delta, lse_safe = _delta(out, dout, dlse), lse_safe.float().contiguous()
    dq = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=q.device)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    sizes, slopes, mod_args, options = _flex_args(q, k, v, tab, block_mask, mod, "dkdv",
                                                  drop is not None)
    tiles_n = tab.slot.shape[3] * (options["SPARSE_N"] // options["BLOCK_N"])
    dropper, keep_scale = _flex_dropout(q, drop, dropout_p)
    dropping = {"DROPOUT": int(drop is not None)}
    _launch(triton_flex.flex_backward_dkdv, (tiles_n, B * k.shape[1]), (
        q, k, v, dout, lse_safe, delta, dk, dv, tab.q_count, tab.q_part, tab.q_idx, tab.slot,
        tab.keep, slopes, dropper, *strides, *sizes, scale, *mod_args, keep_scale),
        options | dropping)
    sizes, slopes, mod_args, options = _flex_args(q, k, v, tab, block_mask, mod, "dq")
    tiles_m = tab.slot.shape[2] * (options["SPARSE_M"] // options["BLOCK_M"])
    dmod = torch.zeros_like(mod.data, dtype=torch.float32) if grad_mod else None
    _launch(triton_flex.flex_backward_dq, (tiles_m, B * H), (
        q, k, v, dout, lse_safe, delta, dq, tab.kv_count, tab.kv_part, tab.kv_idx, tab.slot,
        tab.keep, slopes, slopes if dmod is None else dmod, dropper, *strides, *sizes, scale,
        *mod_args, keep_scale), options | dropping | {"GRAD_MOD": grad_mod})
    return dq, dk, dv, dmod
