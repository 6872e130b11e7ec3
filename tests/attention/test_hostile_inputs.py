"""Hostile inputs on every backend: NaN and inf in query, key or value, and ALiBi slopes that
are not finite numbers.

The behaviour for non-finite inputs is the one documented in
:func:`qkv.scaled_dot_product_attention`; references are ``qkv.reference`` (NumPy float64) on
the clean inputs, with every mask part written out from its definition (``hostile_cases``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hostile_cases import BACKENDS, mask_case, ref_attention, run

import qkv
from helpers import assert_close
from qkv import reference
from qkv.attention import rows
from qkv.attention.weights import attention_weights
from qkv.nn.alibi import ALiBi, alibi_bias


@pytest.fixture(autouse=True)
def tiny_flash_tiles(monkeypatch):
    """Flash tiles of 2×3 even for a few queries, so tile edges cut through every case."""
    from qkv.attention import flash_blocks

    blocks = {"float32": (2, 3), "bfloat16": (2, 3), "float64": (2, 3)}
    monkeypatch.setattr(flash_blocks, "BLOCKS", blocks)
    monkeypatch.setattr(flash_blocks, "DECODE_ROWS", 0)


# --- 5. ALiBi slopes that slip through ------------------------------------------------------


def small(H=2, T=4, S=5, D=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, H, T, D, generator=g), torch.randn(1, H, S, D, generator=g),
            torch.randn(1, H, S, D, generator=g))


def _entries():
    """Every public way slopes enter attention, as ``f(q, k, v, slopes)``."""
    from qkv.nn.hooks import AttentionInputs

    return {
        "sdpa": lambda q, k, v, s: qkv.scaled_dot_product_attention(q, k, v, alibi_slopes=s),
        "explain": lambda q, k, v, s: qkv.explain(q, k, v, alibi_slopes=s),
        "weights": lambda q, k, v, s: attention_weights(
            q, k, torch.zeros(1, 2, q.shape[2]), alibi_slopes=s
        ),
        "inputs": lambda q, k, v, s: AttentionInputs(q, k, v, alibi_slopes=s).checked(),
    }


@pytest.mark.parametrize("entry", ["sdpa", "explain", "weights", "inputs"])
@pytest.mark.parametrize(
    ("slopes", "match"),
    [
        (torch.tensor([float("nan"), 0.5]), r"alibi_slopes must be finite .*\[nan\] at head\(s\) \[0\]"),
        (torch.tensor([0.5, float("inf")]), r"alibi_slopes must be finite .*\[inf\] at head\(s\) \[1\]"),
        (torch.tensor([-math.inf, math.nan]), r"alibi_slopes must be finite .*head\(s\) \[0, 1\]"),
        (torch.tensor([1e39, 0.5], dtype=torch.float64), r"finite \(after conversion to float32\)"),
        (torch.tensor([0.5, 1e38]), r"alibi_slopes must be at most 8\.5\de\+37 .*head\(s\) \[1\]"),
    ],
    ids=["nan", "inf", "both", "float64-overflow", "bias-overflow"],
)
def test_bad_slopes_are_refused_at_every_entry(entry, slopes, match):
    q, k, v = small()
    with pytest.raises(ValueError, match=match):
        _entries()[entry](q, k, v, slopes)


@pytest.mark.parametrize(
    ("slopes", "error", "match"),
    [
        ([0.5, 0.25], TypeError, r"alibi_slopes must be a float tensor .* got list"),
        (torch.tensor([1, 2]), TypeError, r"alibi_slopes must be a float tensor .* got dtype torch\.int64"),
        (torch.ones(3), ValueError, r"alibi_slopes must have shape \(H,\) = \(2,\), got \(3,\)"),
    ],
)
def test_slopes_of_the_wrong_kind_are_named(slopes, error, match):
    q, k, v = small()
    with pytest.raises(error, match=match):
        qkv.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes)


def test_large_finite_slopes_within_float32_still_work():
    q, k, v = small()
    slopes = torch.tensor([1e30, 0.5])
    out = qkv.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, backend="math")
    _, add, _ = mask_case("none", 2, 4, 5)
    i, j = np.arange(4)[:, None], np.arange(5)[None, :]
    add = add - np.asarray([1e30, 0.5])[None, :, None, None] * np.abs(i + 1 - j)
    ref, _ = ref_attention(q, k, v, add.astype(np.float32).astype(np.float64))
    assert_close(out, ref, atol=1e-5, name="ALiBi with a slope of 1e30")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_alibi_bias_refuses_a_dtype_it_would_overflow(dtype):
    """float16 holds 65504: 8 heads (largest slope 1/2) overflow past ~131 000 positions."""
    T, S = 1, 140_000
    if dtype == torch.float16:
        with pytest.raises(ValueError, match=r"reaches 7e\+04 .* torch\.float16's largest"):
            alibi_bias(8, T, S, dtype=dtype)
        with pytest.raises(ValueError, match=r"torch\.float16's largest"):
            ALiBi(8).bias(T, S, dtype=dtype)
        assert torch.isfinite(alibi_bias(8, 1, 130_000, dtype=dtype)).all()
    else:
        bias = alibi_bias(8, T, S, dtype=dtype)
        assert torch.isfinite(bias).all()
        expected = -0.5 * torch.arange(S - 1, -1, -1, dtype=torch.float64)
        assert_close(bias[0, 0], expected, atol=float(expected.abs().max()) * torch.finfo(dtype).eps,
                     name=f"alibi_bias {dtype}")


def test_alibi_bias_refuses_a_non_float_dtype():
    with pytest.raises(ValueError, match=r"dtype must be a floating-point torch\.dtype, got torch\.int64"):
        alibi_bias(2, 3, 3, dtype=torch.int64)


# --- 6. non-finite inputs: one behaviour on every backend -----------------------------------

B, T, S, D = 2, 7, 6, 5
Q_BAD = (1, 1, 3, 2)  # batch, query head, query row, component
KV_BAD = (1, 0, 2, 2)  # batch, key/value head, key row, component
KINDS = ["none", "causal", "bottom-right", "window", "alibi", "bool", "float"]


def nonfinite_inputs(H, Hkv, what, value, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    clean = (q.clone(), k.clone(), v.clone())
    if what == "q":
        q[Q_BAD] = value
    else:
        (k if what == "k" else v)[KV_BAD] = value
    return (q, k, v), clean


def _row_exact_or_nonfinite(row, ref_row):
    return (not np.isfinite(row).all()) or np.abs(row - ref_row).max() <= 1e-10


def expected_rows(what, value, q, H, Hkv, visible):
    """For each row (b, h, i): "nan" (all NaN), "nonfinite" (some entry not finite),
    "hidden" (exact, with the bad key hidden), "exact" or "either" (exact or non-finite)."""
    G = H // Hkv
    plan = np.full((B, H, T), "exact", dtype=object)
    if what == "q":
        plan[Q_BAD[:3]] = "nan"
        return plan
    b, g, j, d = KV_BAD
    for h in range(g * G, (g + 1) * G):
        for i in range(T):
            if not visible[i, j]:
                plan[b, h, i] = "either"
            elif what == "v":
                plan[b, h, i] = "nonfinite"
            elif math.isnan(value) or float(q[b, h, i, d]) * value > 0:
                plan[b, h, i] = "nan"  # NaN or +inf score
            else:
                plan[b, h, i] = "hidden"  # -inf score: weight 0, as if masked
    return plan


def check_rows(name, got, plan, ref, ref_hidden, *, weights=False):
    got = got.detach().double().numpy()
    for idx in np.ndindex(*plan.shape):
        row, kind = got[idx], plan[idx]
        if kind == "nan":
            assert np.isnan(row).all(), f"{name} row {idx}: expected all NaN, got {row}"
        elif kind == "nonfinite" and not weights:
            assert not np.isfinite(row).all(), f"{name} row {idx}: expected non-finite, got {row}"
        elif kind == "either":
            assert _row_exact_or_nonfinite(row, ref[idx]), f"{name} row {idx}: {row} vs {ref[idx]}"
        else:  # exact; "hidden" against the reference without the key; weights ignore values
            expected = ref_hidden[idx] if kind == "hidden" else ref[idx]
            assert_close(row, expected, atol=1e-10, name=f"{name} row {idx} ({kind})")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("what", ["q", "k", "v"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_input_reaches_exactly_the_documented_rows(backend, what, value, kind):
    H = Hkv = 2
    (q, k, v), clean = nonfinite_inputs(H, Hkv, what, value)
    kw, add, visible = mask_case(kind, H, T, S)
    ref, ref_w = ref_attention(*clean, add)
    hidden = add.repeat(B, 0)
    hidden[KV_BAD[0], KV_BAD[1], :, KV_BAD[2]] = -np.inf  # the bad key masked for its head
    ref_hidden, ref_hidden_w = ref_attention(*clean, hidden)
    out, w = run(backend, q, k, v, kw, need_weights=True)
    plan = expected_rows(what, value, q, H, Hkv, visible)
    name = f"{backend} {what}={value} {kind}"
    check_rows(f"{name} output", out, plan, ref, ref_hidden)
    # Weights never read the values; otherwise they follow the output's rows.
    w_plan = np.full_like(plan, "exact") if what == "v" else plan
    check_rows(f"{name} weights", w, w_plan, ref_w, ref_hidden_w, weights=True)


@pytest.mark.parametrize("kind", ["none", "causal", "bool"])
@pytest.mark.parametrize("what", ["q", "k", "v"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_input_with_grouped_heads(backend, what, kind):
    """Grouped-query heads (torch folds a group into the query length without a mask): the
    bad key poisons only its group's query heads."""
    H, Hkv = 4, 2
    (q, k, v), clean = nonfinite_inputs(H, Hkv, what, math.nan)
    kw, add, visible = mask_case(kind, H, T, S)
    ref, _ = ref_attention(*clean, add)
    out, _ = run(backend, q, k, v, kw, need_weights=False)
    plan = expected_rows(what, math.nan, q, H, Hkv, visible)
    check_rows(f"{backend} {what} {kind} GQA output", out, plan, ref, ref)


@pytest.fixture(params=["cpu-rule", "cuda-rule"])
def nan_row_rule(request, monkeypatch):
    """The NaN-row rule as the CPU computes it, and as CUDA does (one reduction kernel,
    ``torch.linalg.vector_norm(ord=inf)``), forced here on CPU tensors."""
    if request.param == "cuda-rule":
        one = rows.row_abs_max
        monkeypatch.setattr(rows, "row_abs_max", lambda q, one_kernel: one(q, True))
    return request.param


@pytest.mark.parametrize("one_kernel", [False, True], ids=["cpu-rule", "cuda-rule"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_row_abs_max_propagates_nan_by_either_rule(dtype, one_kernel):
    big = torch.finfo(dtype).max
    q = torch.tensor([[math.nan, 1.0, 2.0], [math.inf, -1.0, 0.0], [-math.inf, 0.0, 0.0],
                      [1.0, -3.0, 2.0], [-0.0, 0.0, -0.0], [big, -big, 1.0],
                      [1.0, math.nan, math.inf]], dtype=dtype)  # fmt: skip
    got = rows.row_abs_max(q[None, None], one_kernel)  # (1, 1, 7, 1)
    want = np.max(np.abs(q.double().numpy()), axis=-1, keepdims=True)  # NaN propagates
    assert got.shape == (1, 1, 7, 1) and got.dtype == dtype
    np.testing.assert_array_equal(got[0, 0].double().numpy(), want, err_msg=f"{dtype}")


@pytest.mark.parametrize("kind", ["bottom-right", "bool", "float"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_query_in_a_row_that_sees_no_key_is_nan(backend, kind, nan_row_rule):
    """A dead row (zero output for finite inputs) still reports its NaN query."""
    (q, k, v), _ = nonfinite_inputs(2, 2, "q", 0.0)
    dead_row = 0 if kind == "bottom-right" else 5
    q[1, 1, dead_row, 0] = math.nan
    kw, _, _ = mask_case(kind, 2, T, S)
    out, w = run(backend, q, k, v, kw, need_weights=True)
    assert torch.isnan(out[1, 1, dead_row]).all() and torch.isnan(w[1, 1, dead_row]).all()
    finite = torch.ones(B, 2, T, dtype=torch.bool)
    finite[1, 1, dead_row] = False
    assert torch.isfinite(out[finite]).all() and torch.isfinite(w[finite]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_query_whose_scores_are_all_minus_inf_is_nan(backend, nan_row_rule):
    """``q = +inf`` along a dimension where every key is negative: every score is -inf, the
    softmax alone would call the row dead and give zeros."""
    (q, k, v), _ = nonfinite_inputs(2, 2, "q", 0.0)
    k[:, :, :, 0] = -k[:, :, :, 0].abs() - 0.1
    q[1, 1, 3] = torch.tensor([math.inf, 0.0, 0.0, 0.0, 0.0])
    out, w = run(backend, q, k, v, {}, need_weights=True)
    assert torch.isnan(out[1, 1, 3]).all() and torch.isnan(w[1, 1, 3]).all()


def _ref_grads(clean, add):
    dq, dk, dv = reference.attention_backward(
        *(t.numpy() for t in clean), np.ones((B, clean[0].shape[1], T, D)), mask=add
    )
    return dq, dk, dv


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "alibi"])
@pytest.mark.parametrize("what", ["q", "k", "v"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_through_a_nonfinite_input(backend, what, kind):
    """Gradients of other batch entries and key/value heads are exact; a NaN query row that
    sees keys gets a NaN gradient, and so do the keys and values it sees."""
    H, Hkv = 4, 2
    (q, k, v), clean = nonfinite_inputs(H, Hkv, what, math.nan)
    kw, add, visible = mask_case(kind, H, T, S)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, _ = run(backend, q, k, v, kw, need_weights=False)
    out.backward(torch.ones_like(out))
    ref_dq, ref_dk, ref_dv = _ref_grads(clean, add)
    name = f"{backend} {what} {kind}"
    # Batch 0 is untouched; in batch 1 the other key/value head (and its query heads) too.
    assert_close(q.grad[0], ref_dq[0], atol=1e-9, name=f"{name} dq batch 0")
    assert_close(k.grad[0], ref_dk[0], atol=1e-9, name=f"{name} dk batch 0")
    assert_close(v.grad[0], ref_dv[0], atol=1e-9, name=f"{name} dv batch 0")
    bad_group = Q_BAD[1] // (H // Hkv) if what == "q" else KV_BAD[1]
    other = 1 - bad_group
    G = H // Hkv
    heads = slice(other * G, (other + 1) * G)
    assert_close(q.grad[1, heads], ref_dq[1, heads], atol=1e-9, name=f"{name} dq other group")
    assert_close(k.grad[1, other], ref_dk[1, other], atol=1e-9, name=f"{name} dk other group")
    assert_close(v.grad[1, other], ref_dv[1, other], atol=1e-9, name=f"{name} dv other group")
    if what == "q":
        b, h, i, _ = Q_BAD
        seen = torch.from_numpy(visible[i])
        assert torch.isnan(q.grad[b, h, i]).all(), f"{name}: dq of the NaN row {q.grad[b, h, i]}"
        assert torch.isnan(k.grad[b, bad_group, seen]).all(), f"{name}: dk of the keys it sees"
        assert torch.isnan(v.grad[b, bad_group, seen]).all(), f"{name}: dv of the keys it sees"
