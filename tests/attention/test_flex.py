"""qkv.flex_attention against torch's flex_attention (eager, forward) and a dense autograd
reference (forward and gradients, captured tensors included), on a grid of mods and shapes."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import qkv
from helpers import DEVICE, max_error
from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.flex import flex_path
from qkv.attention.flex.blocks import (
    and_masks,
    create_block_mask,
    full_block_mask,
    noop_mask,
    or_masks,
)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def causal(b, h, q, k):
    return q >= k


def band(b, h, q, k):
    return (q - k).abs() < 9


def first_keys(b, h, q, k):
    return k < 3


def per_head(b, h, q, k):
    return (k % (h + 2)) != 1  # a different mask for each head


def none_visible(b, h, q, k):
    return (q < 5) & (k < 0)  # the first rows see nothing at all


MASKS = {
    "none": None, "causal": causal, "band": band, "causal|first": or_masks(causal, first_keys),
    "per-head&causal": and_masks(per_head, causal), "dead-rows": or_masks(none_visible, band),
}


SCORES = {
    "none": None,
    "relative": lambda s, b, h, q, k: s + 0.05 * (q - k),
    "softcap": lambda s, b, h, q, k: 5.0 * torch.tanh(s / 5.0),
    "head-scale": lambda s, b, h, q, k: s * (h + 1) * 0.5,
}

SHAPES = [  # B, H, Hkv, T, S, D, block
    (2, 4, 4, 37, 53, 8, 16),
    (1, 4, 2, 64, 64, 16, 32),
    (2, 2, 1, 29, 17, 8, 8),
]


def dense_reference(q, k, v, score_mod, mask_mod, scale=None):
    """Materialised scores on full index grids; softmax; rows seeing nothing give zeros."""
    B, H, T, D = q.shape
    S = k.shape[2]
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-2, -1) * (D ** -0.5 if scale is None else scale)
    idx = (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
           torch.arange(T).view(1, 1, T, 1), torch.arange(S).view(1, 1, 1, S))
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~torch.broadcast_to(mask_mod(*idx), s.shape), float("-inf"))
    seen = ~torch.isneginf(s).all(-1, keepdim=True)
    w = torch.softmax(torch.where(seen, s, torch.zeros_like(s)), -1) * seen
    return w @ v, w


def _inputs(shape, dtype, seed=0):
    B, H, Hkv, T, S, D, _ = shape
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, D, generator=g, dtype=dtype).requires_grad_()
            for b, h, n in ((B, H, T), (B, Hkv, S), (B, Hkv, S))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("score", SCORES, ids=str)
def test_forward_and_gradients_equal_the_dense_reference(score, mask, shape, dtype):
    q, k, v = _inputs(shape, dtype)
    B, H, Hkv, T, S, _D, block = shape
    mod, mm = SCORES[score], MASKS[mask]
    bm = None if mm is None else create_block_mask(mm, B, H, T, S, BLOCK_SIZE=block)
    out, lse, w = qkv.flex_attention(q, k, v, mod, bm, enable_gqa=H != Hkv, return_lse=True,
                                     need_weights=True)
    ref, ref_w = dense_reference(q, k, v, mod, mm)
    tol = TOL[dtype]
    assert max_error(out, ref) <= tol, f"out: max error {max_error(out, ref)}"
    assert max_error(w, ref_w) <= tol, f"weights: max error {max_error(w, ref_w)}"
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert max_error(a, b) <= 10 * tol, f"d{name}: max error {max_error(a, b)}"
    assert lse.shape == (B, H, T)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask", ["none", "causal", "per-head&causal", "dead-rows"])
@pytest.mark.parametrize("score", ["none", "relative", "softcap"])
def test_equals_torch_flex_attention_and_its_block_mask(score, mask, shape):
    q, k, v = (t.detach() for t in _inputs(shape, torch.float64, seed=1))
    B, H, Hkv, T, S, _D, block = shape
    mod, mm = SCORES[score], MASKS[mask]
    ours = None if mm is None else create_block_mask(mm, B, H, T, S, BLOCK_SIZE=block)
    theirs = None if mm is None else torch_flex.create_block_mask(
        mm, B, H, T, S, device=str(DEVICE), BLOCK_SIZE=block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that eager flex is slow
        want, want_lse = torch_flex.flex_attention(
            q, k, v, mod, theirs, enable_gqa=H != Hkv, return_lse=True)
    got, lse = qkv.flex_attention(q, k, v, mod, ours, enable_gqa=H != Hkv, return_lse=True)
    assert max_error(got, want) <= 1e-10, f"out: max error {max_error(got, want)}"
    finite = ~torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), ~finite)
    assert max_error(lse[finite], want_lse[finite]) <= 1e-10
    if mm is not None:
        nq, nk = ours.state.shape[2:]
        assert torch.equal(ours.to_dense(), theirs.to_dense()[..., :nq, :nk].bool()), mask


def test_captured_tensor_gets_its_gradient():
    """A learned relative-bias table captured by score_mod: gradient equals autograd's."""
    q, k, v = _inputs((2, 3, 3, 41, 41, 8, 16), torch.float64)
    table = torch.randn(3, 81, dtype=torch.float64, requires_grad=True)

    def bias(s, b, h, qi, ki):
        return s + table[h, qi - ki + 40]

    bm = create_block_mask(causal, None, None, 41, 41, BLOCK_SIZE=16)
    out = qkv.flex_attention(q, k, v, bias, bm)
    ref, _ = dense_reference(q, k, v, bias, causal)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, table), dout)
    want = torch.autograd.grad(ref, (q, k, v, table), dout)
    for name, a, b in zip(("q", "k", "v", "table"), got, want, strict=True):
        assert max_error(a, b) <= 1e-10, f"d{name}: max error {max_error(a, b)}"
    assert got[3].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_computes_in_float32(dtype):
    q, k, v = (t.detach() for t in _inputs((1, 2, 2, 40, 40, 16, 16), torch.float32))
    q = q * 30  # large logits
    bm = create_block_mask(causal, None, None, 40, 40, BLOCK_SIZE=16)
    got = qkv.flex_attention(q.to(dtype), k.to(dtype), v.to(dtype), None, bm)
    ref, _ = dense_reference(*(t.to(dtype).double() for t in (q, k, v)), None, causal)
    assert got.dtype == dtype
    err = max_error(got, ref)
    assert err <= 2 * torch.finfo(dtype).eps * 4, f"max error {err}"


def test_sdpa_and_explain_take_mods():
    q, k, v = (t.detach() for t in _inputs((2, 4, 4, 37, 53, 8, 16), torch.float64))
    keep = torch.rand(2, 1, 1, 53, generator=torch.Generator().manual_seed(3)) > 0.3
    for is_causal in (False, True, "bottom-right"):
        got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=is_causal,
                                               mask_mod=noop_mask)
        want = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=is_causal)
        assert max_error(got, want) <= 1e-12, is_causal
    z = torch.zeros(()).expand(1, 8, 1024, 64)  # (B, H, T, D): explain computes nothing
    e = qkv.explain(z, z, z, is_causal=True, mask_mod=noop_mask)
    assert "density" in str(e) and e.visited == 36 and e.tiles == 64 and e.full == 28
    assert e.flops == 2.0 * 8 * (1024 * 1025 / 2 + 8 * 128 * 127 / 2) * 128, e.flops
    # the path flex_attention takes, with its reason (a GPU runs the Triton kernels)
    assert (e.path, e.why) == flex_path(z, z, None, create_block_mask(
        noop_mask, 1, 8, 1024, 1024)), (e.path, e.why)
    assert str(e).startswith(f"flex -> {e.path} ({e.why})")
    e = qkv.explain(z, z, z, score_mod=SCORES["softcap"])
    if DEVICE.type == "cuda":  # a Python score_mod: torch's compiled kernels
        assert e.path == "compiled" and "Python score_mod" in e.why, e.why
    with pytest.raises(AttentionArgumentError, match="dropout"):
        qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.1, mask_mod=noop_mask)
    with pytest.raises(AttentionArgumentError, match="backend"):
        qkv.scaled_dot_product_attention(q, k, v, backend="torch", score_mod=SCORES["softcap"])


def test_bad_arguments_are_named():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(AttentionTypeError, match="score_mod must be callable"):
        qkv.flex_attention(q, q, q, score_mod=3)
    with pytest.raises(AttentionArgumentError, match="Q_LEN=8, KV_LEN=9"):
        qkv.flex_attention(q, q, q, block_mask=create_block_mask(causal, 1, 1, 8, 9))
    with pytest.raises(AttentionArgumentError, match="enable_gqa"):
        qkv.flex_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(AttentionTypeError, match="bool"):
        create_block_mask(lambda b, h, i, j: i - j, 1, 1, 8, 8)
    with pytest.raises(AttentionArgumentError, match="KV_LEN"):
        create_block_mask(causal, 1, 1, 8, 0)
    with pytest.raises(AttentionArgumentError, match="Q_LEN must be an int >= 1, got 0"):
        full_block_mask(0, 8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_mask_only_path_forward_and_gradients(mask, shape, dtype):
    """Without score_mod (and no lse asked for) spans run on torch's fused kernel and its
    fused backward with the whole row's statistics: still the dense reference's gradients."""
    q, k, v = _inputs(shape, dtype, seed=2)
    B, H, Hkv, T, S, _D, block = shape
    mm = MASKS[mask]
    bm = None if mm is None else create_block_mask(mm, B, H, T, S, BLOCK_SIZE=block)
    out = qkv.flex_attention(q, k, v, None, bm, enable_gqa=H != Hkv)
    ref, _ = dense_reference(q, k, v, None, mm)
    tol = TOL[dtype]
    assert max_error(out, ref) <= tol, f"out: max error {max_error(out, ref)}"
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert torch.isfinite(a).all(), f"d{name} has non-finite values"
        assert max_error(a, b) <= 10 * tol, f"d{name}: max error {max_error(a, b)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_query_block_that_sees_no_key_gives_zero_rows(dtype):
    """Every query of the first block sees nothing (issue 31: this raised a TypeError on the
    fused path): zero rows, lse -inf, and gradients that flow, equal to the math backend."""
    T = 40
    bm = create_block_mask(lambda b, h, q, k: q >= 16, None, None, T, T, BLOCK_SIZE=16)
    q, k, v = (torch.randn(1, 2, T, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    out, lse = qkv.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert (out[:, :, :16] == 0).all() and torch.isneginf(lse[:, :, :16]).all()
    i = torch.arange(T)[:, None]
    keep = (i >= 16).expand(T, T)
    ref = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, backend="math")
    assert max_error(out, ref) <= 1e-5
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    refs = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, e in zip(grads, refs, strict=True):
        assert max_error(a, e) <= 1e-5


@pytest.mark.parametrize("block", [1.5, "128", True, (16, 16, 16), 0, (16, -1)])
def test_bad_block_size_is_refused_by_name(block):
    with pytest.raises(AttentionArgumentError, match="BLOCK_SIZE must be an int >= 1"):
        create_block_mask(lambda b, h, i, j: i >= j, None, None, 64, 64, BLOCK_SIZE=block)


@pytest.mark.parametrize(("length", "block"), [(10**12, 128), (2**20, 1)])
def test_block_masks_too_large_to_build_are_refused_before_allocating(length, block):
    with pytest.raises(AttentionArgumentError, match="tile states, over"):
        create_block_mask(lambda b, h, i, j: i >= j, None, None, length, length,
                          BLOCK_SIZE=block)


@pytest.mark.parametrize(("mod", "message"), [
    (lambda s, b, h, i, j: 1.0, "got float"),
    (lambda s, b, h, i, j: None, "got NoneType"),
    (lambda s, b, h, i, j: s > 0, "got dtype torch.bool"),
    (lambda s, b, h, i, j: s.double(), "got dtype torch.float64"),
    (lambda s, b, h, i, j: (s * 0).long(), "got dtype torch.int64"),
    (lambda s, b, h, i, j: s[..., :3], "got shape"),
])
def test_a_score_mod_returning_the_wrong_thing_is_named(mod, message):
    x = torch.randn(1, 2, 20, 8)
    with pytest.raises((AttentionArgumentError, AttentionTypeError),
                       match=f"score_mod <lambda> must return a torch.float32 tensor.*{message}"):
        qkv.flex_attention(x, x, x, mod)


def test_a_score_mod_that_gives_plus_inf_is_named_not_turned_into_nan():
    """Issue 31: a score_mod putting +inf on a key gave 640 NaN outputs without a word. A NaN
    query row stays NaN by the rules (not the score_mod's doing)."""
    x = torch.randn(1, 2, 20, 8)

    def favour_key_3(s, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == 3, torch.full_like(s, float("inf")), s)

    with pytest.raises(AttentionArgumentError,
                       match=r"score_mod favour_key_3 gave \+inf or NaN scores \(40 query rows"):
        qkv.flex_attention(x, x, x, favour_key_3)
    y = x.clone()
    y[0, 1, 5, 0] = float("nan")
    out = qkv.flex_attention(y, x, x, lambda s, b, h, q_idx, kv_idx: s * 1.0)
    assert out[0, 1, 5].isnan().all() and not out[0, 0].isnan().any()
