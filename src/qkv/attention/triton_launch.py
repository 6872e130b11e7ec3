"""Launching the Triton kernels of :mod:`qkv.attention.triton_kernels` and
:mod:`qkv.attention.triton_backward`: grids, strides, tile sizes, and the log-sum-exp merge of
flash-decoding's key splits.

Shapes: ``q (B, H, T, D)``, ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``, ``mask`` 4-D
broadcastable to ``(B, H, T, S)`` (bool keep or float added), ``alibi (H,)`` float32,
``keep`` dropout's ``(B, H, T, S)`` bool mask or ``(2,)`` int64 Philox state
(:mod:`qkv.attention.dropout`), ``lse (B, H, T)`` float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention import triton_backward, triton_fast, triton_flex, triton_kernels, triton_paged
from qkv.attention.triton_env import interpreting

__all__ = ["Tiles", "backward", "flex_backward", "flex_forward", "flex_tiles", "forward",
           "paged_forward", "tiles"]


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch options of one kernel."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    resident: int = 2  # programs a multiprocessor holds at once (what key splits fill)


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


def tiles(kind: str, rows: int, width: int, dtype: torch.dtype, extras: bool = False,
          dropout: bool = False) -> Tiles:
    """Tiles for ``kind`` (``"forward"``, ``"backward"`` or ``"paged"``) of ``rows`` packed
    query rows and head width ``width`` (the larger of ``D`` and ``Dv``, padded to a power of
    two); ``extras``: the kernel also reads a mask or ALiBi slopes, or computes dropout's
    mask, each tile; ``dropout``: it computes dropout's mask.

    Interpreted (CPU) runs take 16×16 tiles, so small test shapes still cross tiles. On a GPU,
    wider heads and float32 (twice the bytes a tile) take smaller tiles to fit shared memory.
    """
    if interpreting():
        return Tiles(16, 16, 1, 1)
    width = _pow2(width)
    wide = width > 128 or dtype == torch.float32
    if kind == "paged":
        # Each key row's address comes from its page: more registers than a dense tile
        # (sm_90, a decoding step: 64 keys, 4 warps and 3 stages took 175 registers, 2
        # programs a multiprocessor; 2 stages 158, 3 programs; benchmarks/triton_static.py).
        if rows <= 16:
            return Tiles(_pow2(rows), 32 if wide else 64, 4, 2, 3)
        return Tiles(64, 32 if wide else 64, 4, 2)
    if kind == "forward":
        # Measured on an H200 (benchmarks/triton_tiles.py, bf16, D = 128, T = 4096, the
        # edge/inner kernels): 128×128 tiles with 8 warps 1.15 ms, 128×64/8 1.25, 64×64/4 1.27.
        # With a mask or ALiBi, 128×128 tiles overflow shared memory (a (T, S) bool mask:
        # 262,144 of 232,448 bytes) or registers (ALiBi 1.91 ms against 1.15 with 64×64/4).
        # Dropout's Philox tile needs registers of its own: 64×64 with it spilled 136 bytes
        # and held one program a multiprocessor, 64×32 spills none and holds two (sm_90,
        # T = 4096, benchmarks/triton_static.py; unmeasured on a GPU).
        m, n, warps = ((64, 32, 4) if wide or dropout else (64, 64, 4) if extras
                       else (128, 128, 8) if width > 64 else (128, 64, 4))
        if rows < m:  # decoding: the group's rows in one tile
            # 64 keys a tile and 4 warps, as a decoding step streams keys: 104 registers and
            # 70 KiB of shared memory, so 3 programs a multiprocessor, where 128 keys with 8
            # warps held one (sm_90, benchmarks/triton_static.py; unmeasured on a GPU).
            return Tiles(_pow2(rows), min(n, 64), 4, 2 if wide else 3, 2 if wide else 3)
        return Tiles(m, n, warps, 2 if wide else 3)
    if wide:
        return Tiles(32, 32, 4, 2)
    # With a mask, ALiBi or dropout each score, 64×64 tiles spill in dK/dV (sm_90, T = 4096,
    # causal: ALiBi 376 bytes a thread, dropout 432); 64 queries × 32 keys spill nothing with
    # ALiBi, 24 bytes with dropout, none in dQ (benchmarks/triton_static.py; unmeasured on a
    # GPU). Plain calls keep the 64×64 the H200 tile sweep chose.
    return Tiles(64, 32, 4, 2) if extras else Tiles(64, 64, 4, 2)


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


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not interpreting() and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _mask_args(mask: Tensor | None, q: Tensor) -> tuple[Tensor, int, tuple[int, ...]]:
    """``(tensor, kind, strides)``: kind 0 none, 1 bool keep (as uint8), 2 float added;
    a broadcast (size-1) dimension gets stride 0."""
    if mask is None:
        return q, 0, (0, 0, 0, 0)
    strides = tuple(0 if n == 1 else s for n, s in zip(mask.shape, mask.stride(), strict=True))
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), 1, strides
    return mask, 2, strides


def _options(q, k, v, mask, alibi, keep, spec):
    """Arguments shared by the three kernels: tensors, strides, sizes, flags."""
    m, kind, mstrides = _mask_args(mask, q)
    flags = dict(
        MASK_KIND=kind, IS_CAUSAL=spec.causal is not None, HAS_WINDOW=spec.window is not None,
        HAS_ALIBI=alibi is not None, DROPOUT=_dropout_kind(keep),
        PRECISION=_precision(q.dtype), UPCAST=interpreting() and q.dtype == torch.bfloat16,
        BLOCK_D=_pow2(q.shape[-1]), BLOCK_DV=_pow2(v.shape[-1]),
    )
    flags["EVEN_D"] = flags["BLOCK_D"] == q.shape[-1] and flags["BLOCK_DV"] == v.shape[-1]
    keep_scale = 1.0 / (1.0 - spec.dropout_p) if keep is not None else 1.0
    scalars = (spec.scale, spec.causal or 0, spec.window or 0, spec.alibi_shift, keep_scale)
    keep = keep.view(torch.uint8) if keep is not None and keep.dtype == torch.bool else keep
    extras = (m, q if keep is None else keep, q if alibi is None else alibi)
    return extras, mstrides, scalars, flags


def _dropout_kind(keep: Tensor | None) -> int:
    """The kernels' ``DROPOUT``: 0 none, 1 a drawn keep mask ``(B, H, T, S)`` bool, 2 the
    counter-based mask of a ``(2,)`` int64 state (:func:`qkv.attention.dropout.dropout_state`)."""
    if keep is None:
        return 0
    return 1 if keep.dtype == torch.bool else 2


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _gpu_multiprocessors(device: torch.device) -> int | None:
    """The GPU's multiprocessor count; None for CPU tensors (the interpreter)."""
    return None if device.type == "cpu" else _multiprocessors(device.index or 0)


def _splits(q: Tensor, programs: int, S: int, block_n: int, per_sm: int = 2) -> int:
    """Key splits for a launch of ``programs`` programs: enough for ``per_sm`` programs on
    every multiprocessor (the most that fit at once: no second, partial wave), with at least
    256 keys (4 tiles under the interpreter) in each."""
    sms = _gpu_multiprocessors(q.device)
    units = 4 if sms is None else per_sm * sms
    least = 4 * block_n if sms is None else 256
    return max(1, min(units // programs or 1, S // least))


def _unit_last(t: Tensor) -> Tensor:
    """``t`` with its last dimension contiguous, as the kernels read it (an expanded
    gradient, such as that of ``out.sum()``, has stride 0 there)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def forward(q, k, v, mask, alibi, keep, spec) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, Dv) in q's dtype, lse (B, H, T) float32)``."""
    q, k, v = (_unit_last(t) for t in (q, k, v))
    B, H, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    extras, mstrides, scalars, flags = _options(q, k, v, mask, alibi, keep, spec)
    t = tiles("forward", G * T, max(D, Dv), q.dtype,
              mask is not None or alibi is not None or keep is not None, keep is not None)
    row_blocks = -(-G * T // t.block_m)
    n = _splits(q, row_blocks * B * Hkv, S, t.block_n, t.resident) if keep is None else 1
    n, split_len = _split_len(S, n, t.block_n)
    o_buf, l_buf = _split_outputs(n, (B, H, T), Dv, q)
    _launch(triton_kernels.attention_forward, (row_blocks, B * Hkv, n), (
        q, k, v, o_buf, l_buf, *extras,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_buf.stride()[1:4],
        *l_buf.stride()[1:3], *mstrides, o_buf.stride(0), l_buf.stride(0),
        H, G, T, S, D, Dv, split_len, *scalars,
    ), flags | dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps,
                    num_stages=t.stages))
    return _merged(o_buf, l_buf, q.dtype)


def _split_len(S: int, n: int, block_n: int) -> tuple[int, int]:
    """``(splits, keys a split)``: ``n`` splits of ``S`` keys, each a whole number of tiles."""
    split_len = -(-S // n)  # ceil
    split_len = -(-split_len // block_n) * block_n
    return -(-S // split_len), split_len


def _split_outputs(n: int, rows: tuple[int, int, int], Dv: int, q: Tensor):
    """Where ``n`` key splits write: ``(o (n, B, H, T, Dv), lse (n, B, H, T))``, float32
    partials for several splits, the final output (q's dtype) and lse for one."""
    dtype = q.dtype if n == 1 else torch.float32
    o_buf = torch.empty(n, *rows, Dv, dtype=dtype, device=q.device)
    return o_buf, torch.empty(n, *rows, dtype=torch.float32, device=q.device)


def _merged(o_buf: Tensor, l_buf: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, Dv) in dtype, lse (B, H, T))`` of the splits in ``o_buf``/``l_buf``."""
    n, Dv = o_buf.shape[0], o_buf.shape[-1]
    if n == 1:
        return o_buf[0], l_buf[0]
    rows = l_buf.numel() // n
    out = o_buf.new_empty(o_buf.shape[1:], dtype=dtype)
    lse = l_buf.new_empty(l_buf.shape[1:])
    # 4 rows a program, 16 splits a load (a decoding step's few rows over more programs,
    # its splits read at once: a (16, 4, 128) float32 tile is 64 registers a thread).
    block = 4
    _launch(triton_kernels.merge_splits, (-(-rows // block),),
            (o_buf, l_buf, out, lse, n, rows, Dv),
            dict(BLOCK_R=block, BLOCK_DV=_pow2(Dv), BLOCK_S=16, num_warps=4, num_stages=3))
    return out, lse


def paged_forward(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor,
                  positions: Tensor, scale: float) -> Tensor:
    """Paged attention (:mod:`qkv.attention.triton_paged`): ``q (B, H, T, D)`` over the
    pages of pools ``(N, Hkv, P, D|Dv)`` named by ``tables (B, W)`` (int64), each query at
    ``positions (B, T)`` (int64) seeing its sequence's keys up to it; ``(B, H, T, Dv)``."""
    q = _unit_last(q)
    B, H, T, D = q.shape
    Hkv, P, Dv = k_pool.shape[1], k_pool.shape[2], v_pool.shape[3]
    G, W = H // Hkv, tables.shape[1]
    S = W * P  # the tables cover every position a query of the batch sees
    t = tiles("paged", G * T, max(D, Dv), q.dtype)
    row_blocks = -(-G * T // t.block_m)
    n, split_len = _split_len(S, _splits(q, row_blocks * B * Hkv, S, t.block_n, t.resident),
                              t.block_n)
    o_buf, l_buf = _split_outputs(n, (B, H, T), Dv, q)
    flags = dict(PRECISION=_precision(q.dtype), BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
                 UPCAST=interpreting() and q.dtype == torch.bfloat16)
    flags["EVEN_D"] = flags["BLOCK_D"] == D and flags["BLOCK_DV"] == Dv
    _launch(triton_paged.paged_forward, (row_blocks, B * Hkv, n), (
        q, k_pool, v_pool, tables.contiguous(), positions.contiguous(), o_buf, l_buf,
        *q.stride()[:3], *k_pool.stride()[:3], *v_pool.stride()[:3], *o_buf.stride()[1:4],
        *l_buf.stride()[1:3], o_buf.stride(0), l_buf.stride(0),
        H, G, T, D, Dv, W, P, split_len, scale,
    ), flags | dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps,
                    num_stages=t.stages))
    return _merged(o_buf, l_buf, q.dtype)[0]

def _delta(out: Tensor, dout: Tensor, dlse: Tensor | None) -> Tensor:
    """``δ (B, H, T)`` float32 contiguous: ``rowsum(dO ∘ O)`` less the lse's own gradient
    (``d lse / d s = p``), what both backward kernels subtract from ``dP``; one kernel
    (:func:`qkv.attention.triton_backward.row_deltas`) reading ``O`` and ``dO`` once."""
    B, H, T, Dv = out.shape
    delta = torch.empty(B, H, T, dtype=torch.float32, device=out.device)
    rows = B * H * T
    dlse_at = delta if dlse is None else dlse.float().contiguous()  # (unread without one)
    block = max(1, min(64, 8192 // _pow2(Dv)))  # rows a program: 8K elements of each
    _launch(triton_backward.row_deltas, (-(-rows // block),), (
        out, dout, dlse_at, delta, rows, H, T, Dv, *out.stride()[:3], *dout.stride()[:3],
    ), dict(HAS_DLSE=dlse is not None, BLOCK_R=block, BLOCK_DV=_pow2(Dv), num_warps=4,
            num_stages=1))
    return delta


def backward(q, k, v, out, lse_safe, dout, dlse, mask, alibi, keep, spec):
    """``(dq, dk, dv)`` from the forward's output and lse (``+inf`` on dead rows)."""
    q, k, v, dout = (_unit_last(t) for t in (q, k, v, dout))
    B, H, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    delta, lse_safe = _delta(out, dout, dlse), lse_safe.float().contiguous()
    extras, mstrides, scalars, flags = _options(q, k, v, mask, alibi, keep, spec)
    dq = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, S, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, Hkv, S, Dv, dtype=v.dtype, device=q.device)
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
              *mstrides, H, G, T, S, D, Dv, *scalars)
    t = tiles("backward", G * T, max(D, Dv), q.dtype,
              mask is not None or alibi is not None or keep is not None)
    options = flags | dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps,
                           num_stages=t.stages)
    _launch(triton_backward.attention_backward_dkdv, (-(-S // t.block_n), B * Hkv),
            (q, k, v, dout, lse_safe, delta, dk, dv, *extras, *common), options)
    _launch(triton_backward.attention_backward_dq, (-(-G * T // t.block_m), B * Hkv),
            (q, k, v, dout, lse_safe, delta, dq, *extras, *common), options)
    return dq, dk, dv


def flex_tiles(kind: str, block_size: tuple[int, int], width: int,
               dtype: torch.dtype, dropout: bool = False) -> Tiles:
    """Tiles of the flex kernel ``kind`` (``"forward"``, ``"dq"`` or ``"dkdv"``) for a block
    mask of ``block_size`` ``(bq, bk)`` and head width ``width`` (the larger of ``D`` and
    ``Dv``): each side at most its block (which it divides: both are powers of two).

    On a GPU these are torch's own choices for its flex kernels on Hopper (bf16/fp16: the
    forward 128 × 64 with 8 warps and 3 stages, the backward 64-row query tiles against
    128-key tiles for dK/dV and 128 × 64 for dQ), which hold no spilled registers where
    128 × 128 spilled 1 KiB a thread in dK/dV (``python -m benchmarks.triton_static``).
    With dropout, ``dK``/``dV`` takes 32-row query tiles: its Philox tile, computed and
    transposed each step, spilled 496 bytes a thread at 64 rows, 160 at 32 (document mask,
    T = 1024). Interpreted (CPU) runs take 16 × 16, so small block masks still cross tiles.
    """
    bq, bk = block_size
    if interpreting():
        m, n, warps, stages = 16, 16, 1, 1
    else:
        width = _pow2(width)
        if dtype == torch.float32 or width > 128:
            m, n, warps, stages = (32, 32, 4, 2) if kind == "forward" else (32, 32, 4, 1)
        elif kind == "forward":
            m, n, warps, stages = (128, 64, 8, 3) if width > 64 else (128, 128, 4, 3)
        else:
            m, n, warps, stages = {"dq": (128, 64, 8, 3),
                                   "dkdv": (32 if dropout else 64, 128, 8, 3)}[kind]
    return Tiles(min(m, bq), min(n, bk), warps, stages)


def _flex_args(q, k, v, tab, block_mask, mod, kind, dropout=False):
    """Arguments the three flex kernels share (after their tensors and strides), and the
    launch options of ``kind``."""
    H, T, D = q.shape[1:]
    Bt, Ht, nq, nk = tab.slot.shape
    flags = dict(PRECISION=_precision(q.dtype), BLOCK_D=_pow2(D), BLOCK_DV=_pow2(v.shape[-1]),
                 UPCAST=interpreting() and q.dtype == torch.bfloat16)
    flags["EVEN_D"] = flags["BLOCK_D"] == D and flags["BLOCK_DV"] == v.shape[-1]
    bq, bk = block_mask.block_size
    t = flex_tiles(kind, (bq, bk), max(D, v.shape[-1]), q.dtype, dropout)
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
