"""qkv's own flash backend: blockwise attention with the online softmax (Dao et al., 2022).

Queries are cut into blocks of ``bq`` rows and keys into blocks of ``bk``; for each query
block a running row maximum ``m``, running sum ``l`` and unnormalised output ``acc`` are
updated block by key block, so the ``T×S`` score matrix never exists: peak extra memory is a
few ``(B, H, bq, bk)`` tiles. Blocks wholly above the causal diagonal (or left of a sliding
window) are skipped; every mask part is applied per tile by
:func:`qkv.attention.masks.apply_mask` (the one definition every backend shares). The
backward pass is a custom autograd function that recomputes each tile from the saved
log-sum-exp (``lse = m + log l``), as FlashAttention-2 does, so it stores no ``T×S`` matrix
either. The function is written without in-place writes into shared buffers and with
``generate_vmap_rule``, so ``torch.func.vmap``, ``grad`` and ``jacrev`` work through it.

Grouped-query attention keeps the ``G = H / Hkv`` query heads of a group together: a query
tile is ``(B, Hkv, G·bq, D)`` against a key tile ``(B, Hkv, bk, D)``; K and V are never
repeated. Its scores ``(B, Hkv, G·bq, bk)`` are the ``(B, H, bq, bk)`` tile of head
``h = hkv·G + g``, which is how the masks see them.

Dropout draws torch's own dropout mask: with the same seed it drops exactly the weights
torch's math SDPA (and qkv's math backend) drop. That mask is drawn whole, once per call,
as torch draws it: ``B·H·T·S`` bytes kept for the backward pass (plus a transient
``B·H·T·S`` tensor of the query dtype while drawing), so dropout gives up the O(T) memory of
the rest of the kernel. It only happens when ``dropout_p > 0``, that is in training.

Equivalent to the ``math`` backend (the tests hold it to 1e-10 in float64); rows with no
visible key give zero output, ``lse = -inf`` and zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.call import AttentionCall
from qkv.attention.flash_blocks import DECODE_ROWS, block_sizes, plan_blocks
from qkv.attention.flash_decode import decode_forward
from qkv.attention.masks import (
    accumulation_dtype,
    apply_mask,
    dropout_keep,
    exp_floored_,
    exp_shifted_,
    poison_rows,
    safe_lse,
    safe_row_max,
    safe_total,
)

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
    bq: int
    bk: int
    alibi_offset: int | None = None


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """Output ``(B, H, T, Dv)`` and, when asked, exact weights ``(B, H, T, S)`` from the lse.

    A non-finite query row gives a NaN output row (:func:`~qkv.attention.masks.poison_rows`:
    a row that sees no key, or whose scores are all ``-inf``, would otherwise give zeros).
    """
    if not call.need_weights and call.T <= DECODE_ROWS and call.dropout_p == 0.0 \
            and not _needs_grad(call) and call.query.shape[0] > 0:
        # Inference decoding wants no lse: a few small ops fewer on every token.
        out = _decode_call(call, _spec(call, None, None).bk, lse=False)[0]
        return poison_rows(out, call.query), None
    out, lse = attend(call)
    out = poison_rows(out, call.query)
    weights = None
    if call.need_weights:
        from qkv.attention.weights import rebuild

        weights = rebuild(call, lse)
    return out, weights


def run_lse(call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`run` plus the kernel's own log-sum-exp ``(B, H, T)`` (float32 for half-precision
    inputs, else float64; ``-inf`` on rows with no visible key). It is differentiable: the
    backward pass adds ``dlse · p`` to the score gradients."""
    out, lse = attend(call)
    out = poison_rows(out, call.query)
    weights = None
    if call.need_weights:
        from qkv.attention.weights import rebuild

        weights = rebuild(call, lse)
    return out, weights, lse


def attend(call: AttentionCall, *, block_q: int | None = None, block_k: int | None = None):
    """Run flash attention on ``call``: ``(out (B, H, T, Dv), lse (B, H, T))``.

    ``lse`` is float32 for half-precision inputs, else float64.
    """
    if call.query.shape[0] == 0:
        return empty_result(call)
    keep = dropout_keep(call) if call.dropout_p > 0.0 else None
    spec = _spec(call, block_q, block_k)
    if not _needs_grad(call):
        # Nothing to differentiate: skip the autograd Function's per-call bookkeeping.
        return _forward(call.query, call.key, call.value, call.mask, call.alibi, keep, spec)
    return _FlashFunction.apply(
        call.query, call.key, call.value, call.mask, call.alibi, keep, spec
    )


def empty_result(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """``(out (0, H, T, Dv), lse (0, H, T))`` of an empty batch, as torch's kernels give it;
    still connected to the inputs, so a backward pass gives empty gradients."""
    q, k, v = call.query, call.key, call.value
    B, H, T = q.shape[:3]
    link = (q.sum() + k.sum() + v.sum()).to(q.dtype)  # 0, with a grad_fn when one is needed
    out = q.new_zeros((B, H, T, v.shape[-1])) + link  # (0, H, T, Dv)
    lse = torch.full((B, H, T), float("-inf"), dtype=_lse_dtype(q.dtype), device=q.device)
    return out, lse


def _needs_grad(call: AttentionCall) -> bool:
    """Whether autograd (or a torch.func transform) may ask for this call's gradients."""
    if not torch.is_grad_enabled():
        return False
    tensors = [t for t in (call.query, call.key, call.value, call.mask, call.alibi)
               if t is not None]
    return any(t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t)
               for t in tensors)


def attend_backward(
    call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of a call whose softmax statistics are given.

    ``out (B, H, T, Dv)`` and ``lse (B, H, T)`` may be those of a *longer* key sequence of which
    ``call.key``/``call.value`` are one block (context-parallel attention merges blocks by
    log-sum-exp): the weights of this block are ``exp(s - lse)`` and the returned gradients
    are this block's exact share: ``dq`` summed over blocks and ``dk``/``dv`` per block give the
    gradients of the whole call. No dropout (``call.dropout_p`` must be 0).
    """
    if call.dropout_p > 0.0:
        raise ValueError("attend_backward does not replay dropout; call.dropout_p must be 0")
    if call.query.shape[0] == 0:
        return (torch.zeros_like(call.query), torch.zeros_like(call.key),
                torch.zeros_like(call.value))  # fmt: skip
    spec = _spec(call, None, None)
    return _backward(
        call.query, call.key, call.value, out, lse, dout, None, call.mask, call.alibi, None,
        spec,
    )


def _spec(call: AttentionCall, block_q: int | None, block_k: int | None) -> _Spec:
    bq, bk = block_sizes(call.T, call.S, call.query.shape[-1], call.query.dtype)
    return _Spec(
        scale=call.scale, causal=call.causal, window=call.window, dropout_p=call.dropout_p,
        bq=block_q or bq, bk=block_k or bk, alibi_offset=call.alibi_offset,
    )


class _FlashFunction(torch.autograd.Function):
    # forward has no ctx (setup_context saves), and no op writes a batched tensor into an
    # unbatched one, so torch.func can derive the vmap rule by running forward under vmap.
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, mask, alibi, keep, spec):
        return _forward(q, k, v, mask, alibi, keep, spec)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, alibi, keep, spec = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, mask, alibi, keep)
        ctx.spec = spec
        ctx.set_materialize_grads(False)  # an unused lse needs no zero gradient tensor

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, mask, alibi, keep = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, mask, alibi, keep, ctx.spec)
        return dq, dk, dv, None, None, None, None


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return accumulation_dtype(dtype)


def _tile_call(q, k, v, mask, alibi, spec: _Spec) -> AttentionCall:
    """The call's mask parts again, as the record :func:`apply_mask` reads."""
    return AttentionCall(
        query=q, key=k, value=v, mask=mask, causal=spec.causal, window=spec.window,
        alibi=alibi, scale=spec.scale, dropout_p=spec.dropout_p, need_weights=False,
        batch_shape=(q.shape[0],), alibi_offset=spec.alibi_offset,
    )


def _scores(call: AttentionCall, qs: Tensor, kt: Tensor, plan, H: int) -> Tensor:
    """Masked, scaled scores of one tile ``(B, H, bq, bk)`` in the accumulation dtype.

    ``qs`` is the query tile already multiplied by the scale, ``(B, Hkv, G·bq, D)``.
    """
    B, bq, bk = qs.shape[0], plan.i1 - plan.i0, plan.j1 - plan.j0
    s = (qs @ kt.transpose(-2, -1)).reshape(B, H, bq, bk)  # (B, H, bq, bk), h = hkv·G + g
    rows, cols = slice(plan.i0, plan.i1), slice(plan.j0, plan.j1)
    # Only tiles the causal diagonal or window edge crosses need their structure mask.
    return apply_mask(s, call, rows, cols, structure=plan.partial, inplace=True)


def _prepare(q, k, v, mask, alibi, spec: _Spec):
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    # Half precision is computed in float32: CPUs without bf16 matrix units multiply bf16
    # ~100x slower than float32, and float32 products of bf16 inputs are exact anyway. K and
    # V are converted tile by tile (see _kv), so no float32 copy of the whole cache exists.
    qg = (q.to(acc) * spec.scale).reshape(B, Hkv, G, T, D)  # (B, Hkv, G, T, D), scale folded
    call = _tile_call(q, k, v, mask, alibi, spec)
    plans = plan_blocks(T, S, spec.bq, spec.bk, spec.causal, spec.window)
    return B, H, T, D, Hkv, S, G, acc, qg, call, plans


def _kv(k: Tensor, v: Tensor, j0: int, j1: int, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """Key and value tiles ``(B, Hkv, bk, D|Dv)`` in the accumulation dtype."""
    return k[:, :, j0:j1].to(acc), v[:, :, j0:j1].to(acc)


def _keep_tile(keep: Tensor, plan, p: float, dtype: torch.dtype) -> Tensor:
    """Inverted-dropout factors of one tile ``(B, H, bq, bk)``: 0 or ``1 / (1 - p)``."""
    return keep[:, :, plan.i0:plan.i1, plan.j0:plan.j1].to(dtype) / (1.0 - p)


def _row_max(s: Tensor) -> Tensor:
    """Max over the last dimension, keepdim; a 2-D view takes torch's fast reduction path."""
    return s.reshape(-1, s.shape[-1]).amax(dim=-1).reshape(*s.shape[:-1], 1)


def _row_sum(s: Tensor) -> Tensor:
    return s.reshape(-1, s.shape[-1]).sum(dim=-1).reshape(*s.shape[:-1], 1)


@torch.no_grad()
def _forward(q, k, v, mask, alibi, keep, spec: _Spec):
    dtype = q.dtype
    if q.shape[2] <= DECODE_ROWS and keep is None:
        return _decode(q, k, v, mask, alibi, spec)
    B, H, T, D, Hkv, _, G, acc, qg, call, plans = _prepare(q, k, v, mask, alibi, spec)
    Dv = v.shape[-1]
    outs, lses = [], []
    for row in plans:
        i0, i1 = row.i0, row.i1
        bq = i1 - i0
        qs = qg[:, :, :, i0:i1].reshape(B, Hkv, G * bq, D)  # (B, Hkv, G·bq, D)
        # Rows of a query block that no tile reaches (all keys hidden) keep these values.
        m = torch.full((B, H, bq, 1), float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros(B, H, bq, 1, dtype=acc, device=q.device)
        o = torch.zeros(B, H, bq, Dv, dtype=acc, device=q.device)
        for t, plan in enumerate(row.tiles):
            kt, vt = _kv(k, v, plan.j0, plan.j1, acc)
            s = _scores(call, qs, kt, plan, H)  # (B, H, bq, bk)
            # 1) New running maximum; rows still all -inf use 0 so exp gives exact zeros.
            m_new = _row_max(s) if t == 0 else torch.maximum(m, _row_max(s))
            m_safe = safe_row_max(m_new)
            # 2) Unnormalised probabilities of this tile, in place over the scores.
            p = exp_shifted_(s, m_new)  # (B, H, bq, bk)
            l_tile = _row_sum(p)  # (B, H, bq, 1): the softmax sums before dropout
            if keep is not None:
                p = p * _keep_tile(keep, plan, spec.dropout_p, acc)
            pv = (p.reshape(B, Hkv, G * bq, -1) @ vt).reshape(B, H, bq, Dv)  # (B, H, bq, Dv)
            # 3) Rescale what was accumulated under the old maximum, then add this tile.
            if t == 0:
                l, o = l_tile, pv
            else:
                alpha = torch.exp(m - m_safe)  # (B, H, bq, 1)
                l = torch.addcmul(l_tile, l, alpha)
                o = torch.addcmul(pv, o, alpha)
            m = m_new
            del s, p  # this tile's scores go before the next tile's are made
        # 4) Normalise; rows that saw no key have l = 0 and stay zero.
        outs.append((o / safe_total(l)).to(dtype))  # (B, H, bq, Dv)
        # In float64 for float32 inputs: lse ~ the largest score, and its float32 rounding
        # alone would put weights rebuilt from it ~1e-5 off (a weight of 1.00002).
        lse_dtype = _lse_dtype(dtype)
        lses.append(m.to(lse_dtype) + torch.log(l.to(lse_dtype)))  # -inf where l = 0
    out = torch.cat(outs, dim=2)  # (B, H, T, Dv)
    lse = torch.cat(lses, dim=2).reshape(B, H, T)  # (B, H, T)
    return out, lse


def _decode(q, k, v, mask, alibi, spec: _Spec):
    """Few queries (:mod:`qkv.attention.flash_decode`): key blocks merged by log-sum-exp."""
    return _decode_call(_tile_call(q, k, v, mask, alibi, spec), spec.bk, lse=True)


def _decode_call(call: AttentionCall, bk: int, *, lse: bool):
    """:func:`_decode` on a call record; ``lse=False`` returns ``None`` for the lse."""
    q, k, v = call.query, call.key, call.value
    B, H, T, D = q.shape
    Hkv, acc = k.shape[1], _acc_dtype(q.dtype)
    qs = (q.to(acc) * call.scale).reshape(B, Hkv, H // Hkv * T, D)  # (B, Hkv, G·T, D)
    lse_dtype = _lse_dtype(q.dtype) if lse else None
    out, lse_ = decode_forward(call, qs, k, v, bk, acc, lse_dtype)
    return out.to(q.dtype), lse_


@torch.no_grad()
def _backward(q, k, v, out, lse, dout, dlse, mask, alibi, keep, spec: _Spec):
    dtypes = (q.dtype, k.dtype, v.dtype)
    B, H, T, D, Hkv, S, G, acc, qg, call, plans = _prepare(q, k, v, mask, alibi, spec)
    Dv = v.shape[-1]
    dog = dout.to(acc).reshape(B, Hkv, G, T, Dv)  # (B, Hkv, G, T, Dv)
    # D_i = rowsum(dO ∘ O): the softmax Jacobian's correction term, once per query row.
    delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # (B, H, T, 1)
    if dlse is not None:
        delta = delta - dlse.to(acc).reshape(B, H, T, 1)  # d lse / d s = p
    lse_b = safe_lse(lse.reshape(B, H, T, 1)).to(acc)  # dead rows: +inf makes p exactly 0
    n_key_blocks = -(-S // spec.bk)
    dks: list[Tensor | None] = [None] * n_key_blocks
    dvs: list[Tensor | None] = [None] * n_key_blocks
    dqs = []
    for row in plans:
        i0, i1 = row.i0, row.i1
        bq = i1 - i0
        qs = qg[:, :, :, i0:i1].reshape(B, Hkv, G * bq, D)  # (B, Hkv, G·bq, D), scaled
        do = dog[:, :, :, i0:i1].reshape(B, Hkv, G * bq, Dv)  # (B, Hkv, G·bq, Dv)
        dq_blk = torch.zeros(B, Hkv, G * bq, D, dtype=acc, device=q.device)
        for plan in row.tiles:
            bk = plan.j1 - plan.j0
            kt, vt = _kv(k, v, plan.j0, plan.j1, acc)
            s = _scores(call, qs, kt, plan, H)  # (B, H, bq, bk)
            p = exp_floored_(s.sub_(lse_b[:, :, i0:i1]))  # (B, H, bq, bk): the weights
            dp = (do @ vt.transpose(-2, -1)).reshape(B, H, bq, bk)  # dL/d(applied p)
            p_applied = p
            if keep is not None:
                factor = _keep_tile(keep, plan, spec.dropout_p, acc)  # (B, H, bq, bk)
                p_applied = p * factor
                dp = dp * factor
            p2 = p_applied.reshape(B, Hkv, G * bq, bk)
            dv_t = p2.transpose(-2, -1) @ do  # (B, Hkv, bk, Dv), before p is overwritten
            # Out of place: under jacrev the incoming gradient is batched and p is not.
            ds = p * (dp - delta[:, :, i0:i1])  # (B, H, bq, bk)
            ds2 = ds.reshape(B, Hkv, G * bq, bk)
            dq_blk = dq_blk + ds2 @ kt  # (B, Hkv, G·bq, D)
            dk_t = ds2.transpose(-2, -1) @ qs  # (B, Hkv, bk, D)
            j = plan.index
            dvs[j] = dv_t if dvs[j] is None else dvs[j] + dv_t
            dks[j] = dk_t if dks[j] is None else dks[j] + dk_t
        dqs.append(dq_blk.reshape(B, Hkv, G, bq, D))
    dq = torch.cat(dqs, dim=3)  # (B, Hkv, G, T, D)
    # Key blocks no query reaches get zero gradients.
    for j in range(n_key_blocks):
        j0, j1 = j * spec.bk, min(S, (j + 1) * spec.bk)
        if dks[j] is None:
            dks[j] = torch.zeros_like(k[:, :, j0:j1], dtype=acc)  # (B, Hkv, bk, D)
            dvs[j] = torch.zeros_like(v[:, :, j0:j1], dtype=acc)  # (B, Hkv, bk, Dv)
    dk = torch.cat(dks, dim=2)  # (B, Hkv, S, D)
    dv = torch.cat(dvs, dim=2)  # (B, Hkv, S, Dv)
    # qs carried the scale, so dK already has it; dQ = scale · dS K.
    dq = (dq * spec.scale).reshape(B, H, T, D)  # (B, H, T, D)
    return dq.to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])
