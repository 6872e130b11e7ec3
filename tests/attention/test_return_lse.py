"""``return_lse=True``: the log-sum-exp of the scaled, masked scores, on every backend.

The reference is ``torch.logsumexp`` over scores built here by definition in float64
(``q·kᵀ·scale``, the mask parts added or applied by hand), forward; gradients of the lse are
checked against ``torch.logsumexp``'s on the backends that differentiate it (math, flash).
"""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from helpers import assert_close, backend_names
from qkv.attention import AttentionArgumentError

BACKENDS = backend_names(auto=False)
# The backends whose lse carries a gradient: all but torch, whose kernel does not
# differentiate its lse (test_torch_backend_lse_has_no_gradient_and_auto_prefers_flash).
LSE_GRAD_BACKENDS = [name for name in BACKENDS if name != "torch"]


def reference_scores(q, k, *, mask=None, causal=False, window=None, alibi=None, scale=None):
    """Scaled, masked scores ``(B, H, T, S)`` in float64, by definition."""
    q, k = q.double(), k.double()
    H, T, S = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)  # (B, H, S, D)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    i = torch.arange(T)[:, None]
    j = torch.arange(S)[None, :]
    if alibi is not None:
        s = s - alibi.double()[:, None, None] * (i - j).abs()  # (B, H, T, S)
    hide = torch.zeros(T, S, dtype=torch.bool)
    if causal:
        hide |= j > i
    if window is not None:
        hide |= j <= i - window
    s = s.masked_fill(hide, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return s


def _inputs(B, H, Hkv, T, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    return q, k, v


def _dead_row_mask(B, T, S):
    mask = torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[:, :, 1] = False  # query row 1 sees no key
    return mask


CASES = {
    "plain": dict(shape=(2, 3, 3, 5, 7, 8), kwargs={}),
    "causal": dict(shape=(2, 2, 2, 6, 6, 8), kwargs=dict(causal=True)),
    "bool mask, dead row": dict(shape=(2, 2, 2, 5, 9, 4), kwargs=dict(mask="dead")),
    "float mask": dict(shape=(1, 2, 2, 4, 6, 8), kwargs=dict(mask="float")),
    "gqa": dict(shape=(2, 4, 2, 5, 6, 8), kwargs={}),
    "gqa causal": dict(shape=(1, 4, 1, 6, 6, 8), kwargs=dict(causal=True)),
    "window": dict(shape=(1, 2, 2, 9, 9, 4), kwargs=dict(causal=True, window=3)),
    "alibi": dict(shape=(1, 3, 3, 6, 6, 8), kwargs=dict(causal=True, alibi=True)),
}


def _call_args(case, dtype):
    B, H, Hkv, T, S, D = case["shape"]
    q, k, v = _inputs(B, H, Hkv, T, S, D, dtype)
    kw = dict(case["kwargs"])
    ref_kw = {}
    sdpa_kw = dict(enable_gqa=H != Hkv)
    if kw.get("mask") == "dead":
        ref_kw["mask"] = sdpa_kw["attn_mask"] = _dead_row_mask(B, T, S)
    elif kw.get("mask") == "float":
        m = torch.randn(T, S, generator=torch.Generator().manual_seed(2), dtype=dtype)
        ref_kw["mask"] = sdpa_kw["attn_mask"] = m
    if kw.get("causal"):
        ref_kw["causal"] = sdpa_kw["is_causal"] = True
    if "window" in kw:
        ref_kw["window"] = sdpa_kw["window"] = kw["window"]
    if kw.get("alibi"):
        slopes = torch.tensor([0.5, 0.25, 0.125][:H])
        ref_kw["alibi"] = sdpa_kw["alibi_slopes"] = slopes
    return q, k, v, sdpa_kw, ref_kw


def _torch_refuses(case) -> bool:
    _, H, Hkv, *_ = case["shape"]
    masked = bool(case["kwargs"])
    return H != Hkv and masked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_lse_matches_logsumexp_of_reference_scores(name, backend, dtype):
    case = CASES[name]
    q, k, v, sdpa_kw, ref_kw = _call_args(case, dtype)
    if backend == "torch" and _torch_refuses(case):
        with pytest.raises(AttentionArgumentError, match="log-sum-exp"):
            qkv.scaled_dot_product_attention(q, k, v, **sdpa_kw, backend=backend, return_lse=True)
        return
    out, lse = qkv.scaled_dot_product_attention(
        q, k, v, **sdpa_kw, backend=backend, return_lse=True
    )
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert lse.dtype == expected_dtype, f"lse dtype {lse.dtype}, expected {expected_dtype}"
    assert lse.shape == q.shape[:3], f"lse shape {tuple(lse.shape)}, expected {q.shape[:3]}"
    want = torch.logsumexp(reference_scores(q, k, **ref_kw), dim=-1)  # (B, H, T)
    dead = torch.isneginf(want)
    assert torch.equal(torch.isneginf(lse), dead), (
        f"-inf rows {torch.isneginf(lse).nonzero().tolist()} != rows with no visible key "
        f"{dead.nonzero().tolist()}"
    )
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert_close(lse.masked_fill(dead, 0), want.masked_fill(dead, 0), atol=tol, rtol=tol,
                 name=f"lse ({name}, {backend})")
    plain = qkv.scaled_dot_product_attention(q, k, v, **sdpa_kw, backend=backend)
    assert torch.equal(out, plain), "return_lse changed the output"


@pytest.mark.parametrize("backend", LSE_GRAD_BACKENDS)
@pytest.mark.parametrize("name", ["plain", "causal", "gqa", "window", "alibi", "float mask"])
def test_lse_gradient_matches_logsumexp(name, backend):
    case = CASES[name]
    q, k, v, sdpa_kw, ref_kw = _call_args(case, torch.float64)
    q.requires_grad_()
    k.requires_grad_()
    out, lse = qkv.scaled_dot_product_attention(
        q, k, v, **sdpa_kw, backend=backend, return_lse=True
    )
    w = torch.randn(lse.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    dq, dk = torch.autograd.grad((lse * w).sum() + out.sum(), (q, k))
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    want_lse = torch.logsumexp(reference_scores(q2, k2, **ref_kw), dim=-1)
    want_out = qkv.scaled_dot_product_attention(q2, k2, v, **sdpa_kw, backend="math")
    want_dq, want_dk = torch.autograd.grad((want_lse * w).sum() + want_out.sum(), (q2, k2))
    assert_close(dq, want_dq, atol=1e-10, rtol=1e-10, name=f"dq ({name}, {backend})")
    assert_close(dk, want_dk, atol=1e-10, rtol=1e-10, name=f"dk ({name}, {backend})")


@pytest.mark.parametrize("backend", LSE_GRAD_BACKENDS)
def test_dead_rows_give_zero_lse_gradient(backend):
    q, k, v, sdpa_kw, _ = _call_args(CASES["bool mask, dead row"], torch.float64)
    q.requires_grad_()
    _, lse = qkv.scaled_dot_product_attention(
        q, k, v, **sdpa_kw, backend=backend, return_lse=True
    )
    finite = torch.isfinite(lse)
    (dq,) = torch.autograd.grad(lse.masked_fill(~finite, 0).sum(), (q,))
    assert not torch.isnan(dq).any(), f"{int(torch.isnan(dq).sum())} NaN gradient entries"
    assert dq[:, :, 1].abs().max() == 0, f"dead row gradient {dq[:, :, 1].abs().max():.3e}"


def test_torch_backend_lse_has_no_gradient_and_auto_prefers_flash():
    q, k, v = _inputs(1, 2, 2, 5, 5, 8, torch.float32)
    q.requires_grad_()
    out, lse = qkv.scaled_dot_product_attention(q, k, v, backend="torch", return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    q2 = q.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
        q2, k, v).sum(), (q2,))
    assert_close(dq, want, atol=1e-6, name="dq through out (torch backend)")
    decision = qkv.explain(q, k, v, return_lse=True)
    assert decision.chosen == "flash", str(decision)
    _, lse_auto = qkv.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert lse_auto.requires_grad
    with torch.no_grad():
        assert qkv.explain(q, k, v, return_lse=True).chosen == "torch"


def test_leading_dims_weights_and_2d_inputs():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 2, 5, 8, generator=g) for _ in range(3))
    out, w, lse = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, return_lse=True)
    assert lse.shape == (2, 3, 2, 5) and w.shape == (2, 3, 2, 5, 5) and out.shape == q.shape
    want = torch.logsumexp(reference_scores(q.reshape(6, 2, 5, 8), k.reshape(6, 2, 5, 8)), -1)
    assert_close(lse.reshape(6, 2, 5), want, atol=1e-5, name="lse with leading dims")
    _, lse2 = qkv.scaled_dot_product_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0],
                                               return_lse=True)
    assert lse2.shape == (5,)
    assert_close(lse2, want[0, 0], atol=1e-5, name="lse of 2-D inputs")


def test_bad_return_lse_arguments():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(AttentionArgumentError, match="return_lse must be a bool"):
        qkv.scaled_dot_product_attention(q, q, q, return_lse="yes")
    with pytest.raises(AttentionArgumentError, match="flex_attention"):
        qkv.scaled_dot_product_attention(q, q, q, score_mod=lambda s, b, h, i, j: s,
                                         return_lse=True)
    with pytest.raises(AttentionArgumentError, match="dropout"):
        qkv.scaled_dot_product_attention(q, q, q, dropout_p=0.5, backend="torch",
                                         return_lse=True)
