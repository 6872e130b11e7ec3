"""The flash backend: structured masks, log-sum-exp, rebuilt weights, dropout, tiling."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from helpers import assert_close, backend_names
from qkv import masks
from qkv.attention.backends import flash
from qkv.attention.call import make_call
from qkv.attention.flash_blocks import plan_blocks
from qkv.attention.weights import attention_weights


@pytest.fixture(autouse=True)
def tiny_flash_blocks(monkeypatch):
    from qkv.attention import flash_blocks

    monkeypatch.setattr(
        flash_blocks, "BLOCKS", {"float32": (16, 32), "bfloat16": (16, 32), "float64": (8, 16)}
    )


def inputs(B=2, H=4, Hkv=2, T=37, S=53, D=11, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, T, D, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, D, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, D + 2, generator=g, dtype=dtype),
    )


def explicit_bias(H, T, S, *, shift=None, window=None, slopes=None, causal=True):
    """Float mask (H, T, S) written out entry by entry from the definitions."""
    shift = (S - T) if shift is None else shift
    bias = torch.zeros(H, T, S, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            for j in range(S):
                if (causal and j > i + shift) or (window is not None and j <= i + shift - window):
                    bias[h, i, j] = -math.inf
                elif slopes is not None:
                    bias[h, i, j] = -float(slopes[h]) * abs(i + shift - j)
    return bias


def dense_reference(q, k, v, bias):
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ kk.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias
    w = torch.nan_to_num(torch.softmax(s, -1))
    return w @ vv, w, torch.logsumexp(s, -1)


CASES = [
    ("bottom-right T<S", dict(is_causal="bottom-right"), dict(shift=None)),
    ("bottom-right T>S", dict(is_causal="bottom-right"), dict(shift=None)),
    ("window 5", dict(is_causal=True, window=5), dict(shift=0, window=5)),
    ("window 20 bottom-right", dict(is_causal="bottom-right", window=20), dict(window=20)),
    ("alibi", dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])), dict(causal=False, slopes=[0.5, 0.25, 0.125, 0.0625])),
    ("alibi causal", dict(is_causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])), dict(shift=0, slopes=[0.5, 0.25, 0.125, 0.0625])),
]


@pytest.mark.parametrize("backend", backend_names())
@pytest.mark.parametrize(("name", "kwargs", "spec"), CASES, ids=[c[0] for c in CASES])
def test_structured_masks_match_explicit(backend, name, kwargs, spec):
    T, S = (53, 37) if "T>S" in name else (37, 53)
    q, k, v = inputs(T=T, S=S)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bias = explicit_bias(4, T, S, **spec)
    ref, _, _ = dense_reference(q, k, v, bias)
    out = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend, **kwargs)
    assert_close(out, ref, atol=1e-10, name=f"{name} output [{backend}]")
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for n, a, b in zip("qkv", got, want, strict=True):
        assert_close(a, b, atol=1e-10, name=f"{name} d{n} [{backend}]")


@pytest.mark.parametrize(("name", "kwargs", "spec"), CASES, ids=[c[0] for c in CASES])
def test_lse_equals_torch_logsumexp(name, kwargs, spec):
    T, S = (53, 37) if "T>S" in name else (37, 53)
    q, k, v = inputs(T=T, S=S)
    call = make_call(q, k, v, None, 0.0, kwargs.get("is_causal", False), None, True, False,
                     kwargs.get("window"), kwargs.get("alibi_slopes"))
    _, lse = flash.attend(call)
    _, _, ref = dense_reference(q, k, v, explicit_bias(4, T, S, **spec))
    assert lse.dtype == torch.float64
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "rows with no key: lse = -inf"
    finite = torch.isfinite(ref)
    assert_close(lse[finite], ref[finite], atol=1e-10, name="lse")


def test_rebuilt_weights_precise_with_large_scores():
    """Scores around 100: lse rounded to float32 alone would put weights ~1e-5 off."""
    q, k, v = inputs(B=1, H=2, Hkv=2, T=16, S=24, D=8, dtype=torch.float32)
    q = q * 12.0
    _, w = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, backend="flash")
    ref = torch.softmax(q.double() @ k.double().transpose(-2, -1) / math.sqrt(8), -1)
    assert_close(w, ref, atol=2e-6, name="flash weights at large scores")
    assert w.max() <= 1.0 + 1e-7


def test_lse_is_float32_for_bfloat16():
    q, k, v = inputs(dtype=torch.bfloat16)
    call = make_call(q, k, v, None, 0.0, False, None, True, False)
    out, lse = flash.attend(call)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("heads", [None, [0], [3, 1]])
@pytest.mark.parametrize("rows", [None, slice(0, 1), slice(30, 37)])
def test_rebuilt_weights_for_chosen_heads_and_rows(heads, rows):
    q, k, v = inputs(T=37, S=53)
    keep = torch.rand(37, 53, generator=torch.Generator().manual_seed(3)) > 0.3
    call = make_call(q, k, v, keep, 0.0, True, None, True, False)
    _, lse = flash.attend(call)
    full = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, is_causal=True, enable_gqa=True, need_weights=True, backend="math"
    )[1]
    w = attention_weights(q, k, lse, keep, is_causal=True, enable_gqa=True, heads=heads, rows=rows)
    expected = full[:, heads or slice(None)][:, :, rows or slice(None)]
    assert_close(w, expected, atol=1e-12, name=f"weights heads={heads} rows={rows}")


def test_attention_weights_checks_lse_shape():
    q, k, _ = inputs()
    with pytest.raises(ValueError, match=r"lse must have shape \(\.\.\., H, T\) = \(2, 4, 37\), got \(2, 4\)"):
        attention_weights(q, k, torch.zeros(2, 4), enable_gqa=True)


def test_gradient_through_lse():
    """lse is differentiable: d lse_i / d s_ij = w_ij."""
    q, k, v = inputs(T=9, S=12, D=5)
    q, k = q.requires_grad_(), k.requires_grad_()

    def f(q, k):
        call = make_call(q, k, v, None, 0.0, "bottom-right", None, True, False)
        out, lse = flash.attend(call)
        return out.sum() + lse.sum()

    assert torch.autograd.gradcheck(f, (q, k))


def test_dropout_gradients_are_consistent():
    """With the seed fixed the mask is fixed, so the custom backward must match finite differences."""
    q, k, v = inputs(B=1, H=2, Hkv=1, T=9, S=13, D=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        torch.manual_seed(7)
        return qkv.scaled_dot_product_attention(
            q, k, v, dropout_p=0.3, is_causal="bottom-right", enable_gqa=True, backend="flash"
        )

    assert torch.autograd.gradcheck(f, (q, k, v))
    kw = dict(dropout_p=0.3, enable_gqa=True, backend="flash")
    torch.manual_seed(7)
    a = qkv.scaled_dot_product_attention(q, k, v, **kw)
    torch.manual_seed(7)
    b = qkv.scaled_dot_product_attention(q, k, v, **kw)
    c = qkv.scaled_dot_product_attention(q, k, v, **kw)
    assert torch.equal(a, b), "the same seed must give the same dropout"
    assert not torch.equal(a, c)


def test_causal_tiles_are_skipped():
    T = S = 256
    tiles = sum(len(r.tiles) for r in plan_blocks(T, S, 32, 32, causal=0, window=None))
    full = (T // 32) * (S // 32)
    assert tiles == (full + T // 32) // 2, f"{tiles} tiles visited of {full}"
    window = plan_blocks(T, S, 32, 32, causal=0, window=32)
    assert max(len(r.tiles) for r in window) == 2
    partial = [t.partial for r in plan_blocks(T, S, 32, 32, causal=0, window=None) for t in r.tiles]
    assert sum(partial) == T // 32, "only diagonal tiles are partial"


def test_default_blocks_long_sequence(monkeypatch):
    """The measured default block sizes, on a sequence longer than one block."""
    from qkv.attention import flash_blocks

    monkeypatch.undo()
    assert flash_blocks.BLOCKS["float32"][0] < 600
    q, k, v = inputs(B=1, H=2, Hkv=2, T=600, S=700, D=16, dtype=torch.float32)
    keep = masks.padding([650], 700)
    a = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal="bottom-right", backend="flash")
    b = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal="bottom-right", backend="math")
    assert_close(a, b, atol=2e-6, name="flash vs math, default blocks")
