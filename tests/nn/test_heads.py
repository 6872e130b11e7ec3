"""AttentionHead, SelfAttention, HeadList vs plain matmul/softmax; HeadList equals Attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from helpers import TOL, assert_close
from qkv.nn import Attention, AttentionHead, HeadList, SelfAttention


def one_head(q_lin, k_lin, v_lin, x, src, *, causal=False, mask=None):
    """softmax(q kᵀ / √D [+ mask]) v for one head, in float64 from the layers' weights."""
    dtype, x, src = x.dtype, x.double(), src.double()

    def lin(layer, t):
        b = None if layer.bias is None else layer.bias.double()
        return F.linear(t, layer.weight.double(), b)

    q, k, v = lin(q_lin, x), lin(k_lin, src), lin(v_lin, src)  # (B, T|S, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, T, S)
    if causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else (
            scores + mask.double()
        )
    w = torch.softmax(scores, dim=-1)
    return (w @ v).to(dtype), w.to(dtype)


def grads(outputs, leaves):
    torch.manual_seed(2)
    seeds = [torch.randn_like(t) for t in outputs]
    return torch.autograd.grad(outputs, leaves, seeds)


def compare(got, want, leaves, dtype, name):
    for g, w, what in zip(got, want, ("out", "weights"), strict=True):
        assert_close(g, w, **TOL[dtype], name=f"{name} {what}")
    for i, (g, w) in enumerate(zip(grads(got, leaves), grads(want, leaves), strict=True)):
        assert_close(g, w, **TOL[dtype], name=f"{name} grad {i}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal, max_len", [(False, None), (True, None), (True, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_attention_head_self(dtype, causal, max_len, bias):
    torch.manual_seed(0)
    head = AttentionHead(12, 5, causal=causal, max_len=max_len, bias=bias).to(dtype)
    x = torch.randn(3, 9, 12, dtype=dtype, requires_grad=True)
    got = head(x)
    assert got[0].shape == (3, 9, 5) and got[1].shape == (3, 9, 9)
    want = one_head(head.query, head.key, head.value, x, x, causal=causal)
    compare(got, want, [x, *head.parameters()], dtype, f"causal={causal} max_len={max_len}")
    if causal:
        assert torch.equal(got[1].triu(1), torch.zeros_like(got[1]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_head_cross_odd_sizes(dtype):
    torch.manual_seed(1)
    head = AttentionHead(20, 59, bias=True).to(dtype)
    x = torch.randn(2, 113, 20, dtype=dtype, requires_grad=True)
    ctx = torch.randn(2, 203, 20, dtype=dtype, requires_grad=True)
    got = head(x, ctx)
    assert got[1].shape == (2, 113, 203)
    want = one_head(head.query, head.key, head.value, x, ctx)
    compare(got, want, [x, ctx, *head.parameters()], dtype, "113x203")


def test_causal_buffer_is_not_saved_and_follows_the_module():
    head = AttentionHead(8, 4, causal=True, max_len=6)
    assert head.tril.shape == (6, 6) and "tril" not in head.state_dict()
    assert AttentionHead(8, 4, causal=True).tril is None  # no max_len: built per call
    assert AttentionHead(8, 4, max_len=6).tril is None  # not causal: nothing to store
    assert "causal=True, max_len=6" in repr(head)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mask_kind", [None, "bool_BTT", "padding", "float_TT"])
def test_self_attention(dtype, mask_kind):
    torch.manual_seed(2)
    attn = SelfAttention(10, bias=True).to(dtype)
    assert attn.q_proj.weight.shape == (10, 10)  # d_head defaults to d_model
    x = torch.randn(2, 7, 10, dtype=dtype, requires_grad=True)
    keep = torch.rand(2, 7, 7) > 0.5
    keep[..., 0] = True
    mask, ref_mask = {
        None: (None, None),
        "bool_BTT": (keep, keep),
        "padding": (qkv.masks.padding([7, 4], 7), qkv.masks.padding([7, 4], 7)[:, 0]),
        "float_TT": (torch.randn(7, 7, dtype=dtype), None),
    }[mask_kind]
    if mask_kind == "float_TT":
        ref_mask = mask
    got = attn(x, mask)
    want = one_head(attn.q_proj, attn.k_proj, attn.v_proj, x, x, mask=ref_mask)
    compare(got, want, [x, *attn.parameters()], dtype, f"mask={mask_kind}")


def test_self_attention_d_head():
    attn = SelfAttention(12, d_head=5)
    out, w = attn(torch.randn(2, 4, 12))
    assert out.shape == (2, 4, 5) and w.shape == (2, 4, 4)
    assert attn.q_proj.bias is None  # bias=False by default, as in the seed


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
# Causal heads are self-attention only (the cross case is an error, see test_errors).
@pytest.mark.parametrize("causal, cross", [(False, False), (True, False), (False, True)])
def test_head_list_equals_attention(dtype, causal, bias, cross):
    torch.manual_seed(3)
    heads = HeadList(24, 4, causal=causal, bias=bias).to(dtype)
    attn = heads.to_attention()
    assert isinstance(attn, Attention) and attn.q_proj.weight.dtype == dtype
    # Head h's weights are rows h·D .. (h+1)·D - 1 of the fused projection.
    assert torch.equal(attn.k_proj.weight[12:18], heads.heads[2].key.weight)
    x = torch.randn(2, 9, 24, dtype=dtype, requires_grad=True)
    ctx = torch.randn(2, 11, 24, dtype=dtype, requires_grad=True) if cross else None
    got = heads(x, ctx)
    assert got[0].shape == (2, 9, 24) and got[1].shape == (2, 4, 9, 11 if cross else 9)
    want = attn(x, ctx, is_causal=causal, need_weights=True)
    leaves = [x] + ([ctx] if cross else [])
    compare(got, want, leaves, dtype, f"causal={causal} bias={bias}")
    # Fast path of Attention (no weights) agrees too.
    assert_close(attn(x, ctx, is_causal=causal)[0], got[0], **TOL[dtype], name="fast path")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: AttentionHead(0, 4), ValueError, "d_model must be a positive int, got 0"),
        (lambda: AttentionHead(8, 4, max_len=0), ValueError, "max_len must be a positive int"),
        (lambda: SelfAttention(8, d_head=0), ValueError, "d_head must be a positive int"),
        (lambda: HeadList(10, 4), ValueError, r"d_model \(10\) must be divisible by num_heads"),
        (lambda: HeadList(8, 0), ValueError, "num_heads must be a positive int"),
        (lambda: AttentionHead(8, 4, causal=True, max_len=5)(torch.randn(1, 6, 8)), ValueError,
         "sequence length T=6 exceeds max_len=5"),
        (lambda: AttentionHead(8, 4, causal=True)(torch.randn(1, 3, 8), torch.randn(1, 4, 8)),
         ValueError, "a causal head cannot attend to a context"),
        (lambda: AttentionHead(8, 4)(torch.randn(1, 3, 8), torch.randn(2, 4, 8)), ValueError,
         "context batch size 2 must equal x's 1"),
        (lambda: AttentionHead(8, 4)(torch.randn(1, 3, 7)), ValueError,
         r"x must have shape \(B, T, E=8\), got \(1, 3, 7\)"),
        (lambda: AttentionHead(8, 4)(torch.randn(1, 3, 8), torch.randn(1, 4)), ValueError,
         r"context must have shape \(B, S, E=8\)"),
        (lambda: AttentionHead(8, 4)("x"), TypeError, "x must be a torch.Tensor, got str"),
        (lambda: SelfAttention(8)(torch.randn(1, 3, 8).double()), TypeError,
         "x has dtype torch.float64 but the parameters are torch.float32"),
        (lambda: SelfAttention(8)(torch.randn(1, 3, 8), mask="all"), TypeError,
         "mask must be a torch.Tensor or None, got str"),
        (lambda: SelfAttention(8)(torch.randn(1, 3, 8), mask=torch.ones(4, 4, dtype=torch.bool)),
         ValueError, "does not broadcast"),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
