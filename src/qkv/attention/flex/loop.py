"""The tile loop of programmable attention: :func:`qkv.flex_attention` on qkv's blockwise
kernel in PyTorch ops (the CPU's fast path, and every call the GPU kernels do not serve).

Tiles the block mask marks empty are skipped, full tiles evaluate no mask, partial tiles
evaluate ``mask_mod`` on their own index grid; consecutive visited key blocks are attended as
one span (:data:`SPAN_KEYS`) and query blocks that visit the same spans together
(:data:`GROUP_ROWS`). ``score_mod`` runs on each visited tile's scores, vectorised over
broadcastable index tensors (``b (B,1,1,1)``, ``h (1,H,1,1)``, ``q_idx (1,1,bq,1)``,
``kv_idx (1,1,1,bk)``), in float32 for half-precision inputs. Without a ``score_mod`` the
spans run on torch's fused kernel (:mod:`qkv.attention.flex.fused`).

The backward pass recomputes one query block at a time (activation checkpointing of the row
block: torch's autograd differentiates the block's online softmax and ``score_mod``), so
tensors that ``score_mod`` captures, a learned bias table say, get their gradients, and the
memory held between forward and backward is the inputs alone (O(T)); the backward's
transient is one row block of tiles, ``(B, H, bq, S)``.

Shapes: ``query (B, H, T, D)``, ``key (B, Hkv, S, D)``, ``value (B, Hkv, S, Dv)``; output
``(B, H, T, Dv)``, lse ``(B, H, T)``.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.flex.blocks import (
    DEFAULT_BLOCK,
    EMPTY,
    FULL,
    PARTIAL,
    BlockMask,
    index_grid,
    tile_keep,
)
from qkv.attention.flex.fused import assemble, fused_attention, fused_serves
from qkv.attention.masks import accumulation_dtype
from qkv.checks import values_unknown

__all__ = ["GROUP_ROWS", "SPAN_KEYS", "Plan", "all_visited", "check_finite_scores",
           "checked_scores", "rebuilt_weights", "results", "tile_loop", "visits"]


def tile_loop(query, key, value, score_mod, block_mask, scale, return_lse, need_weights):
    """:func:`qkv.flex_attention` on the tile loop: ``query (B, H, T, D)``, ``key (B, Hkv,
    S, D)``, ``value (B, Hkv, S, Dv)``; returns as :func:`results` does."""
    plan = Plan.of(query, key, score_mod, block_mask, scale)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    groups = _row_groups(plan.visit, plan.bq, plan.T)
    if fused_serves(query, value, score_mod, grad, return_lse):
        # No score_mod: spans on torch's fused kernel, its fused backward per span.
        out, lse = fused_attention(query, key, value, groups, plan)
    elif grad:
        outs, lses = [], []
        for i0, i1, tiles in groups:
            o, lse = checkpoint(_row_block, query[:, :, i0:i1], key, value, i0, tiles,
                                plan, use_reentrant=False)
            outs.append(o)
            lses.append(lse)
        out = torch.cat(outs, dim=2)  # (B, H, T, Dv)
        lse = torch.cat(lses, dim=2)  # (B, H, T)
    else:
        with torch.no_grad():
            out, lse = assemble(groups, lambda i0, i1, tiles: _row_block(
                query[:, :, i0:i1], key, value, i0, tiles, plan, inplace=True))
    if score_mod is not None:
        check_finite_scores(lse, query, score_mod)
    return results(query, key, out, lse, plan, return_lse, need_weights)


def results(query: Tensor, key: Tensor, out: Tensor, lse: Tensor, plan: Plan,
            return_lse: bool, need_weights: bool):
    """What :func:`qkv.flex_attention` returns on every path: ``out (B, H, T, Dv)``, then
    the lse ``(B, H, T)`` and the weights ``(B, H, T, S)`` rebuilt from it on the visited
    tiles, as asked (a tuple when more than ``out``)."""
    result = [out] + ([lse] if return_lse else [])
    if need_weights:
        with torch.no_grad():
            result.append(rebuilt_weights(query, key, lse, plan.visit, plan))
    return result[0] if len(result) == 1 else tuple(result)


def check_finite_scores(lse: Tensor, query: Tensor, score_mod) -> None:
    """A ``score_mod`` that gave a score of ``+inf`` or NaN makes its rows' softmax NaN: said,
    naming the function, instead of NaN outputs (one read of the device per call, only with
    a ``score_mod``). A row whose query is itself not finite is NaN by the rules, not here."""
    if values_unknown(lse) or torch._C._functorch.is_functorch_wrapped_tensor(lse):
        return
    bad = torch.isnan(lse) | torch.isposinf(lse)  # (B, H, T): B·H·T bytes, no more
    if bool(bad.any()):  # (rare) then leave out the rows whose query is not finite
        bad &= torch.isfinite(query.detach()).all(dim=-1)
    if bool(bad.any()):
        b, h, t = (int(i) for i in bad.nonzero()[0])
        name = getattr(score_mod, "__name__", type(score_mod).__name__)
        raise AttentionArgumentError(
            f"score_mod {name} gave +inf or NaN scores ({int(bad.sum())} query rows, first "
            f"b={b}, h={h}, q_idx={t}): the softmax of such a row is NaN; use large finite "
            "values to favour a key and -inf to hide one")


class Plan:
    """What every row block needs besides its tensors; ``visit``, the key-block spans each
    query block visits, is worked out on first use."""

    def __init__(self, B, H, T, S, bq, bk, scale, score_mod, block_mask, G):
        self.B, self.H, self.T, self.S = B, H, T, S
        self.bq, self.bk, self.scale, self.G = bq, bk, scale, G
        self.score_mod, self.block_mask = score_mod, block_mask
        self.mask_mod = None if block_mask is None else block_mask.mask_mod

    @classmethod
    def of(cls, query: Tensor, key: Tensor, score_mod, block_mask: BlockMask | None,
           scale: float | None) -> Plan:
        """The plan of a call on ``query (B, H, T, D)`` and ``key (B, Hkv, S, D)``; no block
        mask: every ``DEFAULT_BLOCK`` tile, full; ``scale`` None: ``1/sqrt(D)``."""
        B, H, T, D = query.shape
        bq, bk = (DEFAULT_BLOCK, DEFAULT_BLOCK) if block_mask is None else block_mask.block_size
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        return cls(B, H, T, key.shape[2], bq, bk, scale, score_mod, block_mask,
                   H // key.shape[1])

    @functools.cached_property
    def visit(self) -> list[list[tuple[int, int, int]]]:
        if self.block_mask is None:
            return all_visited(self.T, self.S)
        return visits(self.block_mask)


# Consecutive visited key blocks are attended as one span of at most this many keys: fewer,
# larger matrix products (a span of partial tiles evaluates mask_mod on the span's grid).
SPAN_KEYS = 512


def _spans(cols: list[int], full: list[bool], bk: int) -> list[tuple[int, int, int]]:
    """Group visited key blocks ``cols`` (ascending) into ``(first, last + 1, kind)`` spans."""
    spans: list[tuple[int, int, int]] = []
    limit = max(1, SPAN_KEYS // bk)
    for j, is_full in zip(cols, full, strict=True):
        kind = FULL if is_full else PARTIAL
        if spans and spans[-1][1] == j and spans[-1][1] - spans[-1][0] < limit:
            first, _, k = spans[-1]
            spans[-1] = (first, j + 1, FULL if (k == FULL and kind == FULL) else PARTIAL)
        else:
            spans.append((j, j + 1, kind))
    return spans


# Consecutive query blocks that visit the same spans are computed together, up to this many
# rows (a document mask's query blocks inside one document share their spans).
GROUP_ROWS = 256


def _row_groups(visit, bq: int, T: int) -> list[tuple[int, int, list]]:
    """``(first row, last row + 1, spans)`` for runs of query blocks with equal spans."""
    groups: list[tuple[int, int, list]] = []
    for i, spans in enumerate(visit):
        i0, i1 = i * bq, min(T, (i + 1) * bq)
        if groups and groups[-1][2] == spans and i1 - groups[-1][0] <= GROUP_ROWS:
            groups[-1] = (groups[-1][0], i1, spans)
        else:
            groups.append((i0, i1, spans))
    return groups


def all_visited(T: int, S: int) -> list[list[tuple[int, int, int]]]:
    """:func:`visits` of no block mask: every key block full, for every query block."""
    nk = -(-S // DEFAULT_BLOCK)
    return [_spans(list(range(nk)), [True] * nk, DEFAULT_BLOCK)
            for _ in range(-(-T // DEFAULT_BLOCK))]


def visits(block_mask: BlockMask) -> list[list[tuple[int, int, int]]]:
    """Per query block, the key-block spans to visit and whether they are full for every
    (b, h)."""
    state = block_mask.state
    visited = (state > EMPTY).flatten(0, 1).any(dim=0)  # (nQ, nK)
    full = (state == FULL).flatten(0, 1).all(dim=0)  # (nQ, nK)
    rows = []
    for i in range(state.shape[2]):
        cols = torch.nonzero(visited[i]).flatten().tolist()
        rows.append(_spans(cols, full[i, cols].tolist(), block_mask.block_size[1]))
    return rows


def _tile_scores(qs: Tensor, k: Tensor, i0: int, span, plan: Plan) -> Tensor:
    """Scores of one span ``(B, H, bq, keys)`` after ``score_mod`` and the mask, in float32+."""
    first, last, kind = span
    j0, j1 = first * plan.bk, min(plan.S, last * plan.bk)
    kt = k[:, :, j0:j1]
    if plan.G > 1:
        kt = kt.repeat_interleave(plan.G, dim=1)  # (B, H, keys, D)
    s = qs @ kt.to(qs.dtype).transpose(-2, -1)  # (B, H, bq, keys), scale already in qs
    rows, cols = range(i0, i0 + qs.shape[2]), range(j0, j1)
    if plan.score_mod is not None:
        s = checked_scores(plan.score_mod(s, *index_grid(plan.B, plan.H, rows, cols, s.device)),
                           s, plan.score_mod)
    if kind != FULL and plan.mask_mod is not None:
        keep = tile_keep(plan.mask_mod, plan.B, plan.H, rows, cols, s.device)
        s = s.masked_fill(~keep, float("-inf"))
    return s


def checked_scores(got: object, scores: Tensor, score_mod) -> Tensor:
    """``score_mod``'s result on a tile of ``scores (B, H, bq, keys)``, checked: a float
    tensor of the scores' dtype that broadcasts to their shape (it is broadcast), else an
    error naming the function, what it returned and what was expected."""
    name = getattr(score_mod, "__name__", type(score_mod).__name__)
    want = f"a {scores.dtype} tensor broadcastable to {tuple(scores.shape)}"
    if not isinstance(got, Tensor):
        raise AttentionTypeError(f"score_mod {name} must return {want}, got "
                                 f"{type(got).__name__}")
    if got.dtype != scores.dtype:
        raise AttentionTypeError(
            f"score_mod {name} must return {want}, got dtype {got.dtype} (compute in the "
            "dtype of the score it is given)")
    try:
        return torch.broadcast_to(got, scores.shape)
    except RuntimeError:
        raise AttentionArgumentError(
            f"score_mod {name} must return {want}, got shape {tuple(got.shape)}: write it "
            "with elementwise torch operations of (score, b, h, q_idx, kv_idx)") from None


def _row_block(q: Tensor, k: Tensor, v: Tensor, i0: int, tiles, plan: Plan, inplace=False):
    """``(out (B, H, bq, Dv), lse (B, H, bq))`` of one query block, by the online softmax.

    ``inplace`` (only without autograd) reuses the score and accumulator buffers.
    """
    acc_t = accumulation_dtype(q.dtype)
    qs = q.to(acc_t) * plan.scale  # (B, H, bq, D)
    B, H, bq = q.shape[0], q.shape[1], q.shape[2]
    m = torch.full((B, H, bq, 1), float("-inf"), dtype=acc_t, device=q.device)
    l_sum = torch.zeros((B, H, bq, 1), dtype=acc_t, device=q.device)
    acc = torch.zeros((B, H, bq, v.shape[-1]), dtype=acc_t, device=q.device)
    for span in tiles:
        s = _tile_scores(qs, k, i0, span, plan)
        # The running max only keeps exp() in range; the result does not depend on it.
        m_new = torch.maximum(m, s.detach().amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        # In place only on scores qkv allocated (a score_mod may return a tensor of its own).
        mine = inplace and plan.score_mod is None
        p = s.sub_(m_safe).exp_() if mine else torch.exp(s - m_safe)  # (B, H, bq, bk)
        corr = torch.exp(m - m_safe)
        j0, j1 = span[0] * plan.bk, min(plan.S, span[1] * plan.bk)
        vt = v[:, :, j0:j1]
        if plan.G > 1:
            vt = vt.repeat_interleave(plan.G, dim=1)  # (B, H, bk, Dv)
        if inplace:
            l_sum.mul_(corr).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(corr).add_(p @ vt.to(acc_t))
        else:
            l_sum = l_sum * corr + p.sum(dim=-1, keepdim=True)
            acc = acc * corr + p @ vt.to(acc_t)
        m = m_new
    seen = l_sum > 0
    out = acc / torch.where(seen, l_sum, torch.ones_like(l_sum))  # rows that see nothing: 0
    # A NaN sum (a score_mod gave +inf or NaN) keeps NaN in the lse, where it is looked for.
    dead = torch.where(torch.isnan(l_sum), l_sum, torch.full_like(m, float("-inf")))
    lse = torch.where(seen, m + torch.log(torch.where(seen, l_sum, torch.ones_like(l_sum))),
                      dead)
    return out.to(q.dtype), lse.squeeze(-1)  # (B, H, bq, Dv), (B, H, bq)


def rebuilt_weights(q: Tensor, k: Tensor, lse: Tensor, visit, plan: Plan) -> Tensor:
    """Exact weights ``(B, H, T, S)``: ``exp(s - lse)`` on visited tiles, 0 elsewhere."""
    acc_t = accumulation_dtype(q.dtype)
    w = torch.zeros(plan.B, plan.H, plan.T, plan.S, dtype=q.dtype, device=q.device)
    safe = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    for i0, i1, tiles in _row_groups(visit, plan.bq, plan.T):
        qs = q[:, :, i0:i1].to(acc_t) * plan.scale
        for span in tiles:
            j0, j1 = span[0] * plan.bk, min(plan.S, span[1] * plan.bk)
            s = _tile_scores(qs, k, i0, span, plan)
            w[:, :, i0:i1, j0:j1] = torch.exp(s - safe[:, :, i0:i1, None]).to(q.dtype)
    return w
