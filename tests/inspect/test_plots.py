"""Plots: PNGs of the expected size, exact block means, thousands of tokens shrunk."""

from __future__ import annotations

import struct
import time

import pytest
import torch
from inspect_refs import build

import qkv.inspect as qi
from helpers import assert_close
from qkv.inspect.pool import Pooler, bin_edges, pool


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; asserts it is a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def sized(path, asked: tuple[int, int]) -> bool:
    """The PNG has the asked size, or is grown by at most a quarter to hold texts that would
    run off an edge (plots.save never crops)."""
    got = png_size(path)
    return all(a <= g <= a * 1.25 for g, a in zip(got, asked, strict=True))


@pytest.fixture(scope="module")
def captured():
    model, run = build("seq2seq")
    with qi.capture(model) as cap, torch.no_grad():
        run()
    return cap


def test_head_heatmap_has_the_asked_size(tmp_path, captured):
    labels = [f"tok{i}" for i in range(9)]
    p = qi.plot_head(captured, tmp_path / "head.png", layer="encoder_blocks.1.self_attn", head=2,
                     q_tokens=labels, figsize=(5, 4), dpi=80)  # fmt: skip
    assert sized(p, (400, 320)) and p.stat().st_size > 5_000


def test_grid_alignment_rollout_positions_masks(tmp_path, captured):
    grid = qi.plot_grid(captured, tmp_path / "grid.png", cell=1.0, dpi=50)
    assert sized(grid, (3 * 50 + 30, 6 * 50))  # 3 heads × 6 layers, 1 inch each + bar
    align = qi.plot_alignment(captured, tmp_path / "a.png", src_tokens=list("abcdefghi"),
                              tgt_tokens=list("ABCDEFG"), figsize=(6, 5), dpi=50)  # fmt: skip
    assert sized(align, (300, 250))
    roll = qi.plot_rollout(captured, tmp_path / "r.png", figsize=(4, 4), dpi=50)
    assert sized(roll, (200, 200))
    pos = qi.plot_positions(tmp_path / "pos.png", max_len=50, d_model=32, figsize=(6, 3), dpi=60)
    assert sized(pos, (360, 180))
    masks = qi.plot_masks(tmp_path / "m.png", length=6, lengths=(6, 3), dpi=40)
    assert sized(masks, (int(2.4 * 5 * 40), int(2.8 * 40)))  # 5 panels
    for p in (grid, align, roll, pos, masks):
        assert p.stat().st_size > 2_000, p


def test_rollout_rows_are_distributions_and_match_by_hand(captured):
    r = qi.rollout(captured, batch=1)
    assert_close(r.sum(-1), torch.ones(9, dtype=torch.float64), atol=1e-12, name="row sums")
    eye = torch.eye(9, dtype=torch.float64)
    expected = eye
    for name in ("encoder_blocks.0.self_attn", "encoder_blocks.1.self_attn"):
        a = 0.5 * captured.weights[name][1].double().mean(0) + 0.5 * eye
        expected = (a / a.sum(-1, keepdim=True)) @ expected
    assert_close(r, expected, atol=1e-12, name="rollout")


def test_thousands_of_tokens_are_block_averaged_quickly(tmp_path):
    T = 3000
    w = torch.softmax(torch.randn(T, T, generator=torch.Generator().manual_seed(0)), -1)
    start = time.perf_counter()
    p = qi.plot_head(w, tmp_path / "big.png", figsize=(6, 6), dpi=60)
    elapsed = time.perf_counter() - start
    assert sized(p, (360, 360)) and elapsed < 10, f"{elapsed:.1f} s"


@pytest.mark.parametrize(("T", "S", "R", "C"), [(7, 5, 3, 2), (113, 203, 16, 50), (4, 4, 9, 9)])
def test_pool_is_exact_block_means(T, S, R, C):
    m = torch.rand(2, T, S, dtype=torch.float64)
    got = pool(m, R, C)
    rows, cols = bin_edges(T, R), bin_edges(S, C)
    assert got.shape == (2, len(rows) - 1, len(cols) - 1)
    for r in range(len(rows) - 1):
        for c in range(len(cols) - 1):
            block = m[:, rows[r] : rows[r + 1], cols[c] : cols[c + 1]]
            assert_close(got[:, r, c], block.mean((-1, -2)), atol=1e-6, name=f"bin {r},{c}")
    # Fed in row blocks, the same result.
    p = Pooler(T, S, R, C, (2,))
    for i0 in range(0, T, 3):
        p.add(i0, m[:, i0 : i0 + 3])
    assert_close(p.result(), got, atol=1e-6, name="streamed")


def test_plot_errors(tmp_path, captured):
    with pytest.raises(ValueError, match=r"head 5 of encoder_blocks\.0\.self_attn was not captured"):
        qi.plot_head(captured, tmp_path / "x.png", layer="encoder_blocks.0.self_attn", head=5)
    with pytest.raises(KeyError, match="no captured layer 'nope'"):
        qi.plot_head(captured, tmp_path / "x.png", layer="nope")
    with pytest.raises(ValueError, match=r"expected a Captured, a \(B, H, T, S\) or a \(T, S\)"):
        qi.plot_head(torch.ones(3), tmp_path / "x.png")
    with pytest.raises(ValueError, match="figsize must be positive and dpi >= 10"):
        qi.plot_head(torch.ones(2, 2), tmp_path / "x.png", dpi=1)
    model, run = build("gpt2")
    with qi.capture(model) as cap, torch.no_grad():
        run()
    with pytest.raises(ValueError, match="no cross-attention layer was captured"):
        qi.plot_alignment(cap, tmp_path / "x.png")
    with qi.capture(model, rows=-1) as last, torch.no_grad():
        run()
    with pytest.raises(ValueError, match="rollout needs square self-attention weights"):
        qi.rollout(last)
    with pytest.raises(TypeError, match="cap must be a Captured, got Tensor"):
        qi.plot_grid(torch.ones(2, 2), tmp_path / "x.png")
    with pytest.raises(ValueError, match="max_len must be a positive int, got 0"):
        qi.plot_positions(tmp_path / "x.png", max_len=0)
    with pytest.raises(ValueError, match="length must be a positive int"):
        qi.plot_masks(tmp_path / "x.png", length=0)
