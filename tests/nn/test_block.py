"""TransformerBlock: equals torch's encoder/decoder layers with copied weights (post- and
pre-norm, forward and backward), composes the documented formula for RMSNorm/SwiGLU, decodes
incrementally with a cache, and rejects bad arguments with clear messages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import TOL, assert_close
from qkv.nn import KVCache, RotaryEmbedding, TransformerBlock

E, H, FF, B, T, S = 36, 4, 52, 3, 13, 11
DTYPES = [torch.float64, torch.float32]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def copy_attention(ours, mha):
    """torch MultiheadAttention (packed in_proj) -> qkv Attention (q/k/v/out_proj)."""
    w = mha.in_proj_weight.detach().chunk(3)
    b = mha.in_proj_bias.detach().chunk(3)
    with torch.no_grad():
        for proj, wi, bi in zip((ours.q_proj, ours.k_proj, ours.v_proj), w, b, strict=True):
            proj.weight.copy_(wi)
            proj.bias.copy_(bi)
        ours.out_proj.weight.copy_(mha.out_proj.weight)
        ours.out_proj.bias.copy_(mha.out_proj.bias)


def copy_torch_layer(block, layer):
    """torch Transformer{Encoder,Decoder}Layer -> TransformerBlock: attention, FFN, norms."""
    copy_attention(block.self_attn, layer.self_attn)
    norms = [(block.attn_norm, layer.norm1)]
    if block.cross_attn is not None:
        copy_attention(block.cross_attn, layer.multihead_attn)
        norms += [(block.cross_norm, layer.norm2), (block.ffn_norm, layer.norm3)]
    else:
        norms += [(block.ffn_norm, layer.norm2)]
    pairs = [(block.ffn.linear1, layer.linear1), (block.ffn.linear2, layer.linear2), *norms]
    with torch.no_grad():
        for ours, ref in pairs:
            ours.weight.copy_(ref.weight)
            ours.bias.copy_(ref.bias)


def _pair(cross, norm, activation, dtype):
    torch.manual_seed(0)
    kw = dict(dim_feedforward=FF, dropout=0.0, activation=activation, batch_first=True,
              norm_first=norm == "pre", dtype=dtype)
    layer_cls = torch.nn.TransformerDecoderLayer if cross else torch.nn.TransformerEncoderLayer
    ref = layer_cls(E, H, **kw)
    ours = TransformerBlock(E, H, FF, activation=activation, norm=norm,
                            cross_attention=cross).to(dtype)
    copy_torch_layer(ours, ref)
    # Training mode with dropout 0: torch's general path (no fused fast path), same math.
    return ref.train(), ours.train()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_block_equals_torch_encoder_layer(dtype, norm, activation):
    ref, ours = _pair(False, norm, activation, dtype)
    x = torch.randn(B, T, E, generator=_gen(1), dtype=dtype)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -4:] = True  # torch polarity: True = padding
    xs = [x.clone().requires_grad_() for _ in range(2)]
    out_ref = ref(xs[0], src_key_padding_mask=pad)
    out = ours(xs[1], mask=~pad[:, None, None, :])
    assert_close(out, out_ref, **TOL[dtype], name="block output")
    g = torch.randn(out.shape, generator=_gen(2), dtype=dtype)
    out_ref.backward(g)
    out.backward(g)
    assert_close(xs[1].grad, xs[0].grad, **TOL[dtype], name="input gradient")
    assert_close(ours.ffn.linear1.weight.grad, ref.linear1.weight.grad, **TOL[dtype],
                 name="linear1 gradient")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_block_equals_torch_decoder_layer(dtype, norm):
    ref, ours = _pair(True, norm, "relu", dtype)
    y = torch.randn(B, T, E, generator=_gen(3), dtype=dtype)
    mem = torch.randn(B, S, E, generator=_gen(4), dtype=dtype)
    mem_pad = torch.zeros(B, S, dtype=torch.bool)
    mem_pad[1, -5:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(T, dtype=dtype)
    ys = [y.clone().requires_grad_() for _ in range(2)]
    ms = [mem.clone().requires_grad_() for _ in range(2)]
    out_ref = ref(ys[0], ms[0], tgt_mask=causal, memory_key_padding_mask=mem_pad,
                  tgt_is_causal=True)
    out = ours(ys[1], ms[1], is_causal=True, context_mask=~mem_pad[:, None, None, :])
    assert_close(out, out_ref, **TOL[dtype], name="decoder block output")
    g = torch.randn(out.shape, generator=_gen(5), dtype=dtype)
    out_ref.backward(g)
    out.backward(g)
    assert_close(ys[1].grad, ys[0].grad, **TOL[dtype], name="target gradient")
    assert_close(ms[1].grad, ms[0].grad, **TOL[dtype], name="memory gradient")


def test_rmsnorm_swiglu_gqa_block_matches_its_formula():
    """Pre-norm x + attn(rms(x)), then + swiglu(rms(.)), written out by hand."""
    torch.manual_seed(0)
    blk = TransformerBlock(E, 6, FF, num_kv_heads=2, d_head=8, activation="swiglu",
                           norm="pre", norm_kind="rmsnorm", norm_eps=1e-6, bias=False).double()
    x = torch.randn(B, T, E, generator=_gen(6), dtype=torch.float64)
    a = blk.self_attn

    def rms(h, w):
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    h = rms(x, blk.attn_norm.weight)
    q = (h @ a.q_proj.weight.T).view(B, T, 6, 8).transpose(1, 2)  # (B, H, T, D)
    k = (h @ a.k_proj.weight.T).view(B, T, 2, 8).transpose(1, 2)  # (B, Hkv, T, D)
    v = (h @ a.v_proj.weight.T).view(B, T, 2, 8).transpose(1, 2)  # (B, Hkv, T, D)
    k, v = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)  # (B, H, T, D)
    scores = q @ k.transpose(-1, -2) / 8**0.5  # (B, H, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 48)  # (B, T, H·D)
    x1 = x + att @ a.out_proj.weight.T
    h = rms(x1, blk.ffn_norm.weight)
    f = blk.ffn
    gated = F.silu(h @ f.gate_proj.weight.T) * (h @ f.up_proj.weight.T)
    expected = x1 + gated @ f.down_proj.weight.T
    assert_close(blk(x, is_causal=True), expected, **TOL[torch.float64], name="block")


@pytest.mark.parametrize("rope", [False, True])
def test_cached_decoding_equals_full_block(rope):
    """Self-attention keys appended, cross-attention keys stored once: same as all at once."""
    torch.manual_seed(0)
    blk = TransformerBlock(E, 6, FF, norm="pre", cross_attention=True,
                           rope=RotaryEmbedding(E // 6) if rope else None).double().eval()
    y = torch.randn(B, T, E, generator=_gen(7), dtype=torch.float64)
    mem = torch.randn(B, S, E, generator=_gen(8), dtype=torch.float64)
    full = blk(y, mem, is_causal=True)
    cache = KVCache(1)
    steps = [blk(y[:, t : t + 1], mem, is_causal=True, cache=cache[0]) for t in range(T)]
    assert_close(torch.cat(steps, 1), full, **TOL[torch.float64], name="cached decoding")
    assert cache.length == T and cache[0].static is not None


def test_dropout_is_active_in_training_only():
    blk = TransformerBlock(E, H, FF, dropout=0.5)
    x = torch.randn(B, T, E, generator=_gen(9))
    assert not torch.equal(blk.train()(x), blk(x))
    blk.eval()
    assert torch.equal(blk(x), blk(x))


def test_submodule_names_and_repr():
    dec = TransformerBlock(E, H, FF, cross_attention=True, activation="swiglu")
    names = {n for n, _ in dec.named_children() if not n.startswith("hook_")}  # hook points: tests/inspect
    assert names == {"self_attn", "attn_norm", "cross_attn", "cross_norm", "ffn", "ffn_norm",
                     "dropout"}
    enc = TransformerBlock(E, H, FF)
    assert enc.cross_attn is None and enc.cross_norm is None
    assert "norm='post', cross_attention=False" in repr(enc)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(norm="middle"), r"norm must be one of \('post', 'pre'\), got 'middle'"),
        (dict(norm_kind="batchnorm"), r"norm kind must be one of .*got 'batchnorm'"),
        (dict(activation="tanh"), r"feed-forward kind must be one of .*got 'tanh'"),
        (dict(dropout=1.0), r"dropout must be a number in \[0, 1\), got 1.0"),
        (dict(num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    ],
)
def test_bad_construction_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerBlock(E, H, FF, **kwargs)


def test_context_must_match_cross_attention():
    x = torch.randn(B, T, E)
    with pytest.raises(ValueError, match="has no cross-attention, so it takes no context"):
        TransformerBlock(E, H, FF)(x, x)
    with pytest.raises(ValueError, match=r"has cross-attention, so it needs a context"):
        TransformerBlock(E, H, FF, cross_attention=True)(x)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, E=36\), got \(3, 13, 5\)"):
        TransformerBlock(E, H, FF)(torch.randn(B, T, 5))
