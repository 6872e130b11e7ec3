"""Block-sparse :func:`qkv.flex_attention` on the Triton kernels of
:mod:`qkv.attention.triton.flex`: when it serves a call, how its tables are built, and the
autograd function that runs it.

It serves a call with a block mask and no ``score_mod``, or one of the ready score mods that
carry ``kernel_params`` (ALiBi, soft-capping, T5's relative bias: computed inside the
kernel, learned slopes and tables getting their gradient from the ``dQ`` kernel); any other
Python ``score_mod`` cannot run inside a Triton kernel, and such calls keep the tile loop of
:mod:`qkv.attention.flex`. It runs on CUDA
tensors in float32, bfloat16 and float16 (on CPU tensors only under ``TRITON_INTERPRET=1``,
when asked for with ``kernel_options={"backend": "triton"}``), with power-of-two block sizes
from 16 to 128 and head widths up to 256.

The tables come from the block mask once per device and are kept with it (a model hands the
same block mask to every layer, a training loop to every step): visited key tiles per query
tile, visiting query tiles per key tile, and ``mask_mod`` evaluated on the partial tiles
only, as ``(P, bq, bk)`` keep tiles (one row of tiles at a time, as
:func:`~qkv.attention.flex.blocks.create_block_mask` evaluated it).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.dropout import dropout_state
from qkv.attention.flex.blocks import (
    DEFAULT_BLOCK,
    EMPTY,
    PARTIAL,
    BlockMask,
    full_block_mask,
    tile_keep,
)
from qkv.attention.masks import safe_lse
from qkv.attention.score_mods import check_head_count, relative_position_bucket
from qkv.attention.triton import installed, interpreting
from qkv.checks import values_unknown

__all__ = ["ScoreMod", "Tables", "attend", "score_mod_params", "tables", "why_not"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def why_not(query: Tensor, value: Tensor, score_mod, block_mask: BlockMask | None,
            named: bool) -> str | None:
    """Why the Triton path cannot (or, unless ``named``, should not) serve a flex call."""
    if not installed():
        return "the triton package is not installed"
    if query.device.type != "cuda" and not (named and query.device.type == "cpu"
                                            and interpreting()):
        return "Triton runs on CUDA tensors"
    params = getattr(score_mod, "kernel_params", None)
    if score_mod is not None and params is None:
        return "a Python score_mod cannot run inside qkv's Triton kernels (the ready mods do)"
    if block_mask is None and score_mod is None:
        return "no block mask (qkv.scaled_dot_product_attention serves unmasked calls)"
    if query.dtype not in _DTYPES:
        return f"Triton computes float32, bfloat16 and float16, not {query.dtype}"
    bq, bk = (DEFAULT_BLOCK, DEFAULT_BLOCK) if block_mask is None else block_mask.block_size
    if any(b < 16 or b > 128 or b & (b - 1) for b in (bq, bk)):
        return f"block size {(bq, bk)}: the kernels take powers of two from 16 to 128"
    if max(query.shape[-1], value.shape[-1]) > 256:
        return "head width above 256"
    if values_unknown(query) or torch._C._functorch.is_functorch_wrapped_tensor(query):
        return "tracing or torch.func transforms: the kernels run eagerly"
    return None


@dataclass(frozen=True)
class Tables:
    """A block mask's tables on one device (see :mod:`qkv.attention.triton.flex`)."""

    kv_count: Tensor  # (B', H', nQ) int32
    kv_part: Tensor  # (B', H', nQ) int32: how many of them are partial
    kv_idx: Tensor  # (B', H', nQ, nK) int32: partial key tiles, then full ones, ascending
    q_count: Tensor  # (B', H', nK) int32
    q_part: Tensor  # (B', H', nK) int32
    q_idx: Tensor  # (B', H', nK, nQ) int32
    slot: Tensor  # (B', H', nQ, nK) int32: -1, or the tile's index in keep
    keep: Tensor  # (P, bq, bk) uint8


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tables(block_mask: BlockMask, device: torch.device) -> Tables:
    """``block_mask``'s tables on ``device``, built on first use and kept with the mask."""
    per_device = _TABLES.setdefault(block_mask, {})
    if str(device) not in per_device:
        per_device[str(device)] = _build(block_mask, device)
    return per_device[str(device)]


def _order(state: Tensor) -> Tensor:
    """Tile indices of each last-dimension row: the partial tiles, then the full ones, then
    the empty ones, each ascending."""
    rank = torch.where(state == PARTIAL, 0, torch.where(state > EMPTY, 1, 2)).to(torch.uint8)
    return torch.sort(rank, dim=-1, stable=True).indices.to(torch.int32)


def _build(block_mask: BlockMask, device: torch.device) -> Tables:
    state = block_mask.state  # (B', H', nQ, nK) uint8
    Bt, Ht, nq, nk = state.shape
    bq, bk = block_mask.block_size
    T, S = block_mask.q_len, block_mask.kv_len
    visited, partial = state > EMPTY, state == PARTIAL
    slot = torch.full(state.shape, -1, dtype=torch.int32)
    tiles, used = [], 0
    for i in range(nq):
        chosen = partial[:, :, i]  # (B', H', nK)
        n = int(chosen.sum())
        if n == 0:
            continue
        rows = range(i * bq, min(T, (i + 1) * bq))
        keep = tile_keep(block_mask.mask_mod, Bt, Ht, rows, range(S), device)  # (B',H',r,S)
        keep = F.pad(keep, (0, nk * bk - S, 0, bq - len(rows)), value=False)
        keep = keep.reshape(Bt, Ht, bq, nk, bk).permute(0, 1, 3, 2, 4)  # (B', H', nK, bq, bk)
        tiles.append(keep[chosen.to(device)].to(torch.uint8))  # (n, bq, bk), row-major
        slot[:, :, i][chosen] = torch.arange(used, used + n, dtype=torch.int32)
        used += n
    keep = torch.cat(tiles) if tiles else torch.ones(1, bq, bk, dtype=torch.uint8)
    return Tables(
        kv_count=visited.sum(-1).to(torch.int32).to(device),
        kv_part=partial.sum(-1).to(torch.int32).to(device),
        kv_idx=_order(state).to(device),
        q_count=visited.sum(-2).to(torch.int32).to(device),
        q_part=partial.sum(-2).to(torch.int32).to(device),
        q_idx=_order(state.transpose(-1, -2)).contiguous().to(device),
        slot=slot.to(device), keep=keep.to(device).contiguous(),
    )


@dataclass(frozen=True)
class ScoreMod:
    """A ready score mod as the kernels take it: ``kind`` 0 none, 1 ALiBi (``data (H,)``
    float32 slopes, ``offset``), 2 soft-cap (``cap``), 3 a bias by head and distance
    (``data (H, T + S - 1)`` float32, entry ``[h, j - i + T - 1]``: T5's relative bias)."""

    kind: int = 0
    data: Tensor | None = None
    offset: int = 0
    cap: float = 1.0


def score_mod_params(score_mod, query: Tensor, S: int) -> ScoreMod:
    """The kernels' form of ``score_mod`` (None, or one that carries ``kernel_params``) for
    ``query (B, H, T, D)`` against ``S`` keys."""
    params = getattr(score_mod, "kernel_params", None)
    if params is None:
        return ScoreMod()
    H, T = query.shape[1], query.shape[2]
    if params[0] == "softcap":
        return ScoreMod(2, cap=float(params[1]))
    values = params[1]  # learned ones get their gradient through ScoreMod.data
    what = {"alibi": "alibi slopes", "relative": "relative_bias table"}[params[0]]
    check_head_count(values.shape[-1], H, what)  # (the kernel would read past the data)
    if params[0] == "alibi":
        return ScoreMod(1, values.to(query.device, torch.float32), params[2])
    distance = torch.arange(-(T - 1), S, device=query.device)  # j - i, (T + S - 1,)
    bucket = relative_position_bucket(distance, *params[2:])
    table = values.to(query.device, query.dtype).float()  # the tile loop adds it in q's dtype
    return ScoreMod(3, table[bucket].t().contiguous())  # (H, T + S - 1)


def attend(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask | None, scale: float,
           score_mod=None, dropout_p: float = 0.0):
    """``(out (B, H, T, Dv), lse (B, H, T) float32)``, differentiable in q, k, v (and lse).

    ``dropout_p > 0`` drops weights by the counter-based mask of :mod:`qkv.attention.dropout`
    (one seed drawn here, the mask computed in the kernels, forward and backward): the mask
    the dense definition (``qkv.nn.core.flex_dense``) draws on a GPU. The lse is that of the
    weights before dropout.
    """
    if block_mask is None:  # a ready score mod alone: every tile full
        block_mask = full_block_mask(q.shape[2], k.shape[2])
    tab = tables(block_mask, q.device)
    mod = score_mod_params(score_mod, q, k.shape[2])
    data = mod.data if mod.data is not None else q.new_empty(0)
    drop = dropout_state(dropout_p, q.device) if dropout_p > 0.0 else None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, data)):
        return _FlexFunction.apply(q, k, v, data, tab, block_mask, scale, mod, drop,
                                   dropout_p)
    from qkv.attention.triton.launch import flex_forward as forward

    return forward(q, k, v, tab, block_mask, scale, mod, drop, dropout_p)


class _FlexFunction(torch.autograd.Function):
    """The Triton flex call, differentiable in q, k, v and the score mod's data (learned
    ALiBi slopes, a learned relative bias: their gradient comes out of the ``dQ`` kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, data, tab, block_mask, scale, mod, drop, dropout_p):
        from qkv.attention.triton.launch import flex_forward as forward

        mod = replace(mod, data=None if mod.data is None else data.detach())
        out, lse = forward(q, k, v, tab, block_mask, scale, mod, drop, dropout_p)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (tab, block_mask, scale, mod)
        ctx.dropout = (drop, dropout_p)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from qkv.attention.triton.launch import flex_backward as backward

        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grad_mod = ctx.needs_input_grad[3] and ctx.args[3].kind in (1, 3)
        dq, dk, dv, dmod = backward(q, k, v, out, safe_lse(lse), dout, dlse, *ctx.args,
                                    grad_mod=grad_mod, drop=ctx.dropout[0],
                                    dropout_p=ctx.dropout[1])
        return dq, dk, dv, dmod, None, None, None, None, None, None
