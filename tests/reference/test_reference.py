"""qkv.reference.attention (NumPy float64) against torch's SDPA and qkv's backends, both ways.

Forward and backward over a grid of shapes (head dim 59, 113x203, 1x1, T != S, GQA, several
leading dimensions, 2-D inputs) and every kind of mask, including rows with no visible key.
Each case compares the reference with torch's ``F.scaled_dot_product_attention`` and with
``qkv.scaled_dot_product_attention`` on its ``math`` and ``torch`` backends, all in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention as torch_sdpa

import qkv
from helpers import assert_close
from qkv.reference import attention, attention_backward

TOL = 1e-10

# (leading dims, or None for 2-D (T, D) inputs; H, Hkv, T, S, D, Dv, scale)
SHAPES = [
    pytest.param((2,), 2, 2, 5, 7, 59, 59, None, id="d59-T<S"),
    pytest.param((), 1, 1, 113, 203, 59, 17, None, id="113x203-d59"),
    pytest.param((1,), 1, 1, 1, 1, 1, 1, None, id="1x1"),
    pytest.param((2,), 6, 2, 9, 4, 8, 5, 0.37, id="gqa6-2-T>S-scale"),
    pytest.param((2, 3), 6, 3, 4, 9, 5, 3, None, id="gqa6-3-lead2x3"),
    pytest.param((2, 1, 3), 2, 1, 6, 6, 4, 4, None, id="lead3-gqa2-1"),
    pytest.param(None, 1, 1, 6, 5, 4, 3, None, id="2d"),
]

MASKS = [
    "none",
    "bool-2d",
    "bool-4d",
    "float-inf",
    "padding",
    "dead-bool",
    "dead-float",
    "dead-padding",
]


def make_inputs(lead, H, Hkv, T, S, D, Dv, seed=0):
    rng = np.random.default_rng(seed)
    if lead is None:  # 2-D inputs: no head dimension at all
        shapes = [(T, D), (S, D), (S, Dv), (T, Dv)]
    else:
        shapes = [(*lead, H, T, D), (*lead, Hkv, S, D), (*lead, Hkv, S, Dv), (*lead, H, T, Dv)]
    return [rng.standard_normal(s) for s in shapes]  # query, key, value, grad_out


def make_mask(kind, lead, H, T, S, seed=1):
    """A NumPy mask of ``kind`` for scores ``(*lead, H, T, S)`` (``(T, S)`` for 2-D inputs)."""
    rng = np.random.default_rng(seed)
    pad_shape = (1, S) if lead is None else (*lead, 1, 1, S)
    if kind == "none":
        return None
    if kind == "bool-2d":
        return rng.random((T, S)) < 0.7
    if kind == "bool-4d":  # one mask per batch element and head
        return rng.random((T, S) if lead is None else (*lead, H, T, S)) < 0.7
    if kind in ("float-inf", "dead-float"):
        m = rng.standard_normal((T, S))
        m[rng.random((T, S)) < 0.2] = -np.inf
        if kind == "dead-float":
            m[-1] = -np.inf  # the last query sees nothing
        return m
    if kind == "dead-bool":
        m = rng.random((T, S)) < 0.7
        m[0] = False  # the first query sees nothing
        return m
    lengths = rng.integers(1, S + 1, size=pad_shape[:-1])  # (*lead, 1, 1)
    if kind == "dead-padding":
        lengths.flat[0] = 0  # the first sequence is all padding: every one of its rows dies
    return np.arange(S) < lengths[..., None]  # (*lead, 1, 1, S)


def torch_mask(mask, is_causal, T, S):
    """torch refuses a mask together with is_causal: fold causality into the mask."""
    if mask is None or not is_causal:
        return None if mask is None else torch.from_numpy(mask)
    keep = np.tri(T, S, dtype=bool)  # (T, S)
    m = mask & keep if mask.dtype == bool else np.where(keep, mask, -np.inf)
    return torch.from_numpy(m)


def torch_grads(fn, q, k, v, g):
    """Run ``fn(q, k, v)`` under autograd; return its output and ``d(sum(out·g))/d(q, k, v)``."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = fn(tq, tk, tv)
    weights = None
    if isinstance(out, tuple):
        out, weights = out
    (out * torch.from_numpy(g)).sum().backward()
    return out, weights, (tq.grad, tk.grad, tv.grad)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("lead,H,Hkv,T,S,D,Dv,scale", SHAPES)
def test_against_torch_and_qkv(lead, H, Hkv, T, S, D, Dv, scale, kind, is_causal):
    q, k, v, g = make_inputs(lead, H, Hkv, T, S, D, Dv)
    mask = make_mask(kind, lead, H, T, S)
    out, weights = attention(q, k, v, mask, is_causal=is_causal, scale=scale)
    grads = attention_backward(q, k, v, g, mask, is_causal=is_causal, scale=scale)
    names = ("dq", "dk", "dv")

    # 1) torch's own function (causality folded into the mask when there is one).
    tm = torch_mask(mask, is_causal, T, S)
    t_out, _, t_grads = torch_grads(
        lambda a, b, c: torch_sdpa(
            a, b, c, attn_mask=tm, is_causal=is_causal and tm is None, scale=scale,
            enable_gqa=Hkv != H,
        ),
        q, k, v, g,
    )
    assert_close(out, t_out, atol=TOL, rtol=TOL, name="out vs torch F.sdpa")
    for name, mine, theirs in zip(names, grads, t_grads, strict=True):
        assert_close(mine, theirs, atol=TOL, rtol=TOL, name=f"{name} vs torch F.sdpa")

    # 2) qkv's math backend (weights too) and torch backend.
    qm = None if mask is None else torch.from_numpy(mask)
    for backend, need_weights in (("math", True), ("torch", False)):
        m_out, m_weights, m_grads = torch_grads(
            lambda a, b, c, backend=backend, need_weights=need_weights: (
                qkv.scaled_dot_product_attention(
                    a, b, c, qm, is_causal=is_causal, scale=scale, enable_gqa=Hkv != H,
                    need_weights=need_weights, backend=backend,
                )
            ),
            q, k, v, g,
        )
        assert_close(out, m_out, atol=TOL, rtol=TOL, name=f"out vs qkv {backend}")
        if need_weights:
            assert_close(weights, m_weights, atol=TOL, rtol=TOL, name=f"weights vs qkv {backend}")
        for name, mine, theirs in zip(names, grads, m_grads, strict=True):
            assert_close(mine, theirs, atol=TOL, rtol=TOL, name=f"{name} vs qkv {backend}")

    # 3) Shapes, and the dead-row contract: weights sum to 1 on live rows and 0 on dead ones.
    assert out.shape == (*q.shape[:-1], Dv) and weights.shape == (*q.shape[:-1], S)
    for grad, x in zip(grads, (q, k, v), strict=True):
        assert grad.shape == x.shape and grad.dtype == np.float64
    sums = weights.sum(axis=-1)
    assert np.all((np.abs(sums - 1) < 1e-12) | (sums == 0)), "weights rows neither 1 nor 0"
    if kind.startswith("dead"):
        dead = sums == 0
        assert dead.any(), "the dead-row mask produced no dead row"
        assert np.all(out[dead] == 0), "a dead row has a non-zero output"
        assert np.all(grads[0][dead] == 0), "a dead row has a non-zero query gradient"


def loss(q, k, v, g, **kw):
    return float(np.sum(attention(q, k, v, **kw)[0] * g))


def test_backward_against_finite_differences():
    """Central differences on a tiny GQA case with a float mask, causality and a dead row.

    Tolerance 1e-8 rather than 1e-10: central differences with step h = 1e-6 carry a
    truncation error ~h² and a rounding error ~eps/h ≈ 1e-10 times the loss (measured: 1.1e-9).
    """
    q, k, v, g = make_inputs((2,), 4, 2, 3, 4, 3, 2, seed=3)
    mask = np.random.default_rng(4).standard_normal((2, 1, 3, 4))  # (B, 1, T, S)
    mask[0, 0, 0, 0] = -np.inf  # with causality, query 0 of batch 0 sees nothing
    kw = dict(mask=mask, is_causal=True, scale=0.8)
    grads = attention_backward(q, k, v, g, **kw)
    h = 1e-6
    inputs = [q, k, v]
    for i, (name, x) in enumerate(zip(("dq", "dk", "dv"), inputs, strict=True)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            for sign in (1, -1):
                shifted = [a.copy() for a in inputs]
                shifted[i][idx] += sign * h
                numeric[idx] += sign * loss(*shifted, g, **kw) / (2 * h)
        assert_close(grads[i], numeric, atol=1e-8, rtol=1e-8, name=f"{name} vs finite diff")
    assert np.all(grads[0][0, :, 0] == 0), "the dead row got a query gradient"


def test_defaults_match_explicit_scale_and_float32_is_upcast():
    q, k, v, _ = make_inputs((2,), 3, 3, 4, 5, 7, 6)
    out, _ = attention(q, k, v)
    out2, _ = attention(q, k, v, scale=1 / math.sqrt(7))
    assert_close(out, out2, atol=0, name="default scale")
    out32, w32 = attention(*(x.astype(np.float32) for x in (q, k, v)))
    exact, _ = attention(*(x.astype(np.float32).astype(np.float64) for x in (q, k, v)))
    assert out32.dtype == np.float64 and w32.dtype == np.float64
    assert_close(out32, exact, atol=0, name="float32 computed in float64")


def test_causal_output_ignores_future_keys_and_key_order_does_not_matter():
    q, k, v, _ = make_inputs((2,), 2, 2, 6, 6, 5, 4)
    out, _ = attention(q, k, v, is_causal=True)
    k2, v2 = k.copy(), v.copy()
    k2[..., 4:, :] += 10.0  # change the keys and values of positions 4 and 5 only
    v2[..., 4:, :] -= 3.0
    out2, _ = attention(q, k2, v2, is_causal=True)
    assert_close(out2[..., :4, :], out[..., :4, :], atol=TOL, name="causal rows before 4")
    perm = np.random.default_rng(0).permutation(6)
    out3, _ = attention(q, k[..., perm, :], v[..., perm, :])
    out4, _ = attention(q, k, v)
    assert_close(out3, out4, atol=TOL, name="keys and values permuted together")


def test_gqa_equals_repeated_heads():
    q, k, v, g = make_inputs((2,), 6, 2, 5, 7, 4, 3)
    k_rep, v_rep = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)  # (B, H, S, D)
    assert_close(attention(q, k, v)[0], attention(q, k_rep, v_rep)[0], atol=0, name="gqa out")
    dq, dk, dv = attention_backward(q, k, v, g)
    dq_r, dk_r, dv_r = attention_backward(q, k_rep, v_rep, g)
    assert_close(dq, dq_r, atol=0, name="gqa dq")
    assert_close(dk, dk_r.reshape(2, 2, 3, 7, 4).sum(2), atol=TOL, name="gqa dk")
    assert_close(dv, dv_r.reshape(2, 2, 3, 7, 3).sum(2), atol=TOL, name="gqa dv")


@pytest.mark.parametrize("T,S", [(0, 4), (3, 0)])
def test_empty_lengths(T, S):
    q, k, v, g = make_inputs((2,), 2, 2, T, S, 3, 5)
    out, w = attention(q, k, v, is_causal=True)
    assert out.shape == (2, 2, T, 5) and w.shape == (2, 2, T, S)
    assert np.all(out == 0)
    m_out = qkv.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), is_causal=True, backend="math"
    )
    assert_close(out, m_out, atol=TOL, name="empty vs qkv math")
    dq, dk, dv = attention_backward(q, k, v, g)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not (dq.any() or dk.any() or dv.any())
