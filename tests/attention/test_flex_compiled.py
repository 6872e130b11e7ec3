"""A Python ``score_mod`` on torch's compiled FlexAttention (``kernel_options={"backend":
"compiled"}``, and ``auto`` on a GPU), against qkv's tile loop in float64.

On the CPU torch compiles FlexAttention for inference only (no backward, no log-sum-exp), so
here: qkv's block masks are held to torch's own ``create_block_mask`` of the same
``mask_mod`` (the same partial and full blocks); the path's output, lse, weights and rules
run through torch's *eager* FlexAttention (the unfused definition the compiled kernels
match), and one call through the real compiled kernel. On a GPU (``QKV_TEST_DEVICE=cuda``,
make test-gpu) the compiled kernels run forward and backward. Tolerance: float32 within 1e-5
of the float64 truth (sums of a few hundred unit-size products).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import qkv
from helpers import DEVICE, assert_close
from qkv.attention.errors import AttentionArgumentError
from qkv.attention.flex import compiled as flex_compiled
from qkv.attention.flex import flex_path
from qkv.attention.flex.blocks import and_masks
from qkv.attention.mods import causal_mask, document_mask, prefix_lm, sliding_window_mask

COMPILED = {"backend": "compiled"}
TILES = {"backend": "tiles"}
B, H, HKV, T, S, D = 2, 4, 2, 300, 333, 32  # 3 × 3 blocks of 128, the last ones ragged


def _ids(n: int) -> torch.Tensor:
    return (torch.arange(n, device="cpu") // 97).to(DEVICE)  # documents of 97 tokens


def _masks() -> dict:
    """``(mask_mod, B or None, H or None)``: every kind of block (empty, partial, full)."""
    def per_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 40 * h) & (q_idx >= 5)  # rows 0-4 see nothing

    return {
        "causal": (causal_mask, None, None),
        "window": (sliding_window_mask(150, offset=S - T), None, None),
        "document": (and_masks(document_mask(_ids(S)), causal_mask), None, None),
        "prefix-lm per row": (prefix_lm(torch.tensor([5, 200], device=DEVICE)), B, None),
        "per head, dead rows": (per_head, None, H),
    }


def _score_mods() -> dict:
    bias = torch.linspace(-1.0, 1.0, H, device=DEVICE)  # captured, indexed by head

    def softcap_and_bias(score, b, h, q_idx, kv_idx):
        return 20 * torch.tanh(score / 20) + bias[h]

    def distance(score, b, h, q_idx, kv_idx):
        return score - 0.01 * (q_idx - kv_idx).abs()

    return {"softcap+bias": softcap_and_bias, "distance": distance}


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE, dtype)
                 for s in ((B, H, T, D), (B, HKV, S, D), (B, HKV, S, D)))


def _blocks(bm, full: bool) -> torch.Tensor:
    """A torch BlockMask's full (else partial) blocks, ``(B, H, nQ, nK)`` bool, from its
    tables."""
    n, idx = ((bm.full_kv_num_blocks, bm.full_kv_indices) if full else
              (bm.kv_num_blocks, bm.kv_indices))
    idx = idx.long()
    listed = torch.arange(idx.shape[-1], device=idx.device) < n[..., None]
    full = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
    return full.scatter_(-1, idx, listed)


@pytest.mark.parametrize("kind", list(_masks()))
def test_block_masks_become_torch_s_own(kind):
    """qkv's block mask converted visits the blocks torch's ``create_block_mask`` of the same
    ``mask_mod`` visits, and skips ``mask_mod`` on the blocks torch skips it on; where the
    keys or queries end inside a block, qkv counts a block whose real entries are all
    visible as full (torch, padding, as partial: its kernels bound the lengths in both)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod, b, h = _masks()[kind]
    ours = flex_compiled.torch_block_mask(qkv.create_block_mask(mask_mod, b, h, T, S,
                                                                device=DEVICE), DEVICE)
    theirs = create_block_mask(mask_mod, b, h, T, S, device=DEVICE)
    assert torch.equal(ours.to_dense(), theirs.to_dense()), kind
    mine, torch_s = _blocks(ours, full=True), _blocks(theirs, full=True)
    assert not (torch_s & ~mine).any(), kind
    partial = _blocks(ours, full=False)
    assert not (partial & mine).any(), f"{kind}: a block listed both partial and full"
    assert not (partial & ~_blocks(theirs, full=False)).any(), kind
    extra = mine & ~torch_s
    extra[..., :-1, :-1] &= False  # only the last row or column of blocks is ragged
    assert torch.equal(extra, mine & ~torch_s), kind
    assert ours.seq_lengths == (T, S) and ours.BLOCK_SIZE == (128, 128)


@pytest.fixture
def eager_flex(monkeypatch):
    """The path with torch's eager FlexAttention in place of the compiled one, and the lse
    it gives on any device: the conversion and qkv's rules checked on the CPU in no time."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_compiled, "_compiled", lambda: flex_attention)
    monkeypatch.setattr(flex_compiled, "gives_lse", lambda device: True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        yield


@pytest.mark.parametrize("mod", list(_score_mods()))
@pytest.mark.parametrize("kind", list(_masks()))
def test_output_lse_and_weights_equal_the_tile_loop(kind, mod, eager_flex):
    mask_mod, b, h = _masks()[kind]
    score_mod = _score_mods()[mod]
    bm = qkv.create_block_mask(mask_mod, b, h, T, S, device=DEVICE)
    q, k, v = _inputs()
    with torch.no_grad():
        out, lse, w = qkv.flex_attention(q, k, v, score_mod, bm, enable_gqa=True,
                                         return_lse=True, need_weights=True,
                                         kernel_options=COMPILED)
        ref, ref_lse, ref_w = qkv.flex_attention(
            *(t.double() for t in (q, k, v)), score_mod, bm, enable_gqa=True,
            return_lse=True, need_weights=True, kernel_options=TILES)
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name=f"out {kind} {mod}")
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead), f"rows with no key differ ({kind})"
    assert_close(lse[~dead], ref_lse[~dead], atol=1e-5, rtol=1e-5, name=f"lse {kind}")
    assert_close(w, ref_w, atol=1e-5, rtol=1e-5, name=f"weights {kind} {mod}")


def test_qkv_s_rules_hold_on_the_path(eager_flex):
    """A non-finite query row gives a NaN output row (even one that sees no key); a
    ``score_mod`` that makes a score +inf is named, not answered with NaN."""
    mask_mod, _, h = _masks()["per head, dead rows"]
    bm = qkv.create_block_mask(mask_mod, None, h, T, S, device=DEVICE)
    q, k, v = _inputs()
    q[0, 1, 2, 0] = float("inf")  # a row that sees no key
    q[1, 0, 100, 3] = float("nan")
    with torch.no_grad():
        out = qkv.flex_attention(q, k, v, None, bm, enable_gqa=True, kernel_options=COMPILED)
    nan_rows = torch.isnan(out).all(-1)
    assert nan_rows[0, 1, 2] and nan_rows[1, 0, 100] and int(nan_rows.sum()) == 2
    assert torch.isfinite(out[~nan_rows]).all()

    def too_big(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == 7, float("inf"), score)

    with torch.no_grad(), pytest.raises(AttentionArgumentError, match="too_big gave"):
        qkv.flex_attention(*_inputs(), too_big, bm, enable_gqa=True, kernel_options=COMPILED)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU test below compiles with backward")
def test_the_compiled_kernel_on_the_cpu_equals_the_tile_loop():
    """torch's real compiled kernel (inference, as torch builds it for the CPU), with full
    blocks (below the diagonal) beside partial ones."""
    mask_mod, b, h = _masks()["causal"]
    bm = qkv.create_block_mask(mask_mod, b, h, T, S)
    q, k, v = _inputs()
    score_mod = _score_mods()["softcap+bias"]
    with torch.no_grad():
        out = qkv.flex_attention(q, k, v, score_mod, bm, enable_gqa=True,
                                 kernel_options=COMPILED)
        ref = qkv.flex_attention(*(t.double() for t in (q, k, v)), score_mod, bm,
                                 enable_gqa=True, kernel_options=TILES)
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name="compiled on the CPU")


@pytest.mark.skipif(DEVICE.type != "cuda",
                    reason="torch compiles FlexAttention with a backward for GPUs only")
def test_on_a_gpu_auto_takes_it_with_gradients_of_inputs_and_captured_tensors():
    bias = torch.linspace(-1.0, 1.0, H, device=DEVICE, dtype=torch.float64)

    def run(dtype, backend):
        table = bias.to(dtype).requires_grad_()

        def biased(score, b, h, q_idx, kv_idx):
            return score + table[h] * (q_idx >= kv_idx)

        q, k, v = (t.to(dtype).requires_grad_() for t in _inputs(torch.float64))
        bm = qkv.create_block_mask(_masks()["document"][0], None, None, T, S, device=DEVICE)
        out, lse = qkv.flex_attention(q, k, v, biased, bm, enable_gqa=True, return_lse=True,
                                      kernel_options=backend)
        grads = torch.autograd.grad((out * torch.cos(out.detach())).sum() + lse.sum(),
                                    (q, k, v, table))
        return out, lse, grads

    assert flex_path(*_inputs()[::2], _score_mods()["distance"], None)[0] == "compiled"
    got, want = run(torch.float32, None), run(torch.float64, TILES)
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv", "dbias"),
                          (got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True):
        assert_close(a, e, atol=2e-5, rtol=2e-5, name=f"{name} on the GPU")


def test_which_path_and_why():
    q, k, v = _inputs()
    mod = _score_mods()["distance"]
    bm = qkv.create_block_mask(causal_mask, None, None, T, S, device=DEVICE)
    if DEVICE.type == "cpu":
        path, why = flex_path(q, v, mod, bm)
        assert path == "tiles" and "on the CPU the tile loop is the fast path" in why, why
        assert flex_path(q, v, mod, bm, COMPILED)[0] == "compiled"
        assert "inference only" in flex_path(q, v, mod, bm, COMPILED, return_lse=True)[1]
        with pytest.raises(AttentionArgumentError, match="backend='compiled' cannot serve"):
            qkv.flex_attention(q, k.requires_grad_(), v, mod, bm, enable_gqa=True,
                               kernel_options=COMPILED)
    small = qkv.create_block_mask(causal_mask, None, None, T, S, device=DEVICE, BLOCK_SIZE=64)
    assert "block size (64, 64)" in flex_path(q, v, mod, small, COMPILED)[1]
    assert "float32, bfloat16, float16" in flex_path(q.double(), v, mod, bm, COMPILED)[1]
    odd = torch.zeros(B, H, T, 24, device=DEVICE)
    assert "powers of two" in flex_path(odd, odd, mod, bm, COMPILED)[1]
    with pytest.raises(AttentionArgumentError, match="backend must be one of"):
        flex_path(q, v, mod, bm, {"backend": "inductor"})
