"""Flash-decoding (few queries, key blocks and splits merged by log-sum-exp) against the math
backend: forward, lse and backward, over masks, GQA, splits, dtypes and dead rows."""

from __future__ import annotations

import pytest
import torch

import qkv
from helpers import assert_close
from qkv.attention.backends import flash
from qkv.attention.call import make_call
from qkv.attention.flash_decode import MAX_SPLITS, MIN_SPLIT_KEYS, splits


@pytest.fixture
def threads():
    """Run a test with 4 threads (so one key head gets split), then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


def inputs(B, H, Hkv, T, S, D=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)  # (B, H, T, D)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)  # (B, Hkv, S, D)
    v = torch.randn(B, Hkv, S, D + 3, generator=g, dtype=dtype)  # (B, Hkv, S, Dv)
    return q, k, v


def padding_mask(B, S, seed=1):
    """Bool keep mask (B, 1, 1, S) with a different number of padded keys per sequence."""
    lengths = torch.randint(1, S + 1, (B,), generator=torch.Generator().manual_seed(seed))
    return (torch.arange(S) < lengths[:, None])[:, None, None, :]


def both(q, k, v, block_k=None, **kw):
    """(flash out, flash lse, math out, math lse) for one call, decode path forced."""
    call = make_call(q, k, v, kw.get("attn_mask"), 0.0, kw.get("is_causal", False), None,
                     q.shape[1] != k.shape[1], False, kw.get("window"),
                     kw.get("alibi_slopes"), need_lse=True)
    out, lse = flash.attend(call, block_k=block_k)
    out = flash.poison_rows(out, q)
    ref, ref_lse = qkv.scaled_dot_product_attention(
        q, k, v, backend="math", return_lse=True, enable_gqa=q.shape[1] != k.shape[1], **kw
    )
    return out, lse, ref, ref_lse


SHAPES = [  # B, H, Hkv, T, S
    (1, 4, 4, 1, 1),
    (2, 4, 4, 1, 7),
    (1, 6, 2, 3, 600),
    (1, 8, 1, 1, 5000),
    (3, 4, 2, 16, 1500),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block_k", [None, 700])
@pytest.mark.parametrize("case", ["plain", "padding", "float", "causal", "window", "alibi"])
def test_decode_matches_math(shape, block_k, case, threads):
    B, H, Hkv, T, S = shape
    q, k, v = inputs(B, H, Hkv, T, S)
    kw = {
        "plain": {},
        "padding": {"attn_mask": padding_mask(B, S)},
        "float": {"attn_mask": torch.randn(B, 1, T, S, dtype=torch.float64)},
        "causal": {"is_causal": "bottom-right"},
        "window": {"is_causal": "bottom-right", "window": max(1, S // 3)},
        "alibi": {"is_causal": "bottom-right", "alibi_slopes": torch.rand(H) + 0.01},
    }[case]
    out, lse, ref, ref_lse = both(q, k, v, block_k=block_k, **kw)
    assert_close(out, ref, atol=1e-10, rtol=1e-10, name=f"{case} {shape} out")
    assert_close(lse, ref_lse.to(lse.dtype), atol=1e-10, rtol=1e-10, name=f"{case} {shape} lse")


def test_split_path_is_taken_and_exact(threads, monkeypatch):
    """One key head, 4 threads, all keys in one block: 3 splits of 667 keys and a tail of 1."""
    from qkv.attention import flash_decode

    assert splits(1, 2002) == 2002 // MIN_SPLIT_KEYS
    seen = []
    real = flash_decode._partial

    def spy(call, qs, k, v, j0, j1, n, plan, acc):
        seen.append((j0, j1, n))
        return real(call, qs, k, v, j0, j1, n, plan, acc)

    monkeypatch.setattr(flash_decode, "_partial", spy)
    q, k, v = inputs(1, 2, 1, 1, 2002)
    out, lse, ref, ref_lse = both(q, k, v, is_causal="bottom-right")
    assert seen == [(0, 2001, 3), (2001, 2002, 1)], seen
    assert_close(out, ref, atol=1e-10, rtol=1e-10, name="split out")
    assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10, name="split lse")
    seen.clear()
    # Keys that are a slice of a longer cache buffer are never split (matmul would copy K):
    # they are walked in blocks, each one matmul.
    kb, vb = (torch.cat([t, t], dim=2)[:, :, :2002] for t in (k, v))
    out, _, ref, _ = both(q, kb, vb, block_k=700)
    assert seen and all(n == 1 for _, _, n in seen), seen
    assert_close(out, ref, atol=1e-10, rtol=1e-10, name="cache-slice out")


def test_splits_policy():
    assert splits(8, 100_000, threads=2) == 1  # four pairs a thread already
    assert splits(1, 100_000, threads=2) == 4
    assert splits(1, 100_000, threads=64) == MAX_SPLITS
    assert splits(1, 600, threads=8) == 1  # too few keys to split
    assert splits(3, 4096, threads=4) == 3


def test_dead_rows_give_zero_output_and_minus_inf_lse(threads):
    q, k, v = inputs(2, 4, 2, 2, 900)
    mask = torch.ones(2, 1, 2, 900, dtype=torch.bool)
    mask[1, :, 0] = False  # query 0 of sequence 1 sees nothing
    out, lse, ref, _ = both(q, k, v, block_k=300, attn_mask=mask)
    assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))
    assert torch.isneginf(lse[1, :, 0]).all()
    assert_close(out, ref, atol=1e-10, rtol=1e-10, name="dead rows")


def test_nan_query_row_is_nan_and_other_rows_exact():
    q, k, v = inputs(1, 4, 4, 2, 300)
    q[0, 1, 0, 3] = float("nan")
    out = qkv.scaled_dot_product_attention(q, k, v, backend="flash")
    ref = qkv.scaled_dot_product_attention(q, k, v, backend="math")
    assert torch.isnan(out[0, 1, 0]).all()
    good = ~torch.isnan(ref)
    assert torch.equal(torch.isnan(out), ~good)
    assert_close(out[good], ref[good], atol=1e-10, rtol=1e-10, name="finite rows")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_half_and_single_precision_inference(dtype, tol, threads):
    q, k, v = inputs(1, 8, 2, 1, 3000, dtype=dtype)
    with torch.no_grad():  # the lse-free inference path
        out = qkv.scaled_dot_product_attention(q, k, v, backend="flash", enable_gqa=True)
    ref = qkv.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), backend="math", enable_gqa=True
    )
    assert out.dtype == dtype
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"{dtype}: max error {err:.3g} > {tol}"


@pytest.mark.parametrize("case", ["plain", "padding", "alibi"])
def test_backward_through_the_decode_forward(case, threads):
    q, k, v = inputs(2, 6, 3, 4, 1100)
    kw = {"plain": {}, "padding": {"attn_mask": padding_mask(2, 1100)},
          "alibi": {"is_causal": "bottom-right", "alibi_slopes": torch.rand(6) + 0.01}}[case]
    dout = torch.randn(2, 6, 4, v.shape[-1], dtype=torch.float64)
    grads = []
    for backend in ("flash", "math"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = qkv.scaled_dot_product_attention(
            qq, kk, vv, backend=backend, enable_gqa=True, return_lse=True, **kw
        )
        ((out * dout).sum() + lse.sum()).backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for name, a, b in zip("qkv", *grads, strict=True):
        assert_close(a, b, atol=1e-9, rtol=1e-9, name=f"{case} d{name}")


# --- exp_shifted_: fast exps without giving up exact zeros for hidden keys -----------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_shifted_zeroes_below_the_floor_and_keeps_dead_rows_and_nan(dtype):
    from qkv.attention.masks import EXP_FLOOR, exp_shifted_

    floor = EXP_FLOOR[dtype]
    s = torch.tensor([[0.0, -1.0, floor - 5.0, float("-inf")],
                      [float("-inf")] * 4,
                      [0.0, float("nan"), -2.0, -3.0]], dtype=dtype)
    row_max = s.amax(dim=-1, keepdim=True)
    p = exp_shifted_(s.clone(), row_max)
    assert torch.equal(p[0, 2:], torch.zeros(2, dtype=dtype))  # below the floor, and masked
    assert p[0, 1] == torch.exp(torch.tensor(-1.0, dtype=dtype))
    assert torch.equal(p[1], torch.zeros(4, dtype=dtype))  # a dead row
    assert torch.isnan(p[2]).all()  # NaN max: the row is NaN


def test_masked_keys_with_huge_values_contribute_nothing():
    """Hidden keys get weight exactly 0, so even 1e30 in their values does not leak."""
    q, k, v = inputs(1, 2, 2, 40, 300, dtype=torch.float32)
    mask = torch.ones(1, 1, 40, 300, dtype=torch.bool)
    mask[..., 100:] = False
    v[:, :, 100:] = 1e30
    for backend in ("flash", "math"):
        out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
        assert out.abs().max() < 10, backend


@pytest.mark.parametrize("T", [1, 700])
def test_alibi_far_keys_match_math(T):
    """Steep ALiBi slopes push most keys far below the row maximum (the floor's regime)."""
    q, k, v = inputs(1, 4, 4, T, 900)
    slopes = torch.tensor([0.5, 1.0, 2.0, 8.0])
    out, lse, ref, ref_lse = both(q, k, v, alibi_slopes=slopes, is_causal="bottom-right")
    assert_close(out, ref, atol=1e-10, rtol=1e-10, name="alibi out")
    assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10, name="alibi lse")
    q32, k32, v32 = (t.float() for t in (q, k, v))
    out32 = qkv.scaled_dot_product_attention(q32, k32, v32, alibi_slopes=slopes,
                                             is_causal="bottom-right", backend="flash")
    err = (out32.double() - ref).abs().max().item()
    assert err < 1e-5, f"float32 ALiBi max error {err:.3g}"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-4)])
def test_backward_with_far_keys_matches_math_and_masked_keys_get_no_gradient(dtype, tol):
    """The backward's exps are floored too: steep ALiBi and masked keys, T > 16 (tiles)."""
    q, k, v = inputs(1, 4, 4, 100, 300, dtype=dtype)
    slopes = torch.tensor([0.5, 1.0, 2.0, 8.0])
    mask = torch.ones(1, 1, 100, 300, dtype=torch.bool)
    mask[..., 250:] = False
    dout = torch.randn(1, 4, 100, v.shape[-1], dtype=dtype)
    grads = []
    for backend in ("flash", "math"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = qkv.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, backend=backend,
                                               alibi_slopes=slopes, is_causal="bottom-right")
        (out * dout).sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for name, a, b in zip("qkv", *grads, strict=True):
        err = (a - b).abs().max().item()
        assert err <= tol, f"{dtype} d{name}: max error {err:.3g} > {tol}"
    assert torch.equal(grads[0][1][..., 250:, :], torch.zeros_like(grads[0][1][..., 250:, :]))
    assert torch.equal(grads[0][2][..., 250:, :], torch.zeros_like(grads[0][2][..., 250:, :]))
