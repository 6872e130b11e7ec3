"""qkv.scaled_dot_product_attention against torch's own function, on every backend."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from helpers import assert_close, backend_names, max_error, skip_if_refused
from qkv import masks

BACKENDS = backend_names()  # "auto" and every registered backend


@pytest.fixture(autouse=True)
def tiny_flash_blocks(monkeypatch):
    """Small flash tiles, so that every shape here is cut into many partial and full tiles."""
    from qkv.attention import flash_blocks

    monkeypatch.setattr(
        flash_blocks, "BLOCKS", {"float32": (16, 32), "bfloat16": (16, 32), "float64": (8, 16)}
    )

# (batch dims, H, Hkv, T, S, D, Dv)
SHAPES = [
    pytest.param((2,), 4, 4, 5, 8, 16, 16, id="small"),
    pytest.param((1,), 2, 2, 113, 203, 59, 59, id="odd-113x203-d59"),
    pytest.param((1,), 1, 1, 1, 1, 4, 4, id="1x1"),
    pytest.param((2,), 6, 2, 7, 7, 8, 5, id="gqa-6-2-dv5"),
    pytest.param((2,), 9, 3, 13, 9, 16, 16, id="gqa-9-3-T>S"),
    pytest.param((2, 3), 2, 2, 6, 10, 8, 8, id="lead-2x3"),
]

MASKS = ["none", "bool2d", "bool4d", "float", "padding", "causal", "causal+bool", "bottom-right"]


def make_inputs(lead, H, Hkv, T, S, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, H, T, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(*lead, Hkv, S, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(*lead, Hkv, S, Dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def make_mask(kind, lead, H, T, S, dtype, seed=1):
    """(kwargs for qkv, explicit keep-or-float mask for the reference)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return {}, None
    if kind == "bool2d":
        m = torch.rand(T, S, generator=g) > 0.4
        m[T // 2] = False  # one query row sees nothing
        return {"attn_mask": m}, m
    if kind == "bool4d":
        m = torch.rand(*lead, H, T, S, generator=g) > 0.3
        return {"attn_mask": m}, m
    if kind == "float":
        m = torch.randn(T, S, generator=g, dtype=torch.float64)
        m[torch.rand(T, S, generator=g) > 0.7] = float("-inf")
        m = m.to(dtype)
        return {"attn_mask": m}, m
    if kind == "padding":
        lengths = [max(1, S - 3 * i) for i in range(math.prod(lead))]
        m = masks.padding(lengths, S).reshape(*lead, 1, 1, S)
        return {"attn_mask": m}, m
    if kind == "causal":
        return {"is_causal": True}, masks.causal(T, S)
    if kind == "causal+bool":
        m = torch.rand(T, S, generator=g) > 0.3
        return {"attn_mask": m, "is_causal": True}, m & masks.causal(T, S)
    if kind == "bottom-right":
        m = masks.causal(T, S, align="bottom-right")
        return {"attn_mask": m}, m
    raise AssertionError(kind)


def reference(q, k, v, mask, scale=None):
    """torch's own function in float64, with GQA expanded by hand and dead rows zeroed."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    G = q.shape[-3] // k.shape[-3]
    k64 = k64.repeat_interleave(G, dim=-3)
    v64 = v64.repeat_interleave(G, dim=-3)
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    out = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=m, scale=scale)
    if m is not None:
        dead = ~m.any(-1, keepdim=True) if m.dtype == torch.bool else torch.isneginf(m).all(-1, keepdim=True)
        out = out.masked_fill(dead, 0.0)
    return out


def reference_weights(q, k, mask, scale=None):
    G = q.shape[-3] // k.shape[-3]
    k64 = k.double().repeat_interleave(G, dim=-3)
    scores = q.double() @ k64.transpose(-2, -1) * (scale or 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    w = torch.softmax(scores, -1)
    return torch.nan_to_num(w, nan=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize(("lead", "H", "Hkv", "T", "S", "D", "Dv"), SHAPES)
def test_forward_and_gradients_float64(backend, mask_kind, lead, H, Hkv, T, S, D, Dv):
    q, k, v = make_inputs(lead, H, Hkv, T, S, D, Dv, torch.float64)
    kwargs, explicit = make_mask(mask_kind, lead, H, T, S, torch.float64)
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    out = qkv.scaled_dot_product_attention(q1, k1, v1, enable_gqa=H != Hkv, backend=backend, **kwargs)
    ref = reference(q2, k2, v2, explicit)
    assert_close(out, ref, atol=1e-10, name=f"output[{backend}, {mask_kind}]")
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    for name, a, b in (("dq", q1, q2), ("dk", k1, k2), ("dv", v1, v2)):
        assert_close(a.grad, b.grad, atol=1e-10, name=f"{name}[{backend}, {mask_kind}]")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "bool2d", "float", "causal", "padding"])
@pytest.mark.parametrize(("lead", "H", "Hkv", "T", "S", "D", "Dv"), SHAPES[:4])
def test_forward_float32_matches_torch(backend, mask_kind, lead, H, Hkv, T, S, D, Dv):
    q, k, v = make_inputs(lead, H, Hkv, T, S, D, Dv, torch.float32)
    kwargs, explicit = make_mask(mask_kind, lead, H, T, S, torch.float32)
    out = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv, backend=backend, **kwargs)
    assert out.dtype == torch.float32
    assert_close(out, reference(q, k, v, explicit), atol=1e-5, rtol=1e-5, name=f"output[{backend}]")


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize(("lead", "H", "Hkv", "T", "S", "D", "Dv"), SHAPES)
def test_weights_match_softmax(mask_kind, lead, H, Hkv, T, S, D, Dv):
    q, k, v = make_inputs(lead, H, Hkv, T, S, D, Dv, torch.float64)
    kwargs, explicit = make_mask(mask_kind, lead, H, T, S, torch.float64)
    out, w = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv, need_weights=True, **kwargs)
    assert w.shape == (*lead, H, T, S)
    assert_close(w, reference_weights(q, k, explicit), atol=1e-12, name=f"weights[{mask_kind}]")
    assert_close(out, reference(q, k, v, explicit), atol=1e-10, name="output with weights")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("lead", "H", "Hkv", "T", "S", "D", "Dv"), [SHAPES[0], SHAPES[1], SHAPES[3]])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool2d"])
def test_bfloat16_error_within_twice_plain_torch(backend, lead, H, Hkv, T, S, D, Dv, mask_kind):
    q, k, v = make_inputs(lead, H, Hkv, T, S, D, Dv, torch.bfloat16)
    kwargs, explicit = make_mask(mask_kind, lead, H, T, S, torch.bfloat16)
    exact = reference(q, k, v, explicit)
    # A plain same-dtype implementation: every step in bfloat16.
    G = H // Hkv
    kk, vv = k.repeat_interleave(G, -3), v.repeat_interleave(G, -3)
    scores = (q @ kk.transpose(-2, -1)) * (1 / math.sqrt(D))
    if explicit is not None:
        scores = scores.masked_fill(~explicit, float("-inf"))
    plain = torch.nan_to_num(torch.softmax(scores, -1)) @ vv
    out = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=G > 1, backend=backend, **kwargs)
    assert out.dtype == torch.bfloat16
    err, plain_err = max_error(out, exact), max_error(plain, exact)
    assert err <= 2 * plain_err + 1e-3, f"bfloat16 max error {err:.3e} > 2 x plain {plain_err:.3e}"


@pytest.mark.parametrize("backend", backend_names(auto=False))
@pytest.mark.parametrize("mask_kind", ["none", "bool2d", "float", "causal+bool"])
def test_gradcheck(backend, mask_kind):
    q, k, v = make_inputs((1,), 4, 2, 3, 5, 4, 3, torch.float64)
    kwargs, _ = make_mask(mask_kind, (1,), 4, 3, 5, torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend, **kwargs)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_rows_are_zero_with_zero_gradient(backend):
    q, k, v = make_inputs((2,), 2, 2, 4, 6, 8, 8, torch.float32)
    m = torch.ones(4, 6, dtype=torch.bool)
    m[1] = False
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, backend=backend)
    assert torch.isfinite(out).all()
    assert out[..., 1, :].abs().max() == 0, "a row with no visible key must be zero"
    out.sum().backward()
    assert q.grad[..., 1, :].abs().max() == 0, "a dead row must get zero gradient"
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("mask_kind", ["bool2d", "float", "bottom-right"])
def test_torch_backend_dead_rows_on_every_torch(monkeypatch, native, mask_kind):
    """torch >= 2.5 zeroes rows with no visible key itself; the fallback for older versions
    (open the rows, run, zero them) gives the same values and gradients."""
    from qkv.attention.backends import torch_kernel

    monkeypatch.setattr(torch_kernel, "NATIVE_DEAD_ROWS", native)
    lead, H, T, S = (2,), 2, 9, 5
    q, k, v = make_inputs(lead, H, H, T, S, 8, 8, torch.float64)
    kwargs, explicit = make_mask(mask_kind, lead, H, T, S, torch.float64)
    q1, q2 = q.clone().requires_grad_(), q.clone().requires_grad_()
    out = qkv.scaled_dot_product_attention(q1, k, v, backend="torch", **kwargs)
    ref = reference(q2, k, v, explicit)
    assert_close(out, ref, atol=1e-10, name=f"output native={native}")
    out.sum().backward()
    ref.sum().backward()
    assert_close(q1.grad, q2.grad, atol=1e-10, name=f"dq native={native}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_key_hidden_float_mask(backend):
    q, k, v = make_inputs((1,), 2, 2, 3, 5, 4, 4, torch.float64)
    m = torch.full((3, 5), float("-inf"), dtype=torch.float64)
    out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, backend=backend)
    assert out.abs().max() == 0


@pytest.mark.parametrize("backend", ["math", "auto"])  # torch and flash refuse: test_errors
@pytest.mark.parametrize(("T", "S"), [(0, 5), (4, 0), (0, 0)])
def test_empty_sequences(backend, T, S):
    q, k, v = make_inputs((2,), 2, 2, T, S, 4, 3, torch.float32)
    q.requires_grad_()
    out, w = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, backend=backend)
    assert out.shape == (2, 2, T, 3) and w.shape == (2, 2, T, S)
    assert out.abs().sum() == 0
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_scale_argument():
    q, k, v = make_inputs((1,), 2, 2, 5, 7, 8, 8, torch.float64)
    for backend in BACKENDS:
        out = qkv.scaled_dot_product_attention(q, k, v, scale=0.3, backend=backend)
        assert_close(out, reference(q, k, v, None, scale=0.3), atol=1e-10, name=f"scale[{backend}]")


def test_two_dimensional_inputs():
    q, k, v = make_inputs((), 1, 1, 5, 7, 8, 8, torch.float64)
    q, k, v = q[0], k[0], v[0]  # (T, D)
    out, w = qkv.scaled_dot_product_attention(q, k, v, need_weights=True)
    assert out.shape == (5, 8) and w.shape == (5, 7)
    assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-10, name="2-D output")


@pytest.mark.parametrize("backend", backend_names(auto=False))
def test_dropout(backend):
    q, k, v = make_inputs((2,), 2, 2, 16, 16, 8, 8, torch.float32)
    skip_if_refused(backend, q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    a = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)
    b = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)
    clean = qkv.scaled_dot_product_attention(q, k, v, backend=backend)
    assert not torch.equal(a, b), "dropout must be random"
    assert not torch.equal(a, clean)
    # In expectation dropout leaves the output unchanged (inverted dropout).
    torch.manual_seed(1)
    mean = torch.stack(
        [qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend) for _ in range(400)]
    ).mean(0)
    assert max_error(mean, clean) < 0.25, f"dropout mean error {max_error(mean, clean):.3f}"


def test_dropout_weights_are_the_applied_ones():
    q, k, v = make_inputs((1,), 2, 2, 6, 6, 8, 8, torch.float64)
    torch.manual_seed(0)
    out, w = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.3, need_weights=True)
    assert_close(out, w @ v, atol=1e-12, name="output = applied weights @ v")
    assert (w == 0).any(), "some weights must be dropped"


def test_gqa_does_not_copy_kv_in_torch_fold():
    """Without a mask, the torch backend folds query groups into T: K and V are used as is."""
    q, k, v = make_inputs((1,), 8, 2, 16, 16, 8, 8, torch.float32)
    out = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="torch")
    assert_close(out, reference(q, k, v, None), atol=1e-5, name="folded GQA")
