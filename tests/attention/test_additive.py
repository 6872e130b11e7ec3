"""Bahdanau (additive) and Luong attention: functions, NumPy reference and modules.

The torch functions are compared with ``qkv.reference`` (which scores the paper's
concatenation ``[q ; k]`` instead of projecting each side) in float64 and float32, over odd
sizes (T=7, S=13, A=59), broadcast batches and every kind of mask; gradients are checked with
``torch.autograd.gradcheck``. Rows with no visible key must give zeros, never NaN, in outputs
and gradients. The modules must equal the functions with their parameters, and drive a tiny
GRU encoder-decoder.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from helpers import TOL, assert_close, to_numpy
from qkv import reference
from qkv.attention.additive import (
    additive_attention,
    attend,
    bahdanau_scores,
    luong_attention,
    luong_scores,
)
from qkv.nn import BahdanauAttention, LuongAttention
from qkv.reference import additive as ref

F64, F32 = torch.float64, torch.float32

# (batch of query, batch of keys/values, T, S, Dq, Dk, Dv, A)
SHAPES = [
    pytest.param((2,), (2,), 7, 13, 5, 6, 4, 59, id="odd-T7-S13-A59"),
    pytest.param((), (), 1, 1, 1, 1, 1, 1, id="1x1"),
    pytest.param((2, 3), (2, 3), 4, 9, 8, 3, 5, 16, id="lead2x3"),
    pytest.param((2, 1), (1, 3), 3, 5, 4, 4, 2, 7, id="broadcast-batch"),
]
MASKS = ["none", "bool", "float", "key-padding", "dead-bool", "dead-float"]


def make(qb, kb, T, S, Dq, Dk, Dv, A, dtype, seed=0):
    """Inputs of a realistic scale (weights ~ 1/sqrt(fan-in)) so float32 keeps 1e-5."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)

    return dict(
        query=r(*qb, T, Dq),
        keys=r(*kb, S, Dk),
        values=r(*kb, S, Dv),
        w_query=r(Dq, A, scale=Dq**-0.5),
        w_key=r(Dk, A, scale=Dk**-0.5),
        v=r(A, scale=A**-0.5),
        b=r(A, scale=0.5),
    )


def make_mask(kind, lead, T, S, dtype, seed=1):
    """A mask for scores ``(*lead, T, S)``; ``dead-*`` hide every key from query row 0."""
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(*lead, T, S, generator=g) < 0.6
    keep[..., 0] = True  # every row sees a key ...
    if kind == "key-padding":  # (..., 1, S): the last key of every sequence is padding
        keep = torch.ones(*lead, 1, S, dtype=torch.bool)
        keep[..., S - 1] = S == 1
        return keep
    if kind.startswith("dead"):
        keep[..., 0, :] = False  # ... except query row 0
    if kind.endswith("bool"):
        return keep
    return qkv.masks.to_additive(keep, dtype) + torch.rand(keep.shape, generator=g).to(dtype)


def np_args(d):
    return {k: to_numpy(t) for k, t in d.items()}


def np_mask(m):
    return None if m is None else (m.numpy() if m.dtype == torch.bool else to_numpy(m))


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize(("qb", "kb", "T", "S", "Dq", "Dk", "Dv", "A"), SHAPES)
def test_additive_matches_reference(qb, kb, T, S, Dq, Dk, Dv, A, mask_kind, bias, dtype):
    x = make(qb, kb, T, S, Dq, Dk, Dv, A, dtype)
    if not bias:
        x["b"] = None
    lead = torch.broadcast_shapes(qb, kb)
    mask = make_mask(mask_kind, lead, T, S, dtype)
    ctx, w = additive_attention(**x, mask=mask)
    n = {k: (None if t is None else to_numpy(t)) for k, t in x.items()}
    rctx, rw = reference.additive_attention(**n, mask=np_mask(mask))
    assert_close(w, rw, **TOL[dtype], name="weights")
    assert_close(ctx, rctx, **TOL[dtype], name="context")
    scores = bahdanau_scores(x["query"], x["keys"], x["w_query"], x["w_key"], x["v"], x["b"])
    rscores = ref.bahdanau_scores(n["query"], n["keys"], n["w_query"], n["w_key"], n["v"], n["b"])
    assert_close(scores, rscores, **TOL[dtype], name="scores")


def test_bahdanau_scores_by_definition():
    """Pair by pair, straight from e[t, s] = vᵀ tanh(q_t W_q + k_s W_k + b)."""
    x = make((2,), (2,), 3, 4, 5, 6, 2, 7, F64)
    scores = bahdanau_scores(x["query"], x["keys"], x["w_query"], x["w_key"], x["v"], x["b"])
    expected = torch.empty(2, 3, 4, dtype=F64)
    for i in range(2):
        for t in range(3):
            for s in range(4):
                h = x["query"][i, t] @ x["w_query"] + x["keys"][i, s] @ x["w_key"] + x["b"]
                expected[i, t, s] = x["v"] @ torch.tanh(h)
    assert_close(scores, expected, atol=1e-12, name="scores")


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", ["dot", "general"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize(("qb", "kb", "T", "S", "Dq", "Dk", "Dv", "A"), SHAPES)
def test_luong_matches_reference(qb, kb, T, S, Dq, Dk, Dv, A, mask_kind, kind, dtype):
    if kind == "dot":
        Dk = Dq
    x = make(qb, kb, T, S, Dq, Dk, Dv, A, dtype)
    weight = None if kind == "dot" else (torch.randn(Dq, Dk, dtype=F64) * Dq**-0.5).to(dtype)
    lead = torch.broadcast_shapes(qb, kb)
    mask = make_mask(mask_kind, lead, T, S, dtype)
    q, k, vals = x["query"], x["keys"], x["values"]
    ctx, w = luong_attention(q, k, vals, kind=kind, weight=weight, mask=mask)
    nw = None if weight is None else to_numpy(weight)
    rctx, rw = reference.luong_attention(
        to_numpy(q), to_numpy(k), to_numpy(vals), kind=kind, weight=nw, mask=np_mask(mask)
    )
    assert_close(w, rw, **TOL[dtype], name="weights")
    assert_close(ctx, rctx, **TOL[dtype], name="context")
    rscores = ref.luong_scores(to_numpy(q), to_numpy(k), kind=kind, weight=nw)
    assert_close(luong_scores(q, k, kind=kind, weight=weight), rscores, **TOL[dtype], name="s")


@pytest.mark.parametrize("mask_kind", MASKS)
def test_luong_dot_is_sdpa_with_scale_one(mask_kind):
    """Same mask conventions as qkv.scaled_dot_product_attention, dead rows included."""
    x = make((2, 3), (2, 3), 7, 13, 8, 8, 5, 1, F64)
    mask = make_mask(mask_kind, (2, 3), 7, 13, F64)
    q, k, vals = x["query"], x["keys"], x["values"]
    ctx, w = luong_attention(q, k, vals, kind="dot", mask=mask)
    out, sw = qkv.scaled_dot_product_attention(
        q, k, vals, attn_mask=mask, scale=1.0, need_weights=True, backend="math"
    )
    assert_close(w, sw, **TOL[F64], name="weights")
    assert_close(ctx, out, **TOL[F64], name="context")


def test_general_with_identity_weight_is_dot():
    x = make((2,), (2,), 7, 13, 6, 6, 3, 1, F64)
    eye = torch.eye(6, dtype=F64)
    g = luong_scores(x["query"], x["keys"], kind="general", weight=eye)
    assert_close(g, luong_scores(x["query"], x["keys"]), **TOL[F64], name="scores")


@pytest.mark.parametrize("shape", [(13,), (7, 1), (2, 1, 13), (2, 7, 13)], ids=str)
def test_mask_broadcasting_and_polarity(shape):
    """A broadcast mask equals its expansion, and a bool mask equals its 0/-inf float form."""
    x = make((2,), (2,), 7, 13, 5, 6, 4, 9, F64)
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(5)) < 0.7
    scores = bahdanau_scores(x["query"], x["keys"], x["w_query"], x["w_key"], x["v"], x["b"])
    ctx, w = attend(scores, x["values"], keep)
    ctx_full, w_full = attend(scores, x["values"], keep.expand(2, 7, 13))
    ctx_float, w_float = attend(scores, x["values"], qkv.masks.to_additive(keep, F64))
    for a, b_, name in [(w, w_full, "w"), (ctx, ctx_full, "ctx"), (w, w_float, "w-float")]:
        assert_close(a, b_, **TOL[F64], name=name)
    assert_close(ctx_float, ctx, **TOL[F64], name="ctx-float")
    assert bool((w[~keep.expand(2, 7, 13)] == 0).all()), "a hidden key got weight"


def test_permuting_keys_and_values_together_permutes_weights():
    x = make((2,), (2,), 7, 13, 5, 6, 4, 59, F64)
    perm = torch.randperm(13, generator=torch.Generator().manual_seed(2))
    mask = make_mask("bool", (2,), 7, 13, F64)
    ctx, w = additive_attention(**x, mask=mask)
    y = dict(x, keys=x["keys"][:, perm], values=x["values"][:, perm])
    ctx_p, w_p = additive_attention(**y, mask=mask[..., perm])
    assert_close(ctx_p, ctx, **TOL[F64], name="context")
    assert_close(w_p, w[..., perm], **TOL[F64], name="weights")


SMALL, ODD = (3, 4, 2, 3, 2, 5), (7, 13, 3, 4, 2, 59)  # T, S, Dq, Dk, Dv, A
GRADCHECK_CASES = [
    pytest.param(SMALL, bias, mask, id=f"small-{'bias' if bias else 'nobias'}-{mask}")
    for bias in (True, False)
    for mask in ("none", "bool", "dead-bool", "dead-float", "key-padding")
] + [  # the odd sizes cost ~1.5 s each: a few representative cases
    pytest.param(ODD, True, "dead-bool", id="T7-S13-A59-bias-dead-bool"),
    pytest.param(ODD, False, "dead-float", id="T7-S13-A59-nobias-dead-float"),
    pytest.param(ODD, True, "none", id="T7-S13-A59-bias-none"),
]


@pytest.mark.parametrize(("sizes", "bias", "mask_kind"), GRADCHECK_CASES)
def test_gradcheck_additive(sizes, bias, mask_kind):
    T, S, Dq, Dk, Dv, A = sizes
    x = make((2,), (2,), T, S, Dq, Dk, Dv, A, F64)
    if not bias:
        x["b"] = None
    mask = make_mask(mask_kind, (2,), T, S, F64)
    names = [k for k, t in x.items() if t is not None]
    inputs = tuple(x[k].requires_grad_() for k in names)

    def fn(*ts):
        return additive_attention(**dict(zip(names, ts, strict=True)), mask=mask)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("mask_kind", ["none", "float", "dead-bool", "dead-float"])
@pytest.mark.parametrize("kind", ["dot", "general"])
def test_gradcheck_luong(kind, mask_kind):
    x = make((2,), (2,), 7, 13, 5, 5 if kind == "dot" else 4, 3, 1, F64)
    mask = make_mask(mask_kind, (2,), 7, 13, F64)
    inputs = [x["query"], x["keys"], x["values"]]
    if kind == "general":
        inputs.append(torch.randn(5, 4, dtype=F64))
    inputs = tuple(t.requires_grad_() for t in inputs)

    def fn(q, k, vals, weight=None):
        return luong_attention(q, k, vals, kind=kind, weight=weight, mask=mask)

    assert torch.autograd.gradcheck(fn, inputs)


def test_float32_gradients_match_float64():
    x64 = make((2,), (2,), 7, 13, 5, 6, 4, 59, F64)
    mask = make_mask("dead-float", (2,), 7, 13, F64)
    grads = {}
    for dtype in (F64, F32):
        x = {k: t.detach().to(dtype).requires_grad_() for k, t in x64.items()}
        ctx, w = additive_attention(**x, mask=mask.to(dtype))
        g = torch.Generator().manual_seed(9)
        loss = (ctx * torch.randn(ctx.shape, generator=g, dtype=F64).to(dtype)).sum()
        loss = loss + (w * torch.randn(w.shape, generator=g, dtype=F64).to(dtype)).sum()
        loss.backward()
        grads[dtype] = {k: t.grad for k, t in x.items()}
    for k in x64:
        assert_close(grads[F32][k], grads[F64][k], **TOL[F32], name=f"grad {k}")


@pytest.mark.parametrize("dtype", [F64, F32, torch.bfloat16], ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("fn", ["additive", "dot", "general"])
@pytest.mark.parametrize("mask_kind", ["dead-bool", "dead-float"])
def test_fully_masked_rows_are_zero_with_zero_gradient(mask_kind, fn, dtype):
    x = make((2,), (2,), 7, 13, 5, 5, 4, 59, dtype)
    x = {k: t.requires_grad_() for k, t in x.items()}
    mask = make_mask(mask_kind, (2,), 7, 13, dtype)
    mask[1] = False if mask.dtype == torch.bool else float("-inf")  # batch 1: every row dead
    if fn == "additive":
        ctx, w = additive_attention(**x, mask=mask)
    else:
        weight = x["w_query"][:, :5] if fn == "general" else None
        ctx, w = luong_attention(x["query"], x["keys"], x["values"], kind=fn, weight=weight,
                                 mask=mask)
    (ctx.sum() + (w * torch.arange(13, dtype=dtype)).sum()).backward()
    assert bool((ctx[0, 0] == 0).all() & (w[0, 0] == 0).all()), "dead row 0 is not zero"
    assert bool((ctx[1] == 0).all() & (w[1] == 0).all()), "fully masked batch is not zero"
    assert_close(w[0, 1:].double().sum(-1), torch.ones(6), atol=1e-2, name="live rows sum")
    used = list(x) if fn == "additive" else ["query", "keys", "values"]
    used += ["w_query"] if fn == "general" else []
    for k in used:
        g = x[k].grad
        assert g is not None and bool(torch.isfinite(g).all()), f"grad {k} missing or not finite"
    assert bool((x["query"].grad[0, 0] == 0).all()), "dead query row has a gradient"
    assert bool((x["query"].grad[1] == 0).all() & (x["values"].grad[1] == 0).all())


@pytest.mark.parametrize(("T", "S"), [(0, 5), (3, 0)])
def test_empty_lengths(T, S):
    x = make((2,), (2,), T, S, 3, 4, 2, 5, F64)
    ctx, w = additive_attention(**x)
    assert ctx.shape == (2, T, 2) and w.shape == (2, T, S)
    assert bool((ctx == 0).all())


# ----------------------------------------------------------------------------- modules


@pytest.mark.parametrize("single_step", [True, False], ids=["step", "sequence"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_bahdanau_module_equals_function(bias, single_step):
    torch.manual_seed(0)
    mod = BahdanauAttention(5, 6, 59, bias=bias, dtype=F64)
    x = make((3,), (3,), 7, 13, 5, 6, 6, 59, F64)
    q = x["query"][:, 0] if single_step else x["query"]
    keep = torch.rand(3, 13) < 0.7
    keep[2] = False
    mask = keep if single_step else keep[:, None, :]
    ctx, w = mod(q, x["keys"], mask=mask)  # values default to keys
    b = mod.w_query.bias
    f_ctx, f_w = additive_attention(
        x["query"] if not single_step else x["query"][:, :1], x["keys"], x["keys"],
        mod.w_query.weight.T, mod.w_key.weight.T, mod.v, b, keep[:, None, :],
    )
    if single_step:
        f_ctx, f_w = f_ctx[:, 0], f_w[:, 0]
        assert ctx.shape == (3, 6) and w.shape == (3, 13)
    assert_close(ctx, f_ctx, **TOL[F64], name="context")
    assert_close(w, f_w, **TOL[F64], name="weights")
    assert (b is None) != bias
    expected = {"w_query.weight", "w_key.weight", "v"} | ({"w_query.bias"} if bias else set())
    assert set(mod.state_dict()) == expected


@pytest.mark.parametrize("kind", ["dot", "general"])
def test_luong_module_equals_function(kind):
    torch.manual_seed(0)
    Dk = 5 if kind == "dot" else 6
    mod = LuongAttention(5, Dk, kind=kind, dtype=F64)
    x = make((3,), (3,), 7, 13, 5, Dk, 4, 1, F64)
    ctx, w = mod(x["query"], x["keys"], x["values"])
    f_ctx, f_w = luong_attention(x["query"], x["keys"], x["values"], kind=kind, weight=mod.weight)
    assert_close(ctx, f_ctx, **TOL[F64], name="context")
    assert_close(w, f_w, **TOL[F64], name="weights")
    step_ctx, step_w = mod(x["query"][:, 3], x["keys"], x["values"])
    assert_close(step_ctx, ctx[:, 3], **TOL[F64], name="step context")
    assert_close(step_w, w[:, 3], **TOL[F64], name="step weights")
    assert (mod.weight is None) == (kind == "dot")
    assert LuongAttention(4).key_dim == 4 and LuongAttention(4).weight.shape == (4, 4)


def test_rnn_decoder_loop():
    """A tiny GRU encoder and a Bahdanau decoder run step by step, as in the 2014 paper."""
    torch.manual_seed(0)
    B, S, E, Hd, V, steps = 3, 9, 8, 16, 11, 6
    lengths = torch.tensor([9, 5, 1])
    embed = torch.nn.Embedding(V, E)
    encoder = torch.nn.GRU(E, Hd, batch_first=True, bidirectional=True)
    attention = BahdanauAttention(Hd, 2 * Hd, 10)
    cell = torch.nn.GRUCell(E + 2 * Hd, Hd)
    readout = torch.nn.Linear(Hd + 2 * Hd, V)
    src = torch.randint(V, (B, S))
    tgt = torch.randint(V, (B, steps))
    annotations, _ = encoder(embed(src))  # (B, S, 2·Hd): the paper's h_i
    keep = qkv.masks.padding(lengths, S)[:, 0, 0]  # (B, S)
    state = torch.zeros(B, Hd)  # s_0
    states, contexts, all_weights, logits = [], [], [], []
    for t in range(steps):
        context, weights = attention(state, annotations, mask=keep)  # (B, 2·Hd), (B, S)
        states.append(state)
        contexts.append(context)
        all_weights.append(weights)
        logits.append(readout(torch.cat([state, context], -1)))
        state = cell(torch.cat([embed(tgt[:, t]), context], -1), state)
    weights = torch.stack(all_weights, 1)  # (B, steps, S)
    assert weights.shape == (B, steps, S)
    assert_close(weights.sum(-1), torch.ones(B, steps), atol=1e-6, name="row sums")
    assert bool((weights[~keep[:, None, :].expand_as(weights)] == 0).all()), "padding attended"
    assert bool((weights[2, :, 0] == 1).all()), "a 1-token source must get all the weight"
    # Teacher forcing: all decoder states at once give the same contexts as the loop.
    ctx_all, w_all = attention(torch.stack(states, 1), annotations, mask=keep[:, None, :])
    assert_close(ctx_all, torch.stack(contexts, 1), atol=1e-6, name="batched contexts")
    assert_close(w_all, weights, atol=1e-6, name="batched weights")
    loss = torch.nn.functional.cross_entropy(torch.stack(logits, 1).reshape(-1, V),
                                             tgt.reshape(-1))
    loss.backward()
    for name, p in attention.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
        assert float(p.grad.abs().sum()) > 0, f"{name} gets no gradient"


# ----------------------------------------------------------------------------- errors

_X = make((2,), (2,), 3, 4, 5, 6, 2, 7, F64)
_q, _k, _vals = _X["query"], _X["keys"], _X["values"]
_wq, _wk, _v, _b = _X["w_query"], _X["w_key"], _X["v"], _X["b"]
_s = torch.zeros(2, 3, 4, dtype=F64)
_meta = torch.zeros(2, 4, 6, dtype=F64, device="meta")
_n = {k: to_numpy(t) for k, t in _X.items()}


def _bd(**kw):
    args = dict(query=_q, keys=_k, w_query=_wq, w_key=_wk, v=_v, b=_b)
    return lambda: bahdanau_scores(**{**args, **kw})


def _attend(mask=None, values=_vals):
    return lambda: attend(_s, values, mask)


ERRORS = [
    (_bd(query=_q.numpy()), TypeError, r"query must be a torch.Tensor, got ndarray"),
    (_bd(keys=_k.long()), TypeError,
     r"keys must be a floating-point tensor, got dtype torch.int64"),
    (_bd(query=_q[0, 0]), ValueError, r"query must have at least 2 dimensions \(\.\.\., T, Dq\)"),
    (_bd(w_query=_wq[0]), ValueError, r"w_query must have 2 dimension\(s\), got shape \(7\)"),
    (_bd(v=_v.float()), TypeError, r"v has dtype torch.float32 but query has torch.float64"),
    (_bd(keys=_meta), ValueError, r"keys is on meta but query is on cpu"),
    (_bd(w_query=_wk), ValueError, r"w_query must have shape \(Dq, A\) with Dq=5 .* got \(6, 7\)"),
    (_bd(w_key=_wq), ValueError, r"w_key must have shape \(Dk, A\) = \(6, 7\) .* got \(5, 7\)"),
    (_bd(v=_v[:3]), ValueError, r"v must have shape \(A,\) = \(7,\) .* got \(3\)"),
    (_bd(b=_v[:3]), ValueError, r"b must have shape \(A,\) = \(7,\) .* got \(3\)"),
    (_bd(keys=torch.zeros(3, 3, 4, 6, dtype=F64)), ValueError,
     r"batch dimensions of query \(2, 3, 5\) and keys \(3, 3, 4, 6\) .* do not broadcast"),
    (lambda: luong_scores(_q, _k, kind="concat"), ValueError,
     r"kind must be one of \('dot', 'general'\), got 'concat' .*use bahdanau_scores"),
    (lambda: luong_scores(_q, _k, kind="dot", weight=_wq), ValueError,
     r"weight is only used by kind='general'"),
    (lambda: luong_scores(_q, _k), ValueError,
     r"kind='dot' needs query and keys of equal width, got query \(2, 3, 5\) \(Dq=5\) and "
     r"keys \(2, 4, 6\) \(Dk=6\)"),
    (lambda: luong_scores(_q, _k, kind="general"), ValueError,
     r"kind='general' needs weight of shape \(Dq, Dk\) = \(5, 6\)"),
    (lambda: luong_scores(_q, _k, kind="general", weight=_wq), ValueError,
     r"weight must have shape \(Dq, Dk\) = \(5, 6\) .* got \(5, 7\)"),
    (lambda: luong_scores(_q, torch.zeros(3, 3, 4, 6, dtype=F64), kind="general",
                          weight=_wq[:, :6]), ValueError,
     r"batch dimensions of query \(2, 3, 5\) and keys \(3, 3, 4, 6\)"),
    (_attend(values=_vals[:, :3]), ValueError,
     r"values must have S=4 rows \(dimension -2\) like the scores \(2, 3, 4\), got values "
     r"\(2, 3, 2\)"),
    (_attend(values=torch.zeros(3, 3, 4, 2, dtype=F64)), ValueError,
     r"batch dimensions of scores \(2, 3, 4\) and values \(3, 3, 4, 2\) do not broadcast"),
    (_attend(values=_vals.float()), TypeError, r"values has dtype torch.float32 but scores"),
    (_attend(mask=[[True]]), TypeError, r"mask must be a torch.Tensor or None, got list"),
    (_attend(mask=torch.ones(3, 4, dtype=torch.int64)), TypeError,
     r"mask must be boolean \(True = may attend\) or floating point .* got dtype torch.int64"),
    (_attend(mask=torch.ones(3, 4, dtype=torch.bool, device="meta")), ValueError,
     r"mask is on meta but scores are on cpu"),
    (_attend(mask=torch.ones(3, 5, dtype=torch.bool)), ValueError,
     r"mask of shape \(3, 5\) does not broadcast to the scores \(\.\.\., T, S\) = \(2, 3, 4\)"),
    (_attend(mask=torch.ones(5, 2, 3, 4, dtype=torch.bool)), ValueError,
     r"mask of shape \(5, 2, 3, 4\) does not broadcast .* \(without enlarging them\)"),
    (_attend(mask=torch.tensor([0.0, float("nan"), 0.0, 0.0], dtype=F64)), ValueError,
     r"mask contains NaN or \+inf; use -inf to hide a key"),
    (_attend(mask=torch.tensor([0.0, float("inf"), 0.0, 0.0], dtype=F64)), ValueError,
     r"mask contains NaN or \+inf"),
    # modules
    (lambda: BahdanauAttention(0, 4, 4), ValueError, r"query_dim must be a positive int, got 0"),
    (lambda: BahdanauAttention(4, 2.5, 4), ValueError, r"key_dim must be a positive int, got 2.5"),
    (lambda: BahdanauAttention(4, 4, True), ValueError, r"hidden_dim must be a positive int"),
    (lambda: LuongAttention(4, kind="concat"), ValueError,
     r"kind must be one of \('dot', 'general'\), got 'concat' \(Luong's 'concat' is "
     r"BahdanauAttention\)"),
    (lambda: LuongAttention(4, 6, kind="dot"), ValueError,
     r"kind='dot' needs key_dim == query_dim, got query_dim=4 and key_dim=6"),
    (lambda: LuongAttention(5, 6)(_q.numpy(), _k), TypeError, r"query must be a torch.Tensor"),
    (lambda: LuongAttention(5, 6)(_q[None], _k), ValueError,
     r"query must be \(B, Dq\) for one decoder step or \(B, T, Dq\), got \(1, 2, 3, 5\)"),
    (lambda: LuongAttention(5, 6)(_q, _k[0]), ValueError,
     r"keys must be \(B, S, Dk\), got \(4, 6\)"),
    (lambda: LuongAttention(5, 6)(_q[:, 0], _k, mask=torch.ones(2, 1, 4, dtype=torch.bool)),
     ValueError, r"for a single decoder step \(query \(2, 5\)\) mask must broadcast to \(B, S\) = "
     r"\(2, 4\), got \(2, 1, 4\)"),
    # NumPy reference
    (lambda: ref.bahdanau_scores(np.array([["a"]]), _n["keys"], _n["w_query"], _n["w_key"],
                                 _n["v"]), TypeError, r"query must hold real numbers, got dtype"),
    (lambda: ref.bahdanau_scores(_n["query"][0, 0], _n["keys"], _n["w_query"], _n["w_key"],
                                 _n["v"]), ValueError,
     r"query must have at least 2 dimension\(s\), got shape \(5,\)"),
    (lambda: ref.bahdanau_scores(_n["query"], _n["keys"], _n["w_key"], _n["w_key"], _n["v"]),
     ValueError, r"w_query must have shape \(Dq, A\) = \(5, 7\), got \(6, 7\)"),
    (lambda: ref.bahdanau_scores(_n["query"], _n["keys"], _n["w_query"], _n["w_query"], _n["v"]),
     ValueError, r"w_key must have shape \(Dk, A\) = \(6, 7\), got \(5, 7\)"),
    (lambda: ref.bahdanau_scores(_n["query"], _n["keys"], _n["w_query"], _n["w_key"], _n["v"][:2]),
     ValueError, r"v must have shape \(A,\) = \(7,\), got \(2,\)"),
    (lambda: ref.bahdanau_scores(_n["query"], _n["keys"], _n["w_query"], _n["w_key"], _n["v"],
                                 _n["v"][:2]), ValueError, r"b must have shape \(A,\) = \(7,\)"),
    (lambda: ref.luong_scores(_n["query"], _n["keys"], kind="concat"), ValueError,
     r"kind must be one of \('dot', 'general'\), got 'concat'"),
    (lambda: ref.luong_scores(_n["query"], _n["keys"], weight=_n["w_query"]), ValueError,
     r"weight is only used by kind='general'"),
    (lambda: ref.luong_scores(_n["query"], _n["keys"]), ValueError,
     r"kind='dot' needs query and keys of equal width, got query \(2, 3, 5\) \(Dq=5\)"),
    (lambda: ref.luong_scores(_n["query"], _n["keys"], kind="general"), ValueError,
     r"kind='general' needs weight of shape \(Dq, Dk\) = \(5, 6\)"),
    (lambda: ref.luong_scores(_n["query"], _n["keys"], kind="general", weight=_n["w_query"]),
     ValueError, r"weight must have shape \(Dq, Dk\) = \(5, 6\), got \(5, 7\)"),
    (lambda: ref.attend(np.zeros((2, 3, 4)), _n["values"][:, :3]), ValueError,
     r"values must have S=4 rows \(dimension -2\)"),
    (lambda: ref.attend(np.zeros((2, 3, 4)), _n["values"], np.ones((3, 5), bool)), ValueError,
     r"mask of shape \(3, 5\) does not broadcast to scores \(2, 3, 4\)"),
    (lambda: ref.attend(np.zeros((2, 3, 4)), _n["values"], np.ones((5, 2, 3, 4), bool)),
     ValueError, r"mask of shape \(5, 2, 3, 4\) does not broadcast to scores"),
    (lambda: ref.attend(np.zeros((2, 3, 4)), _n["values"], np.array([0, np.inf, 0, 0])),
     ValueError, r"mask contains NaN or \+inf; use -inf to hide a key"),
]


@pytest.mark.parametrize(("call", "exc", "match"), ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_error_messages(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
