"""Generic attention options of today's models, each against a plain-torch reference.

``scale``, per-projection biases (``qkv_bias``, ``k_bias``, ``out_bias``), ``qk_norm``, the
sliding ``window`` (with rolling and full KV caches), ``softcap``; the GeGLU feed-forward; the
block's ``sandwich_norm``; RoPE scaling (vs transformers' own frequency functions) and partial
rotary. The reference below is written from the formulas, not from qkv's code.
"""

from __future__ import annotations

import math

import pytest
import torch

import qkv.inspect as qi
from helpers import TOL, assert_close
from qkv.nn import Attention, KVCache, LayerKVCache, TransformerBlock, make_feedforward
from qkv.nn.feedforward import GeGLU
from qkv.nn.rope import RotaryEmbedding
from qkv.nn.rope_scaling import RopeScaling, inverse_frequencies

E, H, B, T = 24, 4, 2, 9


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _linear(x, lin):
    return x @ lin.weight.T + (0 if lin.bias is None else lin.bias)


def _norm(kind, x, eps):
    if kind == "rmsnorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)


def _rotate(x, pos, base=10000.0, dim=None):
    """RoPE of the first ``dim`` columns, rotate-half pairs (i, i + dim/2), by the formula."""
    d = x.shape[-1] if dim is None else dim
    i = torch.arange(d // 2, dtype=torch.float64)
    ang = pos[:, None].double() * base ** (-2 * i / d)  # (T, d/2)
    a, b = x[..., : d // 2], x[..., d // 2 : d]
    c, s = ang.cos(), ang.sin()
    return torch.cat((a * c - b * s, b * c + a * s, x[..., d:]), -1)


def reference(attn: Attention, x, *, window=None, causal=True, pos=None, rope=False):
    """Output and weights of ``attn`` on ``x (B, T, E)``, computed from the formulas."""
    Bx, Tx, _ = x.shape
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.d_head
    q = _linear(x, attn.q_proj).view(Bx, Tx, Hq, D).transpose(1, 2)
    k = _linear(x, attn.k_proj).view(Bx, Tx, Hkv, D).transpose(1, 2)
    v = _linear(x, attn.v_proj).view(Bx, Tx, Hkv, D).transpose(1, 2)
    if attn.qk_norm is not None:
        eps = attn.q_norm.eps
        q = _norm(attn.qk_norm, q, eps) * attn.q_norm.weight + getattr(attn.q_norm, "bias", 0)
        k = _norm(attn.qk_norm, k, eps) * attn.k_norm.weight + getattr(attn.k_norm, "bias", 0)
    if rope:
        p = torch.arange(Tx) if pos is None else pos
        q, k = _rotate(q, p), _rotate(k, p)
    k = k.repeat_interleave(Hq // Hkv, 1)
    v = v.repeat_interleave(Hq // Hkv, 1)
    scale = attn.scale if attn.scale is not None else 1 / math.sqrt(D)
    scores = q @ k.transpose(-1, -2) * scale
    if attn.softcap is not None:
        scores = attn.softcap * torch.tanh(scores / attn.softcap)
    i, j = torch.arange(Tx)[:, None], torch.arange(Tx)[None]
    keep = torch.ones(Tx, Tx, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= j > i - window
    w = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
    out = (w @ v).transpose(1, 2).reshape(Bx, Tx, Hq * D)
    return _linear(out, attn.out_proj), w


def _module(seed=0, **kw) -> Attention:
    torch.manual_seed(seed)
    m = Attention(E, H, **kw).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3, generator=_gen(seed + p.numel()))
    return m


OPTIONS = [
    dict(),
    dict(scale=1.0),
    dict(scale=0.05, num_kv_heads=2),
    dict(window=1),
    dict(window=3, num_kv_heads=1),
    dict(window=T + 4),
    dict(softcap=1.5),
    dict(softcap=0.7, window=4, scale=0.4),
    dict(qk_norm="rmsnorm", norm_eps=1e-6),
    dict(qk_norm="layernorm", num_kv_heads=2, window=2),
    dict(bias=False, qkv_bias=True),
    dict(bias=True, k_bias=False, out_bias=False, softcap=3.0),
]


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
                         or "default")  # fmt: skip
@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
def test_options_match_the_formulas(kw, rope):
    extra = {"rope": RotaryEmbedding(E // H)} if rope else {}
    attn = _module(**kw, **extra)
    x = torch.randn(B, T, E, generator=_gen(1), dtype=torch.float64, requires_grad=True)
    out, w = attn(x, is_causal=True, need_weights=True)
    ref_out, ref_w = reference(attn, x, window=kw.get("window"), rope=rope)
    assert_close(out, ref_out, **TOL[torch.float64], name=f"output {kw}")
    assert_close(w, ref_w, **TOL[torch.float64], name=f"weights {kw}")
    # Backward through every option, against autograd on the reference.
    g = torch.randn(B, T, E, generator=_gen(2), dtype=torch.float64)
    params = [x, *attn.parameters()]
    ours = torch.autograd.grad(out, params, g)
    theirs = torch.autograd.grad(ref_out, params, g)
    for n, a, e in zip(["x", *(n for n, _ in attn.named_parameters())], ours, theirs, strict=True):
        assert_close(a, e, atol=1e-9, name=f"grad {n} {kw}")


@pytest.mark.parametrize(("kw", "present"), [
    (dict(bias=True), (True, True, True, True)),
    (dict(bias=False), (False, False, False, False)),
    (dict(bias=False, qkv_bias=True), (True, True, True, False)),  # Qwen2
    (dict(bias=True, k_bias=False), (True, False, True, True)),  # Whisper
    (dict(bias=True, out_bias=False), (True, True, True, False)),
    (dict(bias=False, qkv_bias=True, k_bias=False, out_bias=True), (True, False, True, True)),
])
def test_bias_overrides_choose_each_projection(kw, present):
    attn = Attention(E, H, **kw)
    names = ("q_proj", "k_proj", "v_proj", "out_proj")
    got = tuple(getattr(attn, n).bias is not None for n in names)
    assert got == present, f"{kw}: biases of {names} are {got}, expected {present}"


def test_scale_and_softcap_change_what_they_should():
    x = torch.randn(B, T, E, generator=_gen(3), dtype=torch.float64)
    plain = _module()
    for kw in (dict(scale=1.0), dict(softcap=0.5)):
        other = _module(**kw)
        other.load_state_dict(plain.state_dict())
        diff = (other(x, is_causal=True)[0] - plain(x, is_causal=True)[0]).abs().max()
        assert diff > 1e-3, f"{kw} left the output unchanged (max change {diff:.2e})"


@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "full"])
@pytest.mark.parametrize("window", [1, 3, 5])
@pytest.mark.parametrize("prefill", [1, 4, 7])
def test_window_with_a_cache_equals_recompute(rolling, window, prefill):
    attn = _module(window=window, num_kv_heads=2, softcap=2.0 if window == 3 else None,
                   rope=RotaryEmbedding(E // H))  # fmt: skip
    x = torch.randn(B, T + 3, E, generator=_gen(4), dtype=torch.float64)
    full, _ = attn(x, is_causal=True)
    cache = LayerKVCache(window=window if rolling else None)
    steps = [attn(x[:, :prefill], is_causal=True, cache=cache)[0]]
    for t in range(prefill, x.shape[1]):
        steps.append(attn(x[:, t : t + 1], is_causal=True, cache=cache)[0])
    assert_close(torch.cat(steps, 1), full, **TOL[torch.float64],
                 name=f"cached decoding, window={window}, prefill={prefill}")  # fmt: skip
    assert cache.length == x.shape[1]
    assert cache.held == (min(window, x.shape[1]) if rolling else x.shape[1])


def test_rolling_cache_cuts_a_full_padding_mask():
    attn = _module(window=3)
    x = torch.randn(B, 8, E, generator=_gen(5), dtype=torch.float64)
    keep = torch.ones(B, 8, dtype=torch.bool)
    keep[1, :2] = False  # row 1 is left-padded by two
    full, _ = attn(x, is_causal=True, mask=keep[:, None, None, :])
    cache = LayerKVCache(window=3)
    steps = [attn(x[:, :4], is_causal=True, cache=cache, mask=keep[:, None, None, :4])[0]]
    for t in range(4, 8):
        step_mask = keep[:, None, None, : t + 1]  # over every position so far
        steps.append(attn(x[:, t : t + 1], is_causal=True, cache=cache, mask=step_mask)[0])
    assert_close(torch.cat(steps, 1), full, **TOL[torch.float64], name="rolling + padding")


def test_rolling_cache_bookkeeping():
    c = LayerKVCache(window=3)
    k = torch.arange(5.0).view(1, 1, 5, 1)
    ks, _ = c.update(k, k)
    assert ks.shape[2] == 5 and (c.length, c.held) == (5, 3)
    ks, _ = c.update(k[:, :, :1] + 10, k[:, :, :1])
    assert ks.flatten().tolist() == [2.0, 3.0, 4.0, 10.0], "held positions then the new one"
    assert "window=3" in repr(c)
    with pytest.raises(ValueError, match=r"crop: n must be an int in \[3, 6\], got 1 \(a rolling"):
        c.crop(1)
    c.crop(5)
    assert (c.length, c.held) == (5, 2)
    c.reorder([0, 0])
    assert c.update(k[:, :, :1].expand(2, 1, 1, 1), k[:, :, :1].expand(2, 1, 1, 1))[0].shape == (
        2, 1, 3, 1)  # fmt: skip
    with pytest.raises(ValueError, match="window must be a positive int or None, got 0"):
        LayerKVCache(window=0)
    with pytest.raises(ValueError, match=r"windows must hold one entry per layer \(2\)"):
        KVCache(2, windows=[3])
    assert [layer.window for layer in KVCache(2, windows=[4, None])] == [4, None]


def test_capture_gives_exact_weights_for_window_and_softcap():
    attn = _module(window=3, softcap=1.2, num_kv_heads=2)
    x = torch.randn(B, T, E, generator=_gen(6), dtype=torch.float64)
    _, ref_w = reference(attn, x, window=3)
    with qi.capture(attn) as cap, torch.no_grad():
        attn(x, is_causal=True)
    w = cap[0]
    assert_close(w, ref_w, **TOL[torch.float64], name="captured weights")
    assert_close(w.sum(-1), torch.ones_like(w.sum(-1)), **TOL[torch.float64], name="row sums")
    plain = _module(window=2)
    with qi.capture(plain, rows=-1, heads=[1]) as cap, torch.no_grad():
        plain(x, is_causal=True)
    assert_close(cap[0], reference(plain, x, window=2)[1][:, 1:2, -1:], **TOL[torch.float64],
                 name="captured weights, one head, last row, window without softcap")


@pytest.mark.parametrize(("kw", "call", "error", "match"), [
    (dict(window=0), {}, ValueError, "window must be a positive int, got 0"),
    (dict(scale=0.0), {}, ValueError, "scale must be a finite number > 0 or None, got 0.0"),
    (dict(softcap=float("inf")), {}, ValueError, "softcap must be a finite number > 0"),
    (dict(qk_norm="batchnorm"), {}, ValueError, r"qk_norm must be None or one of \('layernorm'"),
    (dict(qkv_bias=1), {}, TypeError, "qkv_bias must be a bool or None, got 1"),
    (dict(window=2), dict(is_causal=False), ValueError, "sliding window .* call it with "
                                                        "is_causal=True"),
    (dict(window=2), dict(is_causal=True, context=True), ValueError,
     "rope, alibi and a sliding window .* cannot be called with a context"),
])
def test_bad_options_say_what_is_wrong(kw, call, error, match):
    with pytest.raises(error, match=match):
        attn = Attention(E, H, **kw)
        x = torch.randn(1, 3, E)
        context = x if call.pop("context", False) else None
        attn(x, context, **call)


def test_geglu_matches_its_formula_forward_and_backward():
    m = make_feedforward("geglu", 8, 13).double()
    assert isinstance(m, GeGLU) and m.gate_proj.bias is None
    x = torch.randn(3, 5, 8, generator=_gen(7), dtype=torch.float64, requires_grad=True)
    g = _linear(x, m.gate_proj)
    gelu_tanh = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    ref = _linear(gelu_tanh * _linear(x, m.up_proj), m.down_proj)
    out = m(x)
    assert_close(out, ref, **TOL[torch.float64], name="GeGLU")
    params = [x, *m.parameters()]
    for a, e in zip(torch.autograd.grad(out.sum(), params), torch.autograd.grad(ref.sum(), params),
                    strict=True):  # fmt: skip
        assert_close(a, e, atol=1e-10, name="GeGLU grad")


def test_sandwich_norm_block_matches_its_formula():
    torch.manual_seed(8)
    blk = TransformerBlock(E, H, 40, norm="pre", norm_kind="rmsnorm", activation="geglu",
                           bias=False, sandwich_norm=True, window=3, softcap=5.0,
                           scale=0.3).double().eval()  # fmt: skip
    with torch.no_grad():
        for name, p in blk.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=_gen(len(name)))
    x = torch.randn(B, T, E, generator=_gen(9), dtype=torch.float64)

    def rms(norm, h):
        return _norm("rmsnorm", h, norm.eps) * norm.weight

    a, _ = reference(blk.self_attn, rms(blk.attn_norm, x), window=3)
    h = x + rms(blk.attn_out_norm, a)
    f = blk.ffn(rms(blk.ffn_norm, h))
    ref = h + rms(blk.ffn_out_norm, f)
    assert_close(blk(x, is_causal=True), ref, **TOL[torch.float64], name="sandwich block")
    with pytest.raises(ValueError, match="sandwich_norm must be a bool, True only with norm='pre'"):
        TransformerBlock(E, H, 40, norm="post", sandwich_norm=True)


def _hf_rope(kind, params, dim, base, max_pos, seq_len=None):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=dim * 2, num_attention_heads=2, head_dim=dim, max_position_embeddings=max_pos,
        rope_parameters={"rope_type": kind, "rope_theta": base, **params},
    )  # fmt: skip
    inv, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    return inv.double(), factor


ROPE_CASES = [
    ("linear", dict(factor=4.0), {}),
    ("dynamic", dict(factor=2.0), dict(seq_len=300)),
    ("dynamic", dict(factor=3.0), dict(seq_len=64)),
    ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64), {}),
    ("yarn", dict(factor=4.0, original_max_position_embeddings=64), {}),
    ("yarn", dict(factor=16.0, beta_fast=16.0, beta_slow=2.0, attention_factor=1.3,
                  original_max_position_embeddings=128), {}),
]


@pytest.mark.parametrize(("kind", "params", "call"), ROPE_CASES, ids=lambda v: str(v)[:30])
@pytest.mark.parametrize("dim", [16, 64])
def test_rope_scaling_frequencies_match_transformers(kind, params, call, dim):
    base, max_pos = 10000.0, 128
    ref, ref_factor = _hf_rope(kind, dict(params), dim, base, max_pos, **call)
    original = params.pop("original_max_position_embeddings", max_pos)
    scaling = RopeScaling(kind, original_max_len=original, **params)
    ours = inverse_frequencies(dim, base, scaling, call.get("seq_len"))
    # transformers computes in float32: 1e-6 relative.
    assert_close(ours, ref, atol=0, rtol=2e-6, name=f"{kind} frequencies")
    assert math.isclose(scaling.cos_sin_factor, ref_factor, rel_tol=1e-12), (
        f"{kind}: cos/sin factor {scaling.cos_sin_factor} vs {ref_factor}")


@pytest.mark.parametrize("rotary_dim", [None, 4, 6])
@pytest.mark.parametrize("kind", [None, "linear", "dynamic", "yarn"])
def test_rotary_embedding_with_scaling_and_partial_rotary(rotary_dim, kind):
    D, n = 8, 5
    scaling = None if kind is None else RopeScaling(kind, factor=2.0, original_max_len=n)
    rope = RotaryEmbedding(D, base=100.0, scaling=scaling, rotary_dim=rotary_dim)
    x = torch.randn(2, 3, 9, D, generator=_gen(10), dtype=torch.float32)
    d = rotary_dim or D
    for offset in (0, 3):
        T = x.shape[2]
        length = offset + T
        theta = inverse_frequencies(d, 100.0, scaling, length)
        pos = torch.arange(offset, offset + T, dtype=torch.float64)
        ang = pos[:, None] * theta  # (T, d/2)
        factor = 1.0 if scaling is None else scaling.cos_sin_factor
        c, s = ang.cos() * factor, ang.sin() * factor
        xd = x.double()
        a, b = xd[..., : d // 2], xd[..., d // 2 : d]
        ref = torch.cat((a * c - b * s, b * c + a * s, xd[..., d:]), -1)
        assert_close(rope(x, offset=offset), ref, atol=2e-6, name=f"rope {kind} offset={offset}")
        explicit = rope(x, positions=torch.arange(offset, offset + T))
        assert_close(explicit, ref, atol=2e-6, name=f"rope {kind} positions")


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match=r"kind must be one of \('linear', 'dynamic', 'llama3', "):
        RopeScaling("longrope")
    with pytest.raises(ValueError, match="'yarn' needs original_max_len"):
        RopeScaling("yarn", factor=2.0)
    with pytest.raises(ValueError, match="factor must be a finite number > 0, got 0"):
        RopeScaling("linear", factor=0)
    with pytest.raises(ValueError, match=r"unknown keys \['type'\]"):
        RopeScaling.from_dict({"kind": "linear", "type": "x"})
    with pytest.raises(ValueError, match=r"rotary_dim must be None or an even int in \[2, d_head=8"):
        RotaryEmbedding(8, rotary_dim=5)
    s = RopeScaling("llama3", factor=8.0, original_max_len=64)
    assert RopeScaling.from_dict(s.to_dict()) == s
