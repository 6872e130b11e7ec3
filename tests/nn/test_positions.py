"""Positional encodings: sinusoidal and learned tables, RoPE and ALiBi, against closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import assert_close
from qkv.nn.alibi import ALiBi, alibi_bias, alibi_slopes
from qkv.nn.positions import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    sinusoidal_table,
)
from qkv.nn.rope import RotaryEmbedding, apply_rotary, rotary_cos_sin, rotate_half


def numpy_sinusoid(positions, E: int, base: float = 10000.0) -> np.ndarray:
    """The paper's formula, column by column, in float64."""
    p = np.asarray(positions, dtype=np.float64)[:, None]  # (N, 1)
    k = np.arange(E)[None, :]  # (1, E)
    angle = p / base ** (2 * (k // 2) / E)  # (N, E)
    return np.where(k % 2 == 0, np.sin(angle), np.cos(angle))


# ---------------------------------------------------------------- sinusoidal


@pytest.mark.parametrize(("max_len", "E"), [(50, 16), (113, 59), (10, 1), (7, 3), (0, 4)])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_sinusoidal_table_matches_closed_form(max_len, E, base):
    expected = numpy_sinusoid(range(max_len), E, base)
    table32 = sinusoidal_table(max_len, E, base=base)
    assert table32.dtype == torch.float32
    assert_close(table32, expected, atol=1e-6, name="float32 table")
    table64 = sinusoidal_table(max_len, E, base=base, dtype=torch.float64)
    assert_close(table64, expected, atol=1e-10, name="float64 table")


def test_sinusoidal_module_adds_table_with_offset_and_grows():
    pe = SinusoidalPositionalEncoding(59, max_len=8)
    x = torch.randn(2, 5, 59)
    assert_close(pe(x), x.numpy() + numpy_sinusoid(range(5), 59), atol=1e-6, name="offset 0")
    # 6 + 5 > 8: the table grows and the rows beyond the original size are still exact.
    out = pe(x, offset=6)
    assert pe.max_len >= 11
    assert_close(out, x.numpy() + numpy_sinusoid(range(6, 11), 59), atol=1e-6, name="grown")
    assert_close(pe.table(3, offset=200), numpy_sinusoid(range(200, 203), 59), atol=1e-5)
    assert "pe" not in pe.state_dict(), "the table is a function of the arguments, not state"


def test_sinusoidal_float64_input_gets_float64_positions():
    pe = SinusoidalPositionalEncoding(7, max_len=16)
    x = torch.randn(1, 113, 7, dtype=torch.float64, requires_grad=True)
    out = pe(x, offset=900)
    assert out.dtype == torch.float64
    expected = x.detach().numpy() + numpy_sinusoid(range(900, 1013), 7)
    assert_close(out, expected, atol=1e-10, name="float64 forward")
    out.sum().backward()
    assert_close(x.grad, np.ones((1, 113, 7)), atol=0, name="grad of x + PE")


def test_sinusoidal_errors():
    with pytest.raises(ValueError, match=r"d_model must be an int >= 1, got 0"):
        sinusoidal_table(4, 0)
    with pytest.raises(ValueError, match=r"max_len must be an int >= 0, got -1"):
        sinusoidal_table(-1, 4)
    with pytest.raises(ValueError, match=r"base must be a positive number, got 0"):
        SinusoidalPositionalEncoding(4, base=0)
    pe = SinusoidalPositionalEncoding(8, max_len=4)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, E=8\), got \(2, 3, 6\)"):
        pe(torch.zeros(2, 3, 6))
    with pytest.raises(ValueError, match=r"offset must be an int >= 0, got -2"):
        pe(torch.zeros(2, 3, 8), offset=-2)
    with pytest.raises(TypeError, match="x must be a Tensor, got list"):
        pe([1.0])


# ---------------------------------------------------------------- learned


def test_learned_offset_and_positions():
    emb = LearnedPositionalEmbedding(16, 5)
    assert list(emb.state_dict()) == ["weight"]
    w = emb.weight.detach()
    x = torch.randn(3, 4, 5)
    assert_close(emb(x), x + w[:4], atol=0, name="offset 0")
    assert_close(emb(x, offset=12), x + w[12:16], atol=0, name="offset 12")
    assert_close(emb(x, positions=torch.arange(12, 16)), x + w[12:16], atol=0, name="(T,)")
    pos = torch.tensor([[0, 0, 1, 2], [5, 6, 7, 8], [15, 14, 13, 12]])
    expected = torch.stack([x[b] + w[pos[b]] for b in range(3)])
    assert_close(emb(x, positions=pos), expected, atol=0, name="(B, T) positions")


def test_learned_backward_accumulates_per_position():
    emb = LearnedPositionalEmbedding(10, 3)
    x = torch.randn(2, 4, 3, requires_grad=True)
    g = torch.randn(2, 4, 3)
    emb(x, positions=torch.tensor([[1, 2, 3, 4], [1, 1, 9, 0]])).backward(g)
    expected = torch.zeros(10, 3)
    expected[1] = g[0, 0] + g[1, 0] + g[1, 1]
    expected[2], expected[3], expected[4] = g[0, 1], g[0, 2], g[0, 3]
    expected[9], expected[0] = g[1, 2], g[1, 3]
    assert_close(emb.weight.grad, expected, atol=1e-6, name="weight grad")
    assert_close(x.grad, g, atol=0, name="x grad")


def test_learned_errors():
    emb = LearnedPositionalEmbedding(8, 4)
    with pytest.raises(ValueError, match=r"offset=6, T=3\) go beyond max_len=8"):
        emb(torch.zeros(1, 3, 4), offset=6)
    with pytest.raises(ValueError, match=r"beyond max_len=8"):
        emb(torch.zeros(1, 9, 4))
    with pytest.raises(ValueError, match=r"\[0, max_len=8\), got values in \[2, 8\]"):
        emb(torch.zeros(1, 3, 4), positions=torch.tensor([2, 5, 8]))
    with pytest.raises(ValueError, match=r"got values in \[-1, 1\]"):
        emb(torch.zeros(1, 3, 4), positions=torch.tensor([-1, 0, 1]))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        emb(torch.zeros(1, 3, 4), positions=torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"\(B, T\) or \(T,\) with T=3, got \(1, 2\)"):
        emb(torch.zeros(1, 3, 4), positions=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, E=4\), got \(1, 3, 5\)"):
        emb(torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match=r"max_len must be an int >= 1, got 0"):
        LearnedPositionalEmbedding(0, 4)


# ---------------------------------------------------------------- RoPE


def complex_rope(x: np.ndarray, positions: np.ndarray, base: float = 10000.0, angles=None):
    """RoPE as a complex rotation of pairs (x[i], x[i + D/2]), positions along axis -2."""
    D = x.shape[-1]
    z = x[..., : D // 2] + 1j * x[..., D // 2 :]  # (..., T, D/2)
    if angles is None:
        theta = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)  # (D/2,)
        angles = np.asarray(positions, dtype=np.float64)[..., None] * theta  # (..., T, D/2)
    z = z * np.exp(1j * angles)
    return np.concatenate([z.real, z.imag], axis=-1)  # (..., T, D)


@pytest.mark.parametrize("D", [2, 8, 58, 64])
@pytest.mark.parametrize(("T", "offset"), [(1, 0), (5, 3), (113, 0), (7, 2000)])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rope_float64_equals_complex_rotation(D, T, offset, base):
    rope = RotaryEmbedding(D, base=base, max_len=16)
    x = torch.randn(2, 3, T, D, dtype=torch.float64)
    expected = complex_rope(x.numpy(), np.arange(offset, offset + T), base)
    assert_close(rope(x, offset=offset), expected, atol=1e-10, name="rope float64")


@pytest.mark.parametrize(("D", "T", "offset"), [(64, 113, 0), (58, 9, 300), (8, 1, 4095)])
def test_rope_float32_equals_complex_rotation_of_float32_angles(D, T, offset):
    # The module computes angles in float32 (the precision of Hugging Face's), which at position
    # p is off by up to ~p·2^-24 rad; the reference uses the same float32-rounded angles so the
    # comparison checks the rotation itself to float32 rounding of cos/sin and the products.
    x = torch.randn(2, 2, T, D)
    theta = (10000.0 ** (-np.arange(0, D, 2) / D)).astype(np.float32)
    angles = np.arange(offset, offset + T, dtype=np.float32)[:, None] * theta  # float32 product
    expected = complex_rope(x.double().numpy(), None, angles=angles.astype(np.float64))
    out = RotaryEmbedding(D)(x, offset=offset)
    assert out.dtype == torch.float32
    assert_close(out, expected, atol=1e-6, rtol=1e-6, name="rope float32")


def test_rope_keeps_norms_and_scores_depend_on_relative_position():
    D = 64
    rope = RotaryEmbedding(D)
    q = torch.randn(2, 4, 1, D, dtype=torch.float64)
    k = torch.randn(2, 4, 1, D, dtype=torch.float64)
    x = torch.randn(2, 4, 37, D, dtype=torch.float64)
    assert_close(rope(x, offset=11).norm(dim=-1), x.norm(dim=-1), atol=1e-10, name="norms")
    # Put q at position m and k at position n; the score must only depend on m - n.
    for m, n in [(0, 0), (5, 2), (2, 5), (100, 37)]:
        s = (rope(q, offset=m) * rope(k, offset=n)).sum(-1)  # (B, H, 1)
        s7 = (rope(q, offset=m + 7) * rope(k, offset=n + 7)).sum(-1)  # (B, H, 1)
        assert_close(s7, s, atol=1e-10, name=f"scores at ({m}, {n}) shifted by 7")
    q32, k32 = q.float(), k.float()
    s = (rope(q32, offset=30) * rope(k32, offset=20)).sum(-1)  # (B, H, 1)
    s7 = (rope(q32, offset=37) * rope(k32, offset=27)).sum(-1)  # (B, H, 1)
    # float32 angles at positions ~30 are off by ~2e-6 rad, scores are ~|q||k| ~ 64.
    assert_close(s7, s, atol=1e-5, rtol=1e-5, name="float32 shifted scores")


def test_rope_offset_equals_slice_and_positions_equal_offset():
    rope = RotaryEmbedding(16, max_len=8)  # small, so the cache has to grow
    x = torch.randn(3, 2, 40, 16)
    full = rope(x)
    for o, t in [(0, 5), (17, 1), (33, 7)]:
        part = rope(x[:, :, o : o + t], offset=o)
        assert_close(part, full[:, :, o : o + t], atol=1e-6, name=f"offset {o}")
        by_pos = rope(x[:, :, o : o + t], positions=torch.arange(o, o + t))
        assert_close(by_pos, part, atol=1e-6, name=f"(T,) positions at {o}")
    # (B, T) positions: each row rotated by its own offset (left-padded batches).
    starts = [0, 3, 10]
    pos = torch.stack([torch.arange(s, s + 6) for s in starts])  # (B, T)
    out = rope(x[:, :, :6], positions=pos)
    for b, s in enumerate(starts):
        assert_close(out[b], rope(x[b : b + 1, :, :6], offset=s)[0], atol=1e-6, name=f"row {b}")


def test_rope_gradcheck_float64():
    rope = RotaryEmbedding(6)
    x = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rope(t, offset=3), (x,))
    pos = torch.tensor([[4, 1, 0, 9, 2]])
    assert torch.autograd.gradcheck(lambda t: rope(t, positions=pos), (x,))


def test_rope_low_precision_and_cast_module():
    rope = RotaryEmbedding(32, max_len=4)
    x = torch.randn(1, 2, 50, 32)
    ref = rope(x, offset=1000)
    out = rope.to(torch.bfloat16)(x.bfloat16(), offset=1000)
    assert out.dtype == torch.bfloat16
    assert rope.cos_cached.dtype == torch.float32, "the cache is rebuilt in float32 after a cast"
    assert_close(out, ref, atol=3e-2, name="bf16 vs float32")  # bf16: 8 mantissa bits


def test_rope_functional_helpers():
    x = torch.arange(6.0)
    assert_close(rotate_half(x), torch.tensor([-3.0, -4.0, -5.0, 0.0, 1.0, 2.0]), atol=0)
    cos, sin = rotary_cos_sin(torch.tensor([[2, 5]]), 4, 100.0, torch.float64)
    assert cos.shape == (1, 2, 4)
    ang = np.array([2.0, 5.0])[:, None] * np.array([1.0, 0.1])  # θ_i = 100^(-2i/4)
    assert_close(cos[0], np.cos(np.concatenate([ang, ang], axis=1)), atol=1e-12, name="cos")
    assert_close(sin[0], np.sin(np.concatenate([ang, ang], axis=1)), atol=1e-12, name="sin")
    y = torch.randn(3, 2, 4, dtype=torch.float64)
    assert_close(apply_rotary(y, cos, sin), complex_rope(y.numpy(), [2, 5], 100.0), atol=1e-12)


def test_rope_errors():
    with pytest.raises(ValueError, match=r"d_head must be a positive even int .* got 7"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="base must be a positive number, got -1"):
        RotaryEmbedding(8, base=-1)
    with pytest.raises(ValueError, match="max_len must be a positive int, got 0"):
        RotaryEmbedding(8, max_len=0)
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"x must have shape \(B, H, T, D=8\), got \(1, 2, 3, 6\)"):
        rope(torch.zeros(1, 2, 3, 6))
    with pytest.raises(TypeError, match="x must be a floating-point Tensor"):
        rope(torch.zeros(1, 2, 3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="offset must be a non-negative int, got -1"):
        rope(torch.zeros(1, 2, 3, 8), offset=-1)
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        rope(torch.zeros(1, 2, 3, 8), positions=torch.zeros(3))
    with pytest.raises(ValueError, match=r"positions must have shape \(T,\) or \(B, T\).*\(2, 3\)"):
        rope(torch.zeros(1, 2, 3, 8), positions=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"positions must have shape .* got \(4,\)"):
        rope(torch.zeros(1, 2, 3, 8), positions=torch.arange(4))
    with pytest.raises(ValueError, match=r"even last dimension, got shape \(3,\)"):
        rotate_half(torch.zeros(3))
    with pytest.raises(ValueError, match=r"cos and sin must share a shape ending in D=4"):
        apply_rotary(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 2))
    with pytest.raises(TypeError, match="positions must be a Tensor, got list"):
        rotary_cos_sin([0, 1], 4)


# ---------------------------------------------------------------- ALiBi


def bloom_slopes(n: int) -> list[float]:
    """Hugging Face BLOOM's rule: powers of base for the closest power of two, odd powers after."""
    closest = 2 ** math.floor(math.log2(n))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base**k for k in range(1, closest + 1)]
    extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
    slopes += [extra_base**k for k in range(1, 1 + 2 * (n - closest), 2)]
    return slopes


def test_alibi_slopes_paper_and_bloom_rule():
    assert alibi_slopes(8).tolist() == [1 / 2**k for k in range(1, 9)]
    s12 = alibi_slopes(12, dtype=torch.float64)
    expected12 = [2.0**-k for k in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    assert_close(s12, expected12, atol=1e-15, name="12 heads")
    for n in [1, 2, 3, 5, 6, 7, 12, 16, 20, 31, 32, 40, 64]:
        assert_close(alibi_slopes(n, dtype=torch.float64), bloom_slopes(n), atol=1e-15, name=f"{n}")
    assert alibi_slopes(5).dtype == torch.float32


def test_alibi_bias_small_example_and_symmetric():
    b = alibi_bias(2, 2, 4)  # slopes 1/16, 1/256; queries at positions 2, 3
    d = torch.tensor([[2.0, 1.0, 0.0, -1.0], [3.0, 2.0, 1.0, 0.0]])
    assert_close(b, torch.stack([-d / 16, -d / 256]), atol=0, name="bias")
    assert_close(alibi_bias(2, 2, 4, offset=0)[0], -(d - 2) / 16, atol=0, name="offset 0")
    sym = alibi_bias(3, 5, 5, symmetric=True, dtype=torch.float64)
    assert_close(sym, sym.transpose(1, 2), atol=0, name="symmetric is symmetric")
    assert (sym <= 0).all() and (sym.diagonal(dim1=1, dim2=2) == 0).all()
    assert_close(sym[0, 0], -alibi_slopes(3)[0].double() * torch.arange(5.0), atol=1e-12)
    # Decoding one token after 9 cached ones = the last row of the full bias.
    assert_close(alibi_bias(4, 1, 10), alibi_bias(4, 10, 10)[:, -1:], atol=0, name="decode")


def test_alibi_gives_bloom_attention_under_causal_mask():
    H, T = 6, 9
    scores = torch.randn(H, T, T, dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ours = (scores + alibi_bias(H, T, T, dtype=torch.float64)).masked_fill(~causal, -math.inf)
    bloom = torch.tensor(bloom_slopes(H), dtype=torch.float64)[:, None, None] * torch.arange(T)
    theirs = (scores + bloom).masked_fill(~causal, -math.inf)  # BLOOM adds +m·j
    assert_close(ours.softmax(-1), theirs.softmax(-1), atol=1e-12, name="softmax weights")


def test_alibi_module():
    m = ALiBi(12)
    assert m.state_dict() == {}, "slopes are a function of num_heads, not state"
    assert_close(m.slopes, alibi_slopes(12), atol=0)
    assert_close(m.bias(3, 7), alibi_bias(12, 3, 7), atol=0)
    assert_close(m(3, 7, 1, symmetric=True), alibi_bias(12, 3, 7, offset=1, symmetric=True), atol=0)
    assert m.half().bias(2, 2, dtype=torch.float64).dtype == torch.float64


def test_alibi_errors():
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        alibi_slopes(0)
    with pytest.raises(ValueError, match=r"num_heads must be a positive int, got 2\.0"):
        ALiBi(2.0)
    with pytest.raises(ValueError, match=r"T must be a non-negative int, got -1"):
        alibi_bias(2, -1, 3)
    with pytest.raises(ValueError, match=r"offset must be an int or None, got 0\.5"):
        alibi_bias(2, 1, 3, offset=0.5)
