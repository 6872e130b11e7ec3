"""Invariances of attention, checked by hypothesis over random shapes and masks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from helpers import assert_close, backend_names

settings.register_profile("qkv", max_examples=40, deadline=None)
settings.load_profile("qkv")

dims = st.fixed_dictionaries(
    {
        "B": st.integers(1, 2),
        "Hkv": st.integers(1, 2),
        "G": st.integers(1, 3),
        "T": st.integers(1, 9),
        "S": st.integers(1, 11),
        "D": st.integers(1, 12),
        "seed": st.integers(0, 2**16),
        "backend": st.sampled_from(backend_names()),
        "density": st.floats(0.0, 1.0),
    }
)


def build(d, dtype=torch.float64):
    g = torch.Generator().manual_seed(d["seed"])
    H = d["Hkv"] * d["G"]
    q = torch.randn(d["B"], H, d["T"], d["D"], generator=g, dtype=dtype)
    k = torch.randn(d["B"], d["Hkv"], d["S"], d["D"], generator=g, dtype=dtype)
    v = torch.randn(d["B"], d["Hkv"], d["S"], d["D"], generator=g, dtype=dtype)
    mask = torch.rand(d["B"], 1, d["T"], d["S"], generator=g) < d["density"]
    return q, k, v, mask


@given(dims)
def test_weight_rows_sum_to_one_or_zero(d):
    q, k, v, mask = build(d)
    _, w = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, need_weights=True)
    sums = w.sum(-1)
    visible = mask.any(-1).expand_as(sums)
    assert_close(sums, visible.double(), atol=1e-12, name="row sums (1 if any key visible else 0)")
    assert (w[~mask.expand_as(w)] == 0).all(), "hidden keys must get weight exactly 0"


@given(dims)
def test_permuting_keys_and_values_together(d):
    q, k, v, mask = build(d)
    perm = torch.randperm(d["S"], generator=torch.Generator().manual_seed(d["seed"] + 1))
    a = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, backend=d["backend"])
    b = qkv.scaled_dot_product_attention(
        q, k[..., perm, :], v[..., perm, :], attn_mask=mask[..., perm], enable_gqa=True, backend=d["backend"]
    )
    assert_close(a, b, atol=1e-10, name="output under a key permutation")


@given(dims)
def test_masked_keys_do_not_matter(d):
    q, k, v, mask = build(d)
    hidden = ~mask.any(dim=(0, 1, 2))  # keys hidden from every query of every batch element
    k2, v2 = k.clone(), v.clone()
    k2[..., hidden, :] = 1e3 * torch.randn_like(k2[..., hidden, :])
    v2[..., hidden, :] = torch.nan_to_num(torch.full_like(v2[..., hidden, :], 7.0))
    a = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, backend=d["backend"])
    b = qkv.scaled_dot_product_attention(q, k2, v2, attn_mask=mask, enable_gqa=True, backend=d["backend"])
    assert_close(a, b, atol=1e-10, name="output after changing masked-out keys and values")


@given(dims)
def test_causal_future_does_not_leak(d):
    q, k, v, _ = build(d)
    t = d["T"] // 2
    k2, v2 = k.clone(), v.clone()
    k2[..., t + 1 :, :] += 5.0
    v2[..., t + 1 :, :] -= 3.0
    a = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend=d["backend"])
    b = qkv.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True, backend=d["backend"])
    # Top-left causal: query i sees keys j <= i, so rows 0..t never see the changed keys.
    assert_close(a[..., : t + 1, :], b[..., : t + 1, :], atol=1e-10, name="causal rows up to t")


@given(dims)
def test_batched_equals_per_example(d):
    q, k, v, mask = build(d)
    full = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, backend=d["backend"])
    for b in range(d["B"]):
        one = qkv.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], attn_mask=mask[b : b + 1], enable_gqa=True, backend=d["backend"]
        )
        assert_close(full[b : b + 1], one, atol=1e-10, name=f"batch element {b}")
