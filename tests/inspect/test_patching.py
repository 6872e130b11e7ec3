"""Activation patching sweeps: known answers on a causal model, and cells recomputed with plain
torch hooks on the real modules."""

from __future__ import annotations

import pytest
import torch
from analysis_models import gpt2, ids, llama, seq2seq

import qkv.inspect as qi
from helpers import assert_close

P = 3  # the corrupted position


def _pair(model_ids=None):
    clean = ids(2, 7, 5) if model_ids is None else model_ids
    corrupted = clean.clone()
    corrupted[:, P] = (corrupted[:, P] + 11) % 37
    return clean, corrupted


def metric(logits):
    return (logits[:, -1, 4] - logits[:, -1, 9]).mean()


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_known_answers_of_the_residual_sweep(make):
    model = make()
    clean, corrupted = _pair()
    with torch.no_grad():
        m_clean, m_corrupt = metric(model(clean)).item(), metric(model(corrupted)).item()
    L = len(model.blocks)
    post = qi.patch_residual(model, clean, corrupted, metric, where="post")
    assert post.shape == (L, 7) and post.dtype == torch.float32
    # The last block's output at the last position *is* what the metric reads: clean exactly.
    assert_close(post[-1, -1], m_clean, atol=1e-5, name="last block, last position")
    # Any other position of the last block's output never reaches the last logits (causal).
    assert_close(post[-1, :-1], torch.full((6,), m_corrupt), atol=1e-6, name="other positions")
    pre = qi.patch_residual(model, clean, corrupted, metric, where="pre")
    # Block 0's input at the corrupted position is the only difference: patching it is clean.
    assert_close(pre[0, P], m_clean, atol=1e-5, name="block 0 input at the corrupted position")
    others = [t for t in range(7) if t != P]
    assert_close(pre[0, others], torch.full((6,), m_corrupt), atol=1e-6,
                 name="block 0 input at an identical position")  # fmt: skip
    # Before the corrupted position nothing differs at all.
    assert_close(post[:, :P], torch.full((L, P), m_corrupt), atol=1e-6, name="earlier positions")


def test_one_cell_against_a_plain_torch_hook():
    """Cell (block 1, position 5) of the 'post' sweep = a corrupted run whose block-1 module
    output is overwritten at position 5 by a torch forward hook."""
    model = gpt2()
    clean, corrupted = _pair()
    grid = qi.patch_residual(model, clean, corrupted, metric, where="post")
    with torch.no_grad():
        saved = {}
        h = model.blocks[1].register_forward_hook(lambda m, a, out: saved.setdefault("c", out))
        model(clean)
        h.remove()

        def overwrite(m, a, out):
            out = out.clone()
            out[:, 5] = saved["c"][:, 5]
            return out

        h = model.blocks[1].register_forward_hook(overwrite)
        direct = metric(model(corrupted)).item()
        h.remove()
    assert_close(grid[1, 5], direct, atol=1e-6, name="cell (1, 5) vs a direct torch hook")


def test_head_sweep_against_out_proj_inputs():
    """Cell (layer 0, head 1) of the head sweep = a corrupted run whose out_proj input (the
    merged heads) gets the clean columns of head 1, written with a torch pre-hook."""
    model = gpt2()
    clean, corrupted = _pair()
    grid = qi.patch_heads(model, clean, corrupted, metric)
    assert grid.shape == (2, 3)
    proj, D = model.blocks[0].self_attn.out_proj, 8
    with torch.no_grad():
        saved = {}
        h = proj.register_forward_pre_hook(lambda m, args: saved.setdefault("c", args[0]))
        model(clean)
        h.remove()

        def overwrite(m, args, pos=None):
            x = args[0].clone()  # (B, T, H·D)
            rows = slice(None) if pos is None else pos
            x[:, rows, D:2 * D] = saved["c"][:, rows, D:2 * D]
            return (x,)

        h = proj.register_forward_pre_hook(overwrite)
        direct = metric(model(corrupted)).item()
        h.remove()
        h = proj.register_forward_pre_hook(lambda m, args: overwrite(m, args, pos=P))
        direct_at_p = metric(model(corrupted)).item()
        h.remove()
    assert_close(grid[0, 1], direct, atol=1e-6, name="head (0, 1) at every position")
    at_p = qi.patch_heads(model, clean, corrupted, metric, position=P)
    assert_close(at_p[0, 1], direct_at_p, atol=1e-6, name="head (0, 1) at the corrupted position")


def test_identical_inputs_give_the_clean_metric_everywhere():
    model = llama()
    clean = ids(2, 6, 3)
    with torch.no_grad():
        m = metric(model(clean)).item()
    for grid in (qi.patch_residual(model, clean, clean.clone(), metric),
                 qi.patch_heads(model, clean, clean.clone(), metric, point="hook_k")):
        assert_close(grid, torch.full_like(grid, m), atol=1e-6, name="no difference to patch")
    assert qi.patch_heads(model, clean, clean, metric, point="hook_k").shape == (3, 2)  # Hkv


def test_encoder_decoder_tuple_inputs():
    model = seq2seq()
    src, tgt = ids(2, 6, 1), ids(2, 5, 2)
    bad_src = src.clone()
    bad_src[:, 2] = (bad_src[:, 2] + 5) % 37
    with torch.no_grad():
        m_clean = metric(model(src, tgt)).item()
    enc = qi.patch_residual(model, (src, tgt), (bad_src, tgt), metric, stack="encoder_blocks")
    assert enc.shape == (2, 6)
    assert_close(enc[0, 2], m_clean, atol=1e-5, name="encoder block 0 input at the changed token")
    dec = qi.patch_residual(model, (src, tgt), (bad_src, tgt), metric)
    assert dec.shape == (2, 5)


def test_patching_errors(tmp_path):
    model = gpt2()
    clean, corrupted = _pair()
    with pytest.raises(TypeError, match="metric must return one number"):
        qi.patch_residual(model, clean, corrupted, lambda lg: lg[:, -1, 0])
    with pytest.raises(ValueError, match="same shapes"):
        qi.patch_residual(model, clean, corrupted[:, :5], metric)
    with pytest.raises(ValueError, match="where must be"):
        qi.patch_residual(model, clean, corrupted, metric, where="middle")
    with pytest.raises(ValueError, match="point must be one of"):
        qi.patch_heads(model, clean, corrupted, metric, point="hook_resid_pre")
    with pytest.raises(ValueError, match="position must be"):
        qi.patch_heads(model, clean, corrupted, metric, position=7)
    with pytest.raises(ValueError, match="stack must be one of"):
        qi.patch_residual(model, clean, corrupted, metric, stack="decoder_blocks")
    with pytest.raises(ValueError, match="finite"):
        qi.patch_residual(model, clean, corrupted, lambda lg: float("nan"))
    with pytest.raises(TypeError, match="clean must be a tensor"):
        qi.patch_residual(model, [1, 2], corrupted, metric)


def test_patching_plots(tmp_path):
    model = gpt2()
    clean, corrupted = _pair()
    grid = qi.patch_residual(model, clean, corrupted, metric)
    out = qi.plot_patching(grid, tmp_path / "resid.png", tokens=[f"t{i}" for i in range(7)],
                           center=0.0, metric_label="logit difference")  # fmt: skip
    assert out.read_bytes()[:4] == b"\x89PNG"
    heads = qi.patch_heads(model, clean, corrupted, metric)
    assert qi.plot_patching(heads, tmp_path / "heads.png", kind="head").exists()
    with pytest.raises(ValueError, match="kind must be"):
        qi.plot_patching(heads, tmp_path / "x.png", kind="layer")
    with pytest.raises(ValueError, match="col_ticks must have 3 labels"):
        qi.plot_patching(heads[:, :3], tmp_path / "x.png", tokens=["a"] * 7, kind="position")


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_cells_share_forward_passes_and_give_the_one_by_one_numbers(make, monkeypatch):
    """Issue 27 (a learner's notebook): 150 cells of SmolLM2 were 150 forward passes, 28 s.
    Up to CELLS_PER_RUN cells now ride one pass (the batch repeated, each copy patched at
    its own cell); the grid equals one pass per cell."""
    from qkv.inspect import patching

    model = make()
    clean, corrupted = _pair()
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    together = qi.patch_residual(model, clean, corrupted, metric, where="mid")
    heads = qi.patch_heads(model, clean, corrupted, metric, position=P)
    L, B = len(model.blocks), clean.shape[0]
    assert calls[1:L + 1] == [7 * B] * L, calls  # after the clean run: one pass per block
    monkeypatch.setattr(patching, "CELLS_PER_RUN", 1)
    calls.clear()
    alone = qi.patch_residual(model, clean, corrupted, metric, where="mid")
    handle.remove()
    assert len(calls) == 1 + L * 7
    assert_close(together, alone, atol=1e-6, name="batched vs one cell a pass")
    assert_close(heads, qi.patch_heads(model, clean, corrupted, metric, position=P), atol=1e-6,
                 name="heads, batched vs one a pass")
