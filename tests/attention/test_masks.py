"""qkv.masks: builders against explicit loops, conversions, and the mask linter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from helpers import assert_close
from qkv import masks


def loop_mask(T, S, rule):
    return torch.tensor([[rule(i, j) for j in range(S)] for i in range(T)], dtype=torch.bool).reshape(T, S)


@pytest.mark.parametrize(("T", "S"), [(5, 5), (3, 7), (7, 3), (1, 9), (0, 4)])
@pytest.mark.parametrize("offset", [0, 2])
def test_causal_alignments(T, S, offset):
    top = masks.causal(T, S, offset=offset)
    assert torch.equal(top, loop_mask(T, S, lambda i, j: j <= i + offset))
    bottom = masks.causal(T, S, align="bottom-right", offset=offset)
    assert torch.equal(bottom, loop_mask(T, S, lambda i, j: j <= i + S - T + offset))


def test_causal_top_left_equals_torch_is_causal():
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    b = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.causal(6, 9))
    assert_close(a, b, atol=1e-6, name="torch is_causal vs masks.causal")


def test_decoding_offset_equals_last_row():
    """One new token after n cached ones sees exactly the last row of the full mask."""
    n = 6
    full = masks.causal(n + 1)
    step = masks.causal(1, n + 1, offset=n)
    assert torch.equal(step[0], full[-1])
    assert torch.equal(step, masks.causal(1, n + 1, align="bottom-right"))


@pytest.mark.parametrize(("T", "S", "window"), [(6, 6, 1), (6, 6, 3), (4, 9, 2), (9, 4, 5)])
@pytest.mark.parametrize("align", ["top-left", "bottom-right"])
def test_sliding_window(T, S, window, align):
    shift = S - T if align == "bottom-right" else 0
    expected = loop_mask(T, S, lambda i, j: i + shift - window < j <= i + shift)
    assert torch.equal(masks.sliding_window(T, S, window=window, align=align), expected)


def test_padding_from_lengths_and_ids():
    m = masks.padding([3, 1, 0], 4)
    assert m.shape == (3, 1, 1, 4)
    assert m[:, 0, 0].tolist() == [
        [True, True, True, False],
        [True, False, False, False],
        [False, False, False, False],
    ]
    ids = torch.tensor([[5, 6, 7, 0], [5, 0, 0, 0]])
    assert torch.equal(masks.padding_from_ids(ids, pad_id=0), masks.padding([3, 1], 4))
    assert masks.padding(torch.tensor([2, 5])).shape == (2, 1, 1, 5)


def test_combine_bool_and_float():
    a = masks.causal(4)
    b = masks.padding([3], 4)  # (1, 1, 1, 4)
    both = masks.combine(a, None, b)
    assert both.dtype == torch.bool and both.shape == (1, 1, 4, 4)
    assert torch.equal(both, a & b)
    f = torch.randn(4, 4)
    mixed = masks.combine(a, f)
    assert mixed.dtype == torch.float32
    expected = f.masked_fill(~a, float("-inf"))
    assert torch.equal(mixed, expected)
    assert masks.combine(None, None) is None


def test_combined_masks_in_attention():
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    keep = masks.combine(masks.causal(5), masks.padding([5, 3], 5))
    additive = masks.to_additive(keep)
    a = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    b = qkv.scaled_dot_product_attention(q, k, v, attn_mask=additive)
    assert_close(a, b, atol=1e-6, name="bool vs additive form of one mask")


def test_polarity_round_trip_with_torch_mha():
    """An SDPA keep mask converted with to_mha gives torch.nn.MultiheadAttention the same result."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(1, 5, 8)
    keep = masks.causal(5)
    drop = masks.to_mha(keep)
    assert torch.equal(drop, ~keep) and torch.equal(masks.from_mha(drop), keep)
    a, _ = mha(x, x, x, attn_mask=drop)
    b, _ = mha(x, x, x, attn_mask=masks.to_additive(keep))
    assert_close(a, b, atol=1e-6, name="drop-polarity bool vs additive")
    f = torch.randn(3, 3)
    assert masks.from_mha(f) is f and masks.to_mha(f) is f


def test_builder_errors():
    with pytest.raises(ValueError, match=r"align must be one of \('top-left', 'bottom-right'\), got 'left'"):
        masks.causal(3, align="left")
    with pytest.raises(ValueError, match=r"window must be a positive int, got 0"):
        masks.sliding_window(3, window=0)
    with pytest.raises(ValueError, match=r"T must be a non-negative int, got -1"):
        masks.causal(-1)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=3\], got \[4\]"):
        masks.padding([4], 3)
    with pytest.raises(ValueError, match=r"lengths must be a 1-D integer tensor"):
        masks.padding(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"ids must be a \(B, S\) tensor"):
        masks.padding_from_ids(torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match=r"do not broadcast together"):
        masks.combine(torch.ones(3, 4, dtype=torch.bool), torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be bool or float"):
        masks.from_mha(torch.ones(2, 2, dtype=torch.long))


def test_check_reports_each_problem():
    ok = masks.check(masks.causal(4, 6), 4, 6)
    assert ok.ok and str(ok) == "mask ok"
    report = masks.check(torch.ones(4, 6, dtype=torch.long), 4, 6)
    assert not report.ok and "neither bool" in str(report)
    report = masks.check(torch.ones(4, 5, dtype=torch.bool), 4, 6)
    assert "does not broadcast to the scores (4, 6)" in str(report)
    report = masks.check(torch.ones(3, 1, 4, 6, dtype=torch.bool), 4, 6, batch_shape=(2,), num_heads=1)
    assert "does not broadcast" in str(report)
    dead = torch.ones(4, 6, dtype=torch.bool)
    dead[2] = False
    report = masks.check(dead, 4, 6)
    assert report.dead_rows == 1 and "1 query row(s) see no key" in str(report)
    assert masks.check(masks.causal(4, 6, align="bottom-right", offset=-3), 4, 6).dead_rows == 1
    f = torch.zeros(4, 6)
    f[0, 0] = float("nan")
    f[1, 1] = float("inf")
    f[3] = float("-inf")
    report = masks.check(f, 4, 6)
    assert "1 NaN entries" in str(report) and "+inf" in str(report) and report.dead_rows == 1
    assert "must be a torch.Tensor" in str(masks.check([1, 2], 4, 6))
    # issue 27: torch's polarity (True = hide) only read as "1 query row(s) see no key"
    for T, S in ((5, 5), (4, 6)):
        for align in ("top-left", "bottom-right"):
            report = masks.check(~masks.causal(T, S, align=align), T, S)
            assert "inverted causal mask" in str(report) and "from_mha" in str(report), report
    assert "inverted" not in str(masks.check(masks.causal(5, 5), 5, 5))
    assert "inverted" not in str(masks.check(torch.rand(5, 5) > 0.5, 5, 5))
