"""qkv.nn.MultiheadAttention is a drop-in for torch.nn.MultiheadAttention.

Every case builds torch's module, loads its state_dict into qkv's (strict), runs both on the
same inputs and compares outputs, weights and the gradients of inputs and parameters. Train
mode with dropout=0 runs torch's general path; one test checks eval mode against torch's
inference fast path.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import DEVICE, TOL, assert_close
from qkv.nn.multihead import MultiheadAttention

N, T, S = 3, 13, 29
DTYPES = [torch.float64, torch.float32]

# Constructor grid: every option torch has (E=24, H=4 unless said), plus head dim 59.
CONFIGS = {
    "default": {},
    "batch_first": {"batch_first": True},
    "kdim_vdim": {"kdim": 16, "vdim": 20},
    "no_bias": {"bias": False},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "all_extras": {"add_bias_kv": True, "add_zero_attn": True, "kdim": 16, "vdim": 20,
                   "batch_first": True, "bias": False},
    "head_dim_59": {"embed_dim": 118, "num_heads": 2},
}

# Forward grid: mask kinds (torch polarity: bool True = ignore) and return options.
CASES = {
    "plain": {},
    "self_attention": {"self": True},
    "no_weights": {"need_weights": False},
    "per_head": {"average_attn_weights": False},
    "kpm_bool": {"kpm": "bool"},
    "kpm_float": {"kpm": "float", "average_attn_weights": False},
    "mask2d_bool": {"mask": "2d_bool", "need_weights": False},
    "mask3d_float": {"mask": "3d_float"},
    "mask2d_float_kpm_bool": {"mask": "2d_float", "kpm": "bool"},
    "mask3d_bool_kpm_float": {"mask": "3d_bool", "kpm": "float", "need_weights": False},
    "causal_hint": {"mask": "causal", "is_causal": True, "need_weights": False},
    "causal_hint_weights": {"mask": "causal", "is_causal": True},
    "causal_hint_kpm": {"mask": "causal", "is_causal": True, "kpm": "bool",
                        "need_weights": False},
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pair(dtype, **config):
    """torch's module and qkv's with torch's weights loaded (strict)."""
    E, H = config.pop("embed_dim", 24), config.pop("num_heads", 4)
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, dtype=dtype, **config)
    ours = MultiheadAttention(E, H, dtype=dtype, **config)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _mask(kind, N, H, T, S, dtype):
    """A torch-polarity mask of ``kind``; column 0 always visible so no row is fully hidden."""
    g = _gen(3)
    lead = (T, S) if kind.startswith("2d") else (N * H, T, S)
    if kind == "causal":
        return torch.ones(T, S, dtype=torch.bool).triu(1)  # (T, S), top-left
    if kind.endswith("bool"):
        m = torch.rand(lead, generator=g) < 0.3
        m[..., 0] = False
        return m
    m = torch.randn(lead, generator=g, dtype=dtype)
    m[torch.rand(lead, generator=g) < 0.2] = float("-inf")
    m[..., 0] = 0.0
    return m


def _padding(kind, N, S, dtype):
    g = _gen(4)
    if kind == "bool":
        m = torch.rand(N, S, generator=g) < 0.4
    else:
        m = torch.randn(N, S, generator=g, dtype=dtype)
        m[torch.rand(N, S, generator=g) < 0.3] = float("-inf")
    m[:, 0] = False if kind == "bool" else 0.0
    return m


def _inputs(module, case, dtype, T=T, S=S, batched=True):
    """Leaf tensors, the (query, key, value) built from them, and forward kwargs."""
    g = _gen(1)
    shape = (lambda L, w: (N, L, w)) if module.batch_first else (lambda L, w: (L, N, w))
    if not batched:
        shape = lambda L, w: (L, w)  # noqa: E731
    if case.get("self"):
        S = T
        x = torch.randn(shape(T, module.embed_dim), generator=g, dtype=dtype)
        leaves, qkv = [x], (0, 0, 0)
    else:
        leaves = [
            torch.randn(shape(T, module.embed_dim), generator=g, dtype=dtype),
            torch.randn(shape(S, module.kdim), generator=g, dtype=dtype),
            torch.randn(shape(S, module.vdim), generator=g, dtype=dtype),
        ]
        qkv = (0, 1, 2)
    kwargs = {k: v for k, v in case.items() if k in
              ("need_weights", "average_attn_weights", "is_causal")}
    if "mask" in case:
        kwargs["attn_mask"] = _mask(case["mask"], N if batched else 1, module.num_heads, T, S,
                                    dtype)
    if "kpm" in case:
        kpm = _padding(case["kpm"], N, S, dtype)
        kwargs["key_padding_mask"] = kpm if batched else kpm[0]
    return leaves, qkv, kwargs


def _run(module, leaves, qkv, kwargs):
    """Output, weights, and gradients of a random projection of both (inputs, then params)."""
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    out, weights = module(*(leaves[i] for i in qkv), **kwargs)
    loss = (out * torch.randn(out.shape, generator=_gen(7), dtype=out.dtype)).sum()
    if weights is not None:
        loss = loss + (weights * torch.randn(weights.shape, generator=_gen(8),
                                             dtype=weights.dtype)).sum()
    names, params = zip(*module.named_parameters(), strict=True)
    grads = torch.autograd.grad(loss, [*leaves, *params])
    labels = [f"grad input {i}" for i in range(len(leaves))] + [f"grad {n}" for n in names]
    return out, weights, dict(zip(labels, grads, strict=True))


def _compare(ref, ours, leaves, qkv, kwargs, dtype):
    tol = TOL[dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warning for mixed mask types
        r_out, r_w, r_grads = _run(ref, leaves, qkv, kwargs)
    o_out, o_w, o_grads = _run(ours, leaves, qkv, kwargs)
    assert_close(o_out, r_out, **tol, name="output")
    assert (o_w is None) == (r_w is None), "weights returned on one side only"
    if r_w is not None:
        assert_close(o_w, r_w, **tol, name="weights")
    assert o_grads.keys() == r_grads.keys()
    for name, g in r_grads.items():
        assert_close(o_grads[name], g, **tol, name=name)


def _grid(configs, cases):
    """(config, case) pairs; self-attention only where kdim == vdim == embed_dim."""
    return [
        pytest.param(c, k, id=f"{c}-{k}")
        for c in configs
        for k in cases
        if not (CASES[k].get("self") and "kdim" in CONFIGS[c])
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize(("config", "case"), _grid(CONFIGS, CASES))
def test_matches_torch(config, case, dtype):
    cfg, cs = dict(CONFIGS[config]), CASES[case]
    ref, ours = _pair(dtype, **cfg)
    leaves, qkv, kwargs = _inputs(ours, cs, dtype)
    _compare(ref, ours, leaves, qkv, kwargs, dtype)


@pytest.mark.parametrize(
    ("config", "case"),
    _grid(["default", "all_extras"],
          ["plain", "per_head", "kpm_bool", "mask3d_float", "causal_hint", "self_attention"]),
)
def test_unbatched_matches_torch(config, case):
    ref, ours = _pair(torch.float64, **CONFIGS[config])
    leaves, qkv, kwargs = _inputs(ours, CASES[case], torch.float64, batched=False)
    _compare(ref, ours, leaves, qkv, kwargs, torch.float64)


@pytest.mark.parametrize("need_weights", [True, False])
def test_eval_matches_torch_fast_path(need_weights):
    """Eval + no_grad + batch_first self-attention is where torch takes its fused fast path."""
    ref, ours = _pair(torch.float32, batch_first=True)
    ref.eval(), ours.eval()
    x = torch.randn(N, T, 24, generator=_gen(1))
    kpm = _padding("bool", N, T, torch.float32)
    with torch.no_grad():
        r_out, r_w = ref(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        o_out, o_w = ours(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
    assert_close(o_out, r_out, **TOL[torch.float32], name="output")
    if need_weights:
        assert_close(o_w, r_w, **TOL[torch.float32], name="weights")


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_state_dict_round_trip_and_init(config):
    ref, ours = _pair(torch.float32, **CONFIGS[config])
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert ours._qkv_same_embed_dim == ref._qkv_same_embed_dim
    torch.manual_seed(5)
    fresh = MultiheadAttention(**{"embed_dim": 24, "num_heads": 4, **CONFIGS[config]})
    ref.load_state_dict(fresh.state_dict(), strict=True)  # qkv -> torch
    # Same seed, same initial values as torch (same creation order and init scheme).
    torch.manual_seed(5)
    torch_fresh = torch.nn.MultiheadAttention(**{"embed_dim": 24, "num_heads": 4,
                                                 **CONFIGS[config]})
    for (name, a), b in zip(fresh.state_dict().items(), torch_fresh.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), f"{name} differs from torch's initial value"


def test_dropout_train_and_eval():
    ref, ours = _pair(torch.float32, dropout=0.5)
    leaves, qkv, kwargs = _inputs(ours, {}, torch.float32)
    q, k, v = (leaves[i] for i in qkv)
    torch.manual_seed(1)
    a, w = ours(q, k, v)
    torch.manual_seed(2)
    b, _ = ours(q, k, v)
    assert a.shape == (T, N, 24) and w.shape == (N, T, S)
    assert not torch.allclose(a, b), "dropout in train mode should change the output"
    ref.eval(), ours.eval()
    _compare(ref, ours, leaves, qkv, kwargs, torch.float32)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU qkv drops weights by its counter-"
                    "based Philox mask (docs/gpu.md), not by torch's random stream")
def test_dropout_draws_torchs_random_stream_on_the_cpu():
    """As torch: the returned weights are the ones applied, after dropout, and the same
    random stream: torch's module with the same seed gives the same output and weights."""
    ref, ours = _pair(torch.float32, dropout=0.5)
    leaves, qkv, _ = _inputs(ours, {}, torch.float32)
    q, k, v = (leaves[i] for i in qkv)
    torch.manual_seed(1)
    a, w = ours(q, k, v)
    torch.manual_seed(1)
    ra, rw = ref(q, k, v)
    assert_close(a, ra, atol=1e-5, name="dropout output vs torch, same seed")
    assert_close(w, rw, atol=1e-5, name="dropout weights vs torch, same seed")


@pytest.mark.parametrize("bias", [True, False])
def test_fully_padded_sequence_gives_zeros(bias):
    """Torch gives NaN for a sequence whose keys are all padding; qkv attends to nothing."""
    ref, ours = _pair(torch.float64, bias=bias)
    leaves, qkv, kwargs = _inputs(ours, {"kpm": "bool", "average_attn_weights": False},
                                  torch.float64)
    kwargs["key_padding_mask"][1] = True  # sequence 1: every key is padding
    out, weights, grads = _run(ours, leaves, qkv, kwargs)
    expected = ours.out_proj.bias.expand(T, 24) if bias else torch.zeros(T, 24)
    assert_close(out[:, 1], expected, atol=0.0, name="output of the padded sequence")
    assert_close(weights[1], torch.zeros(4, T, S), atol=0.0, name="weights")
    for name, g in grads.items():
        assert torch.isfinite(g).all(), f"{name} is not finite"
    with torch.no_grad():
        r_out, r_w = ref(*(leaves[i] for i in qkv), **kwargs)
    keep = [0, 2]  # the other sequences match torch
    assert_close(out[:, keep], r_out[:, keep], **TOL[torch.float64], name="other outputs")
    assert_close(weights[keep], r_w[keep], **TOL[torch.float64], name="other weights")


def _repeat_heads(w: torch.Tensor, groups: int, D: int) -> torch.Tensor:
    """Rows of Hkv heads ``(Hkv·D, ...)`` repeated so query head h reads kv head h // G."""
    return w.reshape(-1, D, *w.shape[1:]).repeat_interleave(groups, 0).reshape(-1, *w.shape[1:])


@pytest.mark.parametrize("extras", [{}, {"add_bias_kv": True, "kpm": "bool"}])
def test_grouped_query_equals_mha_with_repeated_kv(extras):
    """num_kv_heads=Hkv equals torch's MHA whose K/V projections repeat each kv head G times."""
    extras = dict(extras)
    kpm = extras.pop("kpm", None)
    ours = MultiheadAttention(24, 4, num_kv_heads=2, dtype=torch.float64, **extras)
    assert ours.k_proj_weight.shape == (12, 24) and ours.in_proj_bias.shape == (48,)
    assert ours.in_proj_weight is None and not ours._qkv_same_embed_dim
    with torch.no_grad():
        ours.in_proj_bias.normal_()
        if ours.bias_k is not None:
            ours.bias_k.normal_(), ours.bias_v.normal_()
    ref = torch.nn.MultiheadAttention(24, 4, dtype=torch.float64, **extras)
    b_q, b_k, b_v = ours.in_proj_bias.detach().split([24, 12, 12])
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj_weight,
                                            _repeat_heads(ours.k_proj_weight, 2, 6),
                                            _repeat_heads(ours.v_proj_weight, 2, 6)]))
        ref.in_proj_bias.copy_(torch.cat([b_q, _repeat_heads(b_k, 2, 6),
                                          _repeat_heads(b_v, 2, 6)]))
        ref.out_proj.load_state_dict(ours.out_proj.state_dict())
        if ours.bias_k is not None:
            ref.bias_k.copy_(_repeat_heads(ours.bias_k[0, 0], 2, 6)[None, None])
            ref.bias_v.copy_(_repeat_heads(ours.bias_v[0, 0], 2, 6)[None, None])
    case = {"average_attn_weights": False, **({"kpm": kpm} if kpm else {})}
    leaves, qkv, kwargs = _inputs(ours, case, torch.float64)
    r_out, r_w, r_grads = _run(ref, leaves, qkv, kwargs)
    o_out, o_w, o_grads = _run(ours, leaves, qkv, kwargs)
    assert_close(o_out, r_out, **TOL[torch.float64], name="output")
    assert_close(o_w, r_w, **TOL[torch.float64], name="weights")
    for i in range(3):
        name = f"grad input {i}"
        assert_close(o_grads[name], r_grads[name], **TOL[torch.float64], name=name)


def _module_and_inputs(**config):
    m = MultiheadAttention(24, 4, **config)
    x = torch.randn(T, N, 24)
    return m, x, torch.randn(S, N, m.kdim), torch.randn(S, N, m.vdim)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"embed_dim": 0, "num_heads": 4}, ValueError, "embed_dim must be a positive int"),
        ({"embed_dim": 24, "num_heads": 5}, ValueError, "divisible by num_heads"),
        ({"embed_dim": 24, "num_heads": 4, "num_kv_heads": 3}, ValueError,
         "num_kv_heads must divide num_heads"),
        ({"embed_dim": 24, "num_heads": 4, "dropout": 1.5}, ValueError, "dropout must be"),
        ({"embed_dim": 24, "num_heads": 4, "kdim": -1}, ValueError, "kdim must be a positive"),
    ],
)
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiheadAttention(**kwargs)


def test_forward_shape_errors():
    m, q, k, v = _module_and_inputs()
    with pytest.raises(ValueError, match=r"query must be 3-D \(T, N, E\).*got shape \(13,\)"):
        m(q[:, 0, 0], k, v)
    with pytest.raises(ValueError, match=r"key and value must have as many dimensions"):
        m(q, k[:, 0], v)
    with pytest.raises(ValueError, match=r"query must have last dimension embed_dim=24, got "
                                         r"shape \(13, 3, 20\)"):
        m(q[..., :20], k, v)
    with pytest.raises(ValueError, match=r"key must have last dimension kdim=24"):
        m(q, k[..., :5], v)
    with pytest.raises(ValueError, match=r"key and value must have the same length S"):
        m(q, k, v[:7])
    with pytest.raises(ValueError, match=r"same batch size N \(dimension 1"):
        m(q, k[:, :2], v[:, :2])
    with pytest.raises(TypeError, match=r"parameters' dtype torch.float32, got query "
                                        r"torch.float64"):
        m(q.double(), k, v)
    with pytest.raises(TypeError, match=r"query must be a torch.Tensor, got list"):
        m([1.0], k, v)


def test_mask_errors():
    m, q, k, v = _module_and_inputs()
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(N, S\) = "
                                         r"\(3, 29\), got \(29, 3\)"):
        m(q, k, v, key_padding_mask=torch.zeros(S, N, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(T, S\) = \(13, 29\) or "
                                         r"\(N·H, T, S\) = \(12, 13, 29\), got \(13, 13\)"):
        m(q, k, v, attn_mask=torch.zeros(T, T, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(H, T, S\) = \(4, 13, 29\)"):
        m(q[:, 0], k[:, 0], v[:, 0], attn_mask=torch.zeros(12, T, S))
    with pytest.raises(TypeError, match=r"attn_mask must be boolean .* got dtype torch.int64"):
        m(q, k, v, attn_mask=torch.zeros(T, S, dtype=torch.long))
    with pytest.raises(TypeError, match=r"key_padding_mask must be a torch.Tensor or None"):
        m(q, k, v, key_padding_mask=[[0]])
    with pytest.raises(ValueError, match=r"is_causal=True .* needs attn_mask"):
        m(q, k, v, is_causal=True)


def test_autocast_bfloat16_matches_torch():
    """Under autocast the inputs may be bfloat16 while the parameters stay float32."""
    ref, ours = _pair(torch.float32)
    x = torch.randn(T, N, 24, generator=_gen(1)).bfloat16()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        r_out, r_w = ref(x, x, x)
        o_out, o_w = ours(x, x, x)
    assert o_out.dtype == r_out.dtype == torch.bfloat16
    # bfloat16 keeps 8 bits of mantissa: tolerance of a few units in the last place.
    assert_close(o_out, r_out, atol=2e-2, name="output (bfloat16)")
    assert_close(o_w, r_w, atol=1e-2, name="weights (bfloat16)")
