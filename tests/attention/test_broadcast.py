"""Inputs of different ranks and size-1 dimensions broadcast exactly as in torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from helpers import assert_close, backend_names

BACKENDS = backend_names()  # "auto" and every registered backend

# (query shape, key shape, value shape, enable_gqa)
CASES = [
    pytest.param((4, 3, 8), (4, 4, 6, 8), (4, 4, 6, 8), False, id="q3d-k4d"),
    pytest.param((3, 8), (2, 4, 6, 8), (1, 4, 6, 8), False, id="q2d-k4d-v-batch1"),
    pytest.param((2, 4, 3, 8), (6, 8), (6, 8), False, id="k2d-shared"),
    pytest.param((2, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 8), False, id="kv-batch1"),
    pytest.param((2, 3, 4, 8), (2, 1, 6, 8), (2, 1, 6, 5), False, id="kv-heads1-dv5"),
    pytest.param((2, 1, 4, 8), (2, 3, 6, 8), (2, 3, 6, 8), False, id="q-heads1"),
    pytest.param((2, 3, 4, 8), (2, 1, 6, 8), (2, 3, 6, 8), False, id="k-heads1-v-heads3"),
    pytest.param((2, 1, 2, 4, 8), (2, 3, 2, 6, 8), (2, 3, 2, 6, 8), False, id="5d-middle"),
    pytest.param((4, 4, 8), (2, 2, 6, 8), (2, 2, 6, 8), True, id="gqa-q3d"),
    pytest.param((2, 4, 4, 8), (2, 6, 8), (2, 6, 8), True, id="gqa-k3d"),
    pytest.param((2, 4, 4, 8), (2, 2, 6, 8), (2, 1, 6, 8), True, id="gqa-v-heads1"),
    pytest.param((2, 8, 4, 8), (2, 2, 6, 8), (2, 4, 6, 8), True, id="gqa-k2-v4"),
    pytest.param((2, 6, 4, 8), (1, 3, 6, 8), (1, 3, 6, 8), True, id="gqa-batch1"),
]

MASKS = ["none", "bool-TS", "float-batch", "causal"]


def _mask(kind: str, out_shape: tuple[int, ...], T: int, S: int):
    g = torch.Generator().manual_seed(2)
    if kind == "none":
        return {}
    if kind == "bool-TS":
        m = torch.rand(T, S, generator=g) > 0.4
        m[:, 0] = True  # every row sees a key: torch and qkv then agree everywhere
        return {"attn_mask": m}
    if kind == "float-batch":
        lead = out_shape[:-3]
        return {"attn_mask": torch.randn(*lead, 1, T, S, generator=g, dtype=torch.float64)}
    return {"is_causal": True}


def _inputs(qs, ks, vs):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in (qs, ks, vs)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize(("qs", "ks", "vs", "gqa"), CASES)
def test_broadcast_matches_torch(qs, ks, vs, gqa, mask, backend):
    q, k, v = _inputs(qs, ks, vs)
    T, S = qs[-2], ks[-2]
    expected_shape = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).shape
    kwargs = _mask(mask, tuple(expected_shape), T, S)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kwargs)
    out = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, backend=backend, **kwargs)
    what = f"q{qs} k{ks} v{vs} {mask} [{backend}]"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != torch {tuple(ref.shape)}"
    assert_close(out, ref, atol=1e-10, name=f"output {what}")
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close(a, b, atol=1e-10, name=f"{name} {what}")


@pytest.mark.parametrize(("qs", "ks", "vs", "gqa"), CASES)
def test_broadcast_weights(qs, ks, vs, gqa):
    """need_weights returns (..., H, T, S) in the broadcast layout, equal to the softmax."""
    q, k, v = (t.detach() for t in _inputs(qs, ks, vs))
    out, w = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, need_weights=True)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    assert w.shape == (*ref.shape[:-1], ks[-2]), f"weights shape {tuple(w.shape)}"
    assert_close(out, ref, atol=1e-10, name=f"output with weights q{qs} k{ks}")
    assert_close(w.sum(-1), torch.ones(w.shape[:-1], dtype=w.dtype), atol=1e-12, name="row sums")


def test_shared_key_heads_are_not_copied():
    """Key/value with one head broadcast over the query heads as a group (Hkv = 1)."""
    from qkv.attention.call import make_call

    q, k, v = (t.detach() for t in _inputs((2, 4, 3, 8), (2, 1, 6, 8), (2, 1, 6, 8)))
    call = make_call(q, k, v, None, 0.0, False, None, False, False)
    assert call.num_kv_heads == 1 and call.groups == 4
    assert call.key.data_ptr() == k.data_ptr(), "the key must be used in place"
