"""need_weights on the torch backend: torch's CPU flash kernel's lse, weights rebuilt exactly."""

from __future__ import annotations

import pytest
import torch

import qkv
from helpers import assert_close

MASKS = {
    "none": {},
    "causal": {"is_causal": True},
    "bottom-right+window": {"is_causal": "bottom-right", "window": 7},
    "bool": {"attn_mask": torch.rand(1, 1, 33, 33, generator=torch.Generator().manual_seed(1)) > 0.3},
    "dead-row": {"attn_mask": torch.ones(33, 33, dtype=torch.bool).index_fill(0, torch.tensor([4]), False)},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125])},
}


def _inputs(T, S, dtype, H=3, Hkv=3, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, L, D, generator=g, dtype=torch.float64).to(dtype)
            for h, L in ((H, T), (Hkv, S), (Hkv, S))]


@pytest.mark.parametrize("T", [33])
@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_weights_and_gradients_equal_math(kind, dtype, tol, T):
    q, k, v = (t.requires_grad_() for t in _inputs(T, T, dtype))
    kw = MASKS[kind]
    assert qkv.explain(q, k, v, need_weights=True, **kw).chosen in ("torch", "flash")
    got = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, backend="torch", **kw)
    want = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, backend="math", **kw)
    for name, a, b in zip(("output", "weights"), got, want, strict=True):
        assert_close(a, b, atol=tol, name=f"{name} [{kind}, {dtype}]")
    # Both outputs are differentiable, as on the math path: the lse's gradient is restored.
    g = [torch.randn(t.shape, generator=torch.Generator().manual_seed(3), dtype=dtype) for t in want]
    d_got = torch.autograd.grad(got, (q, k, v), g)
    d_want = torch.autograd.grad(want, (q, k, v), g)
    for name, a, b in zip("qkv", d_got, d_want, strict=True):
        assert_close(a, b, atol=10 * tol, name=f"d{name} [{kind}, {dtype}]")


def test_gradcheck_through_rebuilt_weights():
    q, k, v = (t[:, :, :5].clone().requires_grad_() for t in _inputs(6, 6, torch.float64, D=4))

    def f(q, k, v):
        return qkv.scaled_dot_product_attention(q, k, v, need_weights=True, backend="torch", is_causal=True)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_folded_gqa_without_mask():
    q, k, v = _inputs(9, 12, torch.float64, H=6, Hkv=2)
    got = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, enable_gqa=True, backend="torch")
    want = qkv.scaled_dot_product_attention(q, k, v, need_weights=True, enable_gqa=True, backend="math")
    for name, a, b in zip(("output", "weights"), got, want, strict=True):
        assert_close(a, b, atol=1e-10, name=f"GQA {name}")
