"""The flash backend under torch.func (vmap, grad, jacrev), and its dropout equal to torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vmap

import qkv
from helpers import assert_close


@pytest.fixture(autouse=True)
def tiny_flash_blocks(monkeypatch):
    """Small flash tiles, so that every shape here is cut into many partial and full tiles."""
    from qkv.attention import flash_blocks

    monkeypatch.setattr(
        flash_blocks, "BLOCKS", {"float32": (16, 32), "bfloat16": (16, 32), "float64": (8, 16)}
    )


def _inputs(N, H, Hkv, T, S, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(N, H, T, D, generator=g, dtype=dtype),
        torch.randn(N, Hkv, S, D, generator=g, dtype=dtype),
        torch.randn(N, Hkv, S, D + 1, generator=g, dtype=dtype),
    )


KWARGS = [
    pytest.param({}, id="plain"),
    pytest.param({"is_causal": True}, id="causal"),
    pytest.param({"is_causal": "bottom-right", "window": 5}, id="window"),
    pytest.param({"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}, id="alibi"),
    pytest.param({"attn_mask": torch.rand(19, 37, generator=torch.Generator().manual_seed(4)) > 0.3}, id="bool-mask"),
]


@pytest.mark.parametrize("kwargs", KWARGS)
def test_vmap_equals_a_loop(kwargs):
    q, k, v = _inputs(3, 4, 2, 19, 37, 6)

    def f(q, k, v):
        return qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="flash", **kwargs)

    out = vmap(f)(q, k, v)
    loop = torch.stack([f(q[i], k[i], v[i]) for i in range(3)])
    assert_close(out, loop, atol=1e-12, name="vmap vs loop")
    grads = vmap(grad(lambda q, k, v: f(q, k, v).square().sum(), argnums=(0, 1, 2)))(q, k, v)
    for i in range(3):
        qi, ki, vi = (t[i].clone().requires_grad_() for t in (q, k, v))
        f(qi, ki, vi).square().sum().backward()
        for name, a, b in zip("qkv", grads, (qi, ki, vi), strict=True):
            assert_close(a[i], b.grad, atol=1e-12, name=f"vmap(grad) d{name}[{i}]")


def test_vmap_with_weights_and_unbatched_keys():
    q, k, v = _inputs(3, 2, 2, 9, 11, 4)
    out, w = vmap(
        lambda q: qkv.scaled_dot_product_attention(q, k[0], v[0], need_weights=True, backend="flash")
    )(q)
    ref_out, ref_w = qkv.scaled_dot_product_attention(q, k[0], v[0], need_weights=True, backend="math")
    assert_close(out, ref_out, atol=1e-12, name="vmap output")
    assert_close(w, ref_w, atol=1e-12, name="vmap weights")


def test_jacrev_matches_math():
    q, k, v = (t[0, :, :5] for t in _inputs(1, 2, 2, 5, 7, 3))
    k, v = k[:, :4], v[:, :4]

    def f(backend):
        return lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)

    got = jacrev(f("flash"), argnums=(0, 1, 2))(q, k, v)
    want = jacrev(f("math"), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert_close(a, b, atol=1e-12, name=f"jacobian wrt {name}")


# (N, H, Hkv, T, S, D, kwargs): dropout against torch's own SDPA with the same seed.
DROPOUT = [
    pytest.param(2, 4, 4, 19, 37, 8, {}, id="plain"),
    pytest.param(2, 4, 2, 19, 37, 8, {"enable_gqa": True}, id="gqa"),
    pytest.param(1, 3, 3, 40, 40, 5, {"is_causal": True}, id="causal"),
    pytest.param(2, 2, 2, 19, 37, 8, {"attn_mask": torch.randn(19, 37, dtype=torch.float64)}, id="float-mask"),
    pytest.param(2, 2, 2, 5, 300, 8, {}, id="decode-shape"),
]


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize(("N", "H", "Hkv", "T", "S", "D", "kwargs"), DROPOUT)
def test_flash_dropout_equals_torch(N, H, Hkv, T, S, D, kwargs, p):
    """Same seed, same dropped positions: outputs and gradients equal torch's (float64)."""
    q, k, v = (t.requires_grad_() for t in _inputs(N, H, Hkv, T, S, D))
    g = torch.randn(N, H, T, D + 1, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    results = []
    for fn in (F.scaled_dot_product_attention, qkv.scaled_dot_product_attention):
        extra = {"backend": "flash"} if fn is qkv.scaled_dot_product_attention else {}
        torch.manual_seed(1234)
        out = fn(q, k, v, dropout_p=p, **kwargs, **extra)
        results.append((out, torch.autograd.grad(out, (q, k, v), g)))
    (ref, ref_grads), (out, grads) = results
    assert_close(out, ref, atol=1e-10, name=f"flash dropout p={p} output")
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert_close(a, b, atol=1e-10, name=f"flash dropout p={p} d{name}")


def test_flash_dropout_equals_math_backend_in_float32():
    q, k, v = _inputs(2, 4, 2, 33, 65, 16, dtype=torch.float32)
    outs = []
    for backend in ("flash", "math", "auto"):
        torch.manual_seed(5)
        outs.append(qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True, backend=backend))
    assert_close(outs[0], outs[1], atol=1e-5, name="flash vs math dropout (float32)")
    assert_close(outs[0], outs[2], atol=1e-5, name="flash vs auto dropout (float32)")
