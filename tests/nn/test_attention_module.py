"""qkv.nn.Attention against an independent matmul/softmax reference written here.

The reference uses only the module's parameters and plain torch ops (F.linear, matmul,
softmax, repeat_interleave for grouped-query heads); it shares no code with qkv's attention.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from helpers import TOL, assert_close, max_error
from qkv.attention.triton import installed
from qkv.nn import Attention, KVCache, LayerKVCache
from qkv.nn.alibi import alibi_bias
from qkv.nn.rope import RotaryEmbedding

NEG = float("-inf")


def reference(
    attn, x, context=None, *, mask=None, causal=False, bias=None, rope=None, work=torch.float64
):
    """Multi-head attention by its definition; returns ``(out (B,T,E), weights (B,H,T,S))``.

    Computed in ``work`` precision (float64 by default, the "truth" for float32 inputs) and
    rounded once to the input dtype; gradients flow back to the original tensors.
    """
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.d_head
    p = {name: t.to(work) for name, t in attn.named_parameters()}
    dtype, x = x.dtype, x.to(work)
    src = x if context is None else context.to(work)
    B, T, S = x.shape[0], x.shape[1], src.shape[1]
    q = F.linear(x, p["q_proj.weight"], p.get("q_proj.bias")).reshape(B, T, H, D).transpose(1, 2)
    k = F.linear(src, p["k_proj.weight"], p.get("k_proj.bias")).reshape(B, S, Hkv, D)
    v = F.linear(src, p["v_proj.weight"], p.get("v_proj.bias")).reshape(B, S, Hkv, D)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, S, D)
    if rope is not None:
        q, k = rope(q), rope(k)
    k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias.to(work)
    if causal:
        keep = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
        scores = scores.masked_fill(~keep, NEG)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, NEG)
    elif mask is not None:
        scores = scores + mask.to(work)
    dead = torch.isneginf(scores).all(-1, keepdim=True)
    w = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    out = (w @ v).transpose(1, 2).reshape(B, T, H * D)
    out = F.linear(out, p["out_proj.weight"], p.get("out_proj.bias"))
    return out.to(dtype), w.to(dtype)


def make(dtype, *args, seed=0, **kwargs):
    torch.manual_seed(seed)
    attn = Attention(*args, **kwargs).to(dtype)
    for name, p in attn.named_parameters():  # non-zero biases so a missing bias would show
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.5)
    return attn


def rand(*shape, dtype, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _grads(outputs, leaves):
    torch.manual_seed(1)
    seeds = [torch.randn_like(t) for t in outputs]
    return torch.autograd.grad(outputs, leaves, seeds, allow_unused=True)


def check_fwd_bwd(attn, inputs, run, ref, dtype, name):
    """Compare ``run()`` with ``ref(work)``: outputs, and gradients of inputs and parameters.

    float64 is held to 1e-10. float32 is compared with the float64 truth: outputs to 1e-5;
    a float32 gradient entry is a sum over up to B·T·S products and can be 0 in exact
    arithmetic (the k_proj bias gradient) while float32 leaves ~1e-5 of cancellation, so
    gradients may also be off by twice the error of the plain float32 reference (the rule
    flash-attention's tests use), whichever is larger.
    """
    tol = TOL[dtype]
    leaves = inputs + list(attn.parameters())
    got, want = run(), ref(torch.float64)
    got = [t for t in got if t is not None]
    want = want[: len(got)]
    for g, w, what in zip(got, want, ("out", "weights"), strict=False):
        assert_close(g, w, **tol, name=f"{name} {what}")
    grads, truth = _grads(got, leaves), _grads(want, leaves)
    plain = _grads(ref(dtype)[: len(got)], leaves) if dtype != torch.float64 else truth
    for i, (g, w, b) in enumerate(zip(grads, truth, plain, strict=True)):
        atol = max(tol["atol"], 2 * max_error(b, w))
        assert_close(g, w, atol=atol, rtol=tol["rtol"], name=f"{name} grad {i}")


# (E, H, Hkv, d_head, Ec): MHA, GQA 6/2, GQA 9/3 with explicit odd d_head, MQA.
CONFIGS = [(24, 4, 4, None, None), (24, 6, 2, None, 16), (36, 9, 3, 5, 20), (16, 4, 1, 7, None)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"E{c[0]}H{c[1]}kv{c[2]}")
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_matches_reference(dtype, config, cross, need_weights):
    E, H, Hkv, D, Ec = config
    attn = make(dtype, E, H, num_kv_heads=Hkv, d_head=D, d_context=Ec if cross else None)
    x = rand(2, 7, E, dtype=dtype)
    ctx = rand(2, 11, attn.d_context, dtype=dtype) if cross else None
    inputs = [x] + ([ctx] if cross else [])
    out, w = attn(x, ctx, need_weights=need_weights)
    assert (w is None) != need_weights
    assert out.shape == (2, 7, E) and (w is None or w.shape == (2, H, 7, 11 if cross else 7))
    check_fwd_bwd(
        attn, inputs, lambda: attn(x, ctx, need_weights=need_weights),
        lambda w: reference(attn, x, ctx, work=w), dtype, f"{config} cross={cross}",
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cross_attention_odd_sizes(dtype):
    """T=113 queries against S=203 keys, head width 59, grouped heads 4/2."""
    attn = make(dtype, 40, 4, num_kv_heads=2, d_head=59, d_context=24)
    x, ctx = rand(2, 113, 40, dtype=dtype), rand(2, 203, 24, dtype=dtype)
    check_fwd_bwd(
        attn, [x, ctx], lambda: attn(x, ctx, need_weights=True),
        lambda w: reference(attn, x, ctx, work=w), dtype, "113x203",
    )
    fast, _ = attn(x, ctx)
    assert_close(fast, reference(attn, x, ctx)[0], **TOL[dtype], name="fast kernel 113x203")


def _masks(B, H, T, S, dtype):
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(B, H, T, S, generator=g) > 0.4
    keep[..., 0] = True  # every row keeps a key
    return {
        "padding": qkv.masks.padding(torch.tensor([S, S - 3]), S),  # (B, 1, 1, S)
        "bool_full": keep,  # (B, H, T, S)
        "float_TS": torch.randn(T, S, generator=g, dtype=dtype),  # (T, S)
        "float_inf": qkv.masks.to_additive(keep[:, :1], dtype),  # (B, 1, T, S) with -inf
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["padding", "bool_full", "float_TS", "float_inf"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_masks(dtype, kind, causal, cross):
    attn = make(dtype, 24, 6, num_kv_heads=2)
    T, S = 9, (13 if cross else 9)
    x = rand(2, T, 24, dtype=dtype)
    ctx = rand(2, S, 24, dtype=dtype) if cross else None
    mask = _masks(2, 6, T, S, dtype)[kind]
    inputs = [x] + ([ctx] if cross else [])
    for nw in (False, True):
        check_fwd_bwd(
            attn, inputs,
            lambda nw=nw: attn(x, ctx, mask=mask, is_causal=causal, need_weights=nw),
            lambda w: reference(attn, x, ctx, mask=mask, causal=causal, work=w),
            dtype, f"{kind} causal={causal} need_weights={nw}",
        )


def test_calls_the_core_kernel_with_fast_path_arguments(monkeypatch):
    """Outputs come from the fused kernel unless weights are asked for; GQA stays folded;
    the module's call reaches the kernel through the core with no second validation."""
    import qkv.nn.core as core
    from qkv.attention import dispatch

    seen = []

    def spy(call, backend="auto"):
        seen.append({
            "need_weights": call.need_weights, "gqa": call.groups > 1,
            "dropout_p": call.dropout_p, "backend": dispatch.decide(call).chosen,
        })
        return dispatch.select(call, backend).run(call)

    monkeypatch.setattr(core, "run_call", spy)
    attn = Attention(24, 6, num_kv_heads=2, dropout=0.25).eval()
    x = torch.randn(2, 5, 24)
    attn(x)
    attn(x, need_weights=True)
    attn.train()
    attn(x)
    # Off the CPU torch's kernels return no weights: they come from triton (flash without it).
    weights_from = "torch" if x.device.type == "cpu" else "triton" if installed() else "flash"
    assert seen == [
        {"need_weights": False, "gqa": True, "dropout_p": 0.0, "backend": "torch"},
        {"need_weights": True, "gqa": True, "dropout_p": 0.0, "backend": weights_from},
        {"need_weights": False, "gqa": True, "dropout_p": 0.25, "backend": "torch"},
    ]


def test_dropout_only_in_training():
    attn = make(torch.float32, 16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    attn.eval()
    assert_close(attn(x)[0], reference(attn, x)[0], **TOL[torch.float32], name="eval")
    attn.train()
    torch.manual_seed(0)
    out, w = attn(x, need_weights=True)
    assert (w == 0).any() and not torch.allclose(out, reference(attn, x)[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("Hkv", [4, 2])
def test_rope_matches_rotating_by_hand(dtype, Hkv):
    rope = RotaryEmbedding(6)
    attn = make(dtype, 24, 4, num_kv_heads=Hkv, rope=rope)
    x = rand(2, 9, 24, dtype=dtype)
    check_fwd_bwd(
        attn, [x], lambda: attn(x, is_causal=True, need_weights=True),
        lambda w: reference(attn, x, causal=True, rope=rope, work=w), dtype, "rope",
    )
    # Explicit per-example positions (e.g. a left-padded batch) reach the rotation.
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    check_fwd_bwd(
        attn, [x], lambda: attn(x, positions=pos, need_weights=True),
        lambda w: reference(attn, x, rope=lambda t: rope(t, positions=pos), work=w), dtype,
        "positions",
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("H", [4, 6])
def test_alibi_matches_adding_bias_by_hand(dtype, symmetric, H):
    attn = make(dtype, 24, H, alibi=True, alibi_symmetric=symmetric)
    x = rand(2, 10, 24, dtype=dtype)
    bias = alibi_bias(H, 10, 10, symmetric=symmetric, dtype=torch.float64)
    pad = qkv.masks.padding(torch.tensor([10, 7]), 10)
    causal = not symmetric
    check_fwd_bwd(
        attn, [x], lambda: attn(x, mask=pad, is_causal=causal, need_weights=True),
        lambda w: reference(attn, x, mask=pad, causal=causal, bias=bias, work=w), dtype,
        "alibi",
    )


def _decode(attn, x, cache, chunks, **kw):
    """Feed ``x`` through ``attn`` in chunks of the given sizes; concatenate the outputs."""
    outs, start = [], 0
    for n in chunks:
        out, _ = attn(x[:, start:start + n], is_causal=True, cache=cache, **kw)
        outs.append(out)
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_kv_heads=2, rope="rope"),
        dict(num_kv_heads=3, d_head=8, rope="rope"),
        dict(num_kv_heads=2, alibi=True),
        dict(num_kv_heads=6),
    ],
    ids=["rope-gqa", "rope-gqa-d8", "alibi", "plain"],
)
@pytest.mark.parametrize("max_len", [None, 40])
@pytest.mark.parametrize("chunks", [[1] * 12, [5, 1, 1, 3, 2]], ids=["tokens", "prefill"])
def test_cached_decoding_equals_full_recompute(kwargs, max_len, chunks):
    kwargs = dict(kwargs)
    if kwargs.get("rope") == "rope":
        kwargs["rope"] = RotaryEmbedding(kwargs.get("d_head", 4))
    attn = make(torch.float32, 24, 6, **kwargs)
    x = torch.randn(3, 12, 24)
    full, _ = attn(x, is_causal=True)
    cache = KVCache(1, max_len=max_len)
    stepped = _decode(attn, x, cache[0], chunks)
    assert cache.length == 12
    assert_close(stepped, full, **TOL[torch.float32], name="cached vs full")
    # Weights of the last step equal the last rows of the full weights.
    cache.crop(11)
    _, w_last = attn(x[:, 11:], is_causal=True, cache=cache[0], need_weights=True)
    _, w_full = attn(x, is_causal=True, need_weights=True)
    assert_close(w_last, w_full[:, :, 11:], **TOL[torch.float32], name="last-step weights")


def test_cached_decoding_with_padding_mask_and_positions():
    """Left-padded prompts: positions skip the padding, the mask hides it, at every step."""
    rope = RotaryEmbedding(4)
    attn = make(torch.float32, 24, 6, num_kv_heads=2, rope=rope)
    x = torch.randn(2, 8, 24)
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[1, :3] = False  # the second prompt is left-padded by 3
    pos = (keep.long().cumsum(-1) - 1).clamp(min=0)  # (B, S)
    full, _ = attn(x, is_causal=True, mask=keep[:, None, None], positions=pos)
    cache = LayerKVCache()
    outs = [attn(x[:, :4], is_causal=True, mask=keep[:, None, None, :4], positions=pos[:, :4],
                 cache=cache)[0]]
    for t in range(4, 8):
        m = keep[:, None, None, : t + 1]
        outs.append(attn(x[:, t:t + 1], is_causal=True, mask=m, positions=pos[:, t:t + 1],
                         cache=cache)[0])
    stepped = torch.cat(outs, 1)
    assert_close(stepped[1, 3:], full[1, 3:], **TOL[torch.float32], name="padded row")
    assert_close(stepped[0], full[0], **TOL[torch.float32], name="unpadded row")


def test_cross_attention_cache_projects_context_once():
    attn = make(torch.float32, 24, 6, num_kv_heads=3, d_context=10)
    ctx, x = torch.randn(2, 13, 10), torch.randn(2, 5, 24)
    calls = []
    attn.k_proj.register_forward_hook(lambda *a: calls.append(1))
    cache = LayerKVCache()
    steps = [attn(x[:, t:t + 1], ctx, cache=cache, need_weights=True) for t in range(5)]
    assert len(calls) == 1 and cache.static is not None and cache.length == 0
    full, w = reference(attn, x, ctx)
    assert_close(torch.cat([s[0] for s in steps], 1), full, **TOL[torch.float32], name="out")
    assert_close(torch.cat([s[1] for s in steps], 2), w, **TOL[torch.float32], name="weights")


def test_one_cache_serves_self_and_cross_attention():
    self_attn = make(torch.float32, 16, 4, rope=RotaryEmbedding(4))
    cross = make(torch.float32, 16, 4, seed=1)
    ctx, x = torch.randn(2, 7, 16), torch.randn(2, 6, 16)

    def layer(h, cache=None):
        h = h + self_attn(h, is_causal=True, cache=cache)[0]
        return h + cross(h, ctx, cache=cache)[0]

    full = layer(x)
    cache = KVCache(1)
    stepped = torch.cat([layer(x[:, t:t + 1], cache[0]) for t in range(6)], 1)
    assert_close(stepped, full, **TOL[torch.float32], name="decoder layer")
    # Beam search: reordering keeps self and cross entries of the chosen rows.
    cache.reorder(torch.tensor([1, 1, 0]))
    nxt = torch.randn(2, 1, 16)
    got = layer(nxt[[1, 1, 0]], cache[0])
    want = layer(torch.cat([x, nxt], 1))[[1, 1, 0], -1:]
    assert_close(got, want, **TOL[torch.float32], name="after reorder")


@pytest.mark.parametrize(
    "kwargs, causal",
    [({}, False), ({}, True), ({"alibi": True}, True), ({"rope": RotaryEmbedding(4)}, True)],
    ids=["plain", "causal", "alibi", "rope"],
)
def test_fully_padded_sequence_gives_zeros_and_finite_grads(kwargs, causal):
    attn = make(torch.float32, 24, 6, num_kv_heads=2, bias=False, **kwargs)
    x = torch.randn(2, 5, 24, requires_grad=True)
    mask = qkv.masks.padding(torch.tensor([5, 0]), 5)  # the second sequence is all padding
    for nw in (False, True):
        out, w = attn(x, mask=mask, is_causal=causal, need_weights=nw)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        if nw:
            assert torch.equal(w[1], torch.zeros_like(w[1]))
        out.sum().backward()
        grads = [x.grad, *(p.grad for p in attn.parameters())]
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.equal(x.grad[1], torch.zeros_like(x.grad[1]))
        x.grad = None
        attn.zero_grad()


def test_empty_context_and_extra_repr():
    attn = Attention(16, 4, num_kv_heads=2, d_context=8)
    text = repr(attn)
    assert "num_kv_heads=2" in text and "d_context=8" in text and "alibi" not in text
    assert "alibi=symmetric" in repr(Attention(16, 4, alibi=True, alibi_symmetric=True))
    out, w = attn(torch.randn(1, 3, 16), torch.randn(1, 0, 8), need_weights=True)
    assert out.shape == (1, 3, 16) and w.shape == (1, 4, 3, 0)
    assert torch.equal(out, attn.out_proj.bias.expand(1, 3, 16))  # no key: zero attention


CTOR_ERRORS = [
    (dict(d_model=0, num_heads=2), ValueError, "d_model must be a positive int, got 0"),
    (dict(d_model=8, num_heads=0), ValueError, "num_heads must be a positive int"),
    (dict(d_model=10, num_heads=4), ValueError, r"d_model \(10\) must be divisible by num_heads"),
    (dict(d_model=8, num_heads=4, num_kv_heads=3), ValueError,
     r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(d_model=8, num_heads=4, num_kv_heads=0), ValueError, "num_kv_heads must be a positive"),
    (dict(d_model=8, num_heads=2, d_head=-1), ValueError, "d_head must be a positive int"),
    (dict(d_model=8, num_heads=2, d_context=0), ValueError, "d_context must be a positive"),
    (dict(d_model=8, num_heads=2, dropout=1.0), ValueError,
     r"dropout must be a number in \[0, 1\)"),
    (dict(d_model=8, num_heads=2, rope="yes"), TypeError, "rope must be a RotaryEmbedding"),
    (dict(d_model=8, num_heads=2, rope=RotaryEmbedding(6)), ValueError,
     r"rope.d_head \(6\) must equal d_head \(4\)"),
    (dict(d_model=8, num_heads=2, alibi_symmetric=True), ValueError, "needs alibi=True"),
]


@pytest.mark.parametrize("kwargs, error, match", CTOR_ERRORS)
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        Attention(**kwargs)


def test_d_head_lifts_divisibility():
    attn = Attention(10, 4, d_head=3)
    assert attn.q_proj.weight.shape == (12, 10) and attn.out_proj.weight.shape == (10, 12)


def _forward_errors():
    attn = Attention(8, 2, d_context=6)
    rope_attn = Attention(8, 2, rope=RotaryEmbedding(4))
    x = torch.randn(2, 3, 8)
    cache = LayerKVCache()
    attn(x[:1], torch.randn(1, 4, 6), cache=cache)  # static keys for batch 1
    return [
        (attn, ([1.0],), {}, TypeError, "x must be a torch.Tensor, got list"),
        (attn, (torch.randn(3, 8),), {}, ValueError,
         r"x must have shape \(B, T, E=8\), got \(3, 8\)"),
        (rope_attn, (torch.randn(2, 3, 7),), {}, ValueError, r"x must have shape \(B, T, E=8\)"),
        (attn, (x, torch.randn(2, 4, 8)), {}, ValueError,
         r"context must have shape \(B, S, Ec=6\)"),
        (attn, (x, torch.randn(3, 4, 6)), {}, ValueError,
         "context batch size 3 .* must equal x's 2"),
        (rope_attn, (x.double(),), {}, TypeError,
         "x has dtype torch.float64 but the module's parameters"),
        (rope_attn, (x,), dict(mask=[[True]]), TypeError, "mask must be a torch.Tensor or None"),
        (rope_attn, (x,), dict(mask=torch.ones(3, 3, dtype=torch.int64)), TypeError,
         "mask must be boolean .* got dtype torch.int64"),
        (rope_attn, (x,), dict(mask=torch.ones(4, 3, dtype=torch.bool)), ValueError,
         "does not broadcast"),
        (rope_attn, (x,), dict(cache=KVCache(1)), TypeError, "cache must be a LayerKVCache"),
        (attn, (x,), {}, ValueError, r"d_context \(6\) != d_model \(8\)"),
        (attn, (x, torch.randn(2, 4, 6)), dict(cache=cache), ValueError,
         "static keys have batch size 1 but x has 2"),
        (rope_attn, (x, x), {}, ValueError, "cannot be called with a context"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_forward_errors(case):
    attn, args, kwargs, error, match = _forward_errors()[case]
    with pytest.raises(error, match=match):
        attn(*args, **kwargs)


def test_cache_mismatch_between_steps_is_reported():
    attn = Attention(8, 2)
    cache = LayerKVCache(max_len=4)
    attn(torch.randn(2, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="batch size B changed between steps"):
        attn(torch.randn(3, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="exceeds max_len=4"):
        attn(torch.randn(2, 2, 8), cache=cache)
