"""qkv's encoder/decoder layers, stacks and Transformer are drop-ins for torch's.

Each test builds torch's module, loads its state_dict into qkv's (strict) and compares the
output and the gradients of the inputs and of every parameter. Training mode with dropout=0
runs torch's general path, the same arithmetic qkv does; eval mode is checked separately
against torch's fast paths (fused layer, nested tensors), where torch returns zeros at padded
positions of the encoder, so only real positions are compared there.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import qkv.nn.transformer as qt
from helpers import TOL, assert_close
from qkv.nn.transformer_layers import TransformerDecoderLayer, TransformerEncoderLayer

# torch warns that its nested-tensor path is off for these layers; irrelevant to parity.
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")

E, H, FF, N, T, S = 24, 4, 40, 3, 7, 11
DTYPES = [torch.float64, torch.float32]

# (norm_first, activation, batch_first, bias): every constructor option, in six rows.
LAYER_CONFIGS = {
    "post-relu": dict(norm_first=False, activation="relu"),
    "pre-gelu": dict(norm_first=True, activation="gelu"),
    "post-fn-batch_first": dict(activation=F.gelu, batch_first=True),
    "pre-callable-batch_first": dict(norm_first=True, activation=torch.tanh, batch_first=True),
    "post-no_bias": dict(bias=False, layer_norm_eps=1e-3),
    "pre-module": dict(norm_first=True, activation=torch.nn.SiLU()),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _x(L, batch_first, dtype, seed, batched=True):
    shape = ((N, L, E) if batch_first else (L, N, E)) if batched else (L, E)
    return torch.randn(shape, generator=_gen(seed), dtype=dtype)


def _padding(L, kind="bool", dtype=torch.float64):
    m = torch.zeros(N, L, dtype=torch.bool)
    m[0, L - 3:] = True
    m[2, 1] = True
    if kind == "float":
        return torch.zeros(N, L, dtype=dtype).masked_fill(m, float("-inf"))
    return m


def _attn_mask(kind, L, Lk, dtype):
    """Torch polarity (True = ignore). Column 0 stays visible so no row is fully hidden."""
    g = _gen(5)
    if kind == "causal":
        return qt.generate_square_subsequent_mask(L, dtype=dtype)[:, :Lk]
    if kind == "causal_bool":
        return torch.ones(L, Lk, dtype=torch.bool).triu(1)
    shape = (L, Lk) if kind.startswith("2d") else (N * H, L, Lk)
    if kind.endswith("bool"):
        m = torch.rand(shape, generator=g) < 0.3
        m[..., 0] = False
        return m
    return torch.randn(shape, generator=g, dtype=dtype)


def _load(ref, ours):
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(ref.state_dict())
    return ref, ours


def _run(module, inputs, kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about mixed mask dtypes and nested paths
        out = module(*leaves, **kwargs)
    names, params = zip(*module.named_parameters(), strict=True)
    cot = torch.randn(out.shape, generator=_gen(9), dtype=out.dtype)
    grads = torch.autograd.grad((out * cot).sum(), [*leaves, *params])
    labels = [f"grad input {i}" for i in range(len(leaves))] + [f"grad {n}" for n in names]
    return out, dict(zip(labels, grads, strict=True))


def _compare(ref, ours, inputs, kwargs, dtype):
    r_out, r_grads = _run(ref, inputs, kwargs)
    o_out, o_grads = _run(ours, inputs, kwargs)
    assert_close(o_out, r_out, **TOL[dtype], name="output")
    assert o_grads.keys() == r_grads.keys()
    for name, g in r_grads.items():
        assert_close(o_grads[name], g, **TOL[dtype], name=name)


def _layer_pair(torch_cls, qkv_cls, dtype, **config):
    torch.manual_seed(0)
    ref = torch_cls(E, H, FF, 0.0, dtype=dtype, **config)
    return _load(ref, qkv_cls(E, H, FF, 0.0, dtype=dtype, **config))


ENCODER_MASKS = {
    "none": {},
    "causal_hint": {"src_mask": "causal", "is_causal": True},
    "kpm_bool": {"src_key_padding_mask": "bool"},
    "float_mask_float_kpm": {"src_mask": "2d_float", "src_key_padding_mask": "float"},
    "mask3d_bool_kpm_bool": {"src_mask": "3d_bool", "src_key_padding_mask": "bool"},
}


def _encoder_kwargs(case, dtype):
    kw = {}
    for name, kind in ENCODER_MASKS[case].items():
        if name == "src_mask":
            kw[name] = _attn_mask(kind, S, S, dtype)
        elif name == "src_key_padding_mask":
            kw[name] = _padding(S, kind, dtype)
        else:
            kw[name] = kind
    return kw


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("masks", ENCODER_MASKS)
@pytest.mark.parametrize("config", LAYER_CONFIGS)
def test_encoder_layer_matches_torch(config, masks, dtype):
    cfg = LAYER_CONFIGS[config]
    ref, ours = _layer_pair(torch.nn.TransformerEncoderLayer, TransformerEncoderLayer, dtype,
                            **cfg)
    src = _x(S, cfg.get("batch_first", False), dtype, 1)
    _compare(ref, ours, [src], _encoder_kwargs(masks, dtype), dtype)


DECODER_MASKS = {
    "none": {},
    "tgt_causal_hint": {"tgt_mask": ("causal", T, T), "tgt_is_causal": True},
    "padding_both": {"tgt_key_padding_mask": ("bool", T), "memory_key_padding_mask": ("bool", S)},
    "memory_mask_bool": {"memory_mask": ("2d_bool", T, S), "tgt_mask": ("3d_float", T, T)},
    "memory_causal_hint": {"memory_mask": ("causal_bool", T, S), "memory_is_causal": True,
                           "tgt_key_padding_mask": ("float", T)},
}


def _decoder_kwargs(case, dtype):
    kw = {}
    for name, spec in DECODER_MASKS[case].items():
        if isinstance(spec, bool):
            kw[name] = spec
        elif name.endswith("padding_mask"):
            kw[name] = _padding(spec[1], spec[0], dtype)
        else:
            kw[name] = _attn_mask(*spec, dtype)
    return kw


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("masks", DECODER_MASKS)
@pytest.mark.parametrize("config", LAYER_CONFIGS)
def test_decoder_layer_matches_torch(config, masks, dtype):
    cfg = LAYER_CONFIGS[config]
    ref, ours = _layer_pair(torch.nn.TransformerDecoderLayer, TransformerDecoderLayer, dtype,
                            **cfg)
    bf = cfg.get("batch_first", False)
    inputs = [_x(T, bf, dtype, 1), _x(S, bf, dtype, 2)]
    _compare(ref, ours, inputs, _decoder_kwargs(masks, dtype), dtype)


def _stack_pair(kind, dtype, norm=True, **config):
    """torch's stack of 2 layers with a final LayerNorm, and qkv's with its weights."""
    torch_layer = getattr(torch.nn, f"Transformer{kind}Layer")
    qkv_layer = {"Encoder": TransformerEncoderLayer, "Decoder": TransformerDecoderLayer}[kind]
    torch.manual_seed(0)
    # torch's nested-tensor encoder path zeroes padded positions; switched off here so every
    # position compares (the eval test below compares torch's nested path on real positions).
    extra = {"enable_nested_tensor": False} if kind == "Encoder" else {}
    ref = getattr(torch.nn, f"Transformer{kind}")(
        torch_layer(E, H, FF, 0.0, dtype=dtype, **config), 2,
        torch.nn.LayerNorm(E, dtype=dtype) if norm else None, **extra)
    ours = getattr(qt, f"Transformer{kind}")(
        qkv_layer(E, H, FF, 0.0, dtype=dtype, **config), 2,
        torch.nn.LayerNorm(E, dtype=dtype) if norm else None)
    return _load(ref, ours)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize(
    ("config", "kwargs"),
    [
        ({}, {}),
        ({"batch_first": True, "norm_first": True}, {"mask": "causal"}),  # detected as causal
        ({"activation": "gelu"}, {"mask": "causal_bool", "src_key_padding_mask": "bool"}),
        ({"batch_first": True}, {"mask": "2d_float", "is_causal": False}),
    ],
)
def test_encoder_stack_matches_torch(config, kwargs, dtype):
    ref, ours = _stack_pair("Encoder", dtype, **config)
    kw = {k: (_attn_mask(v, S, S, dtype) if k == "mask" else
              _padding(S, v, dtype) if k.endswith("padding_mask") else v)
          for k, v in kwargs.items()}
    _compare(ref, ours, [_x(S, config.get("batch_first", False), dtype, 1)], kw, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("masks", ["none", "tgt_causal_hint", "padding_both"])
@pytest.mark.parametrize("norm", [True, False])
def test_decoder_stack_matches_torch(norm, masks, dtype):
    ref, ours = _stack_pair("Decoder", dtype, norm=norm, norm_first=norm)
    kw = _decoder_kwargs(masks, dtype)
    kw.pop("tgt_is_causal", None)  # the stack detects the causal tgt_mask itself
    _compare(ref, ours, [_x(T, False, dtype, 1), _x(S, False, dtype, 2)], kw, dtype)


def _transformer_pair(dtype, **config):
    torch.manual_seed(0)
    ref = torch.nn.Transformer(E, H, 2, 2, FF, 0.0, dtype=dtype, **config)
    return _load(ref, qt.Transformer(E, H, 2, 2, FF, 0.0, dtype=dtype, **config))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize(
    "config", [{}, {"batch_first": True, "norm_first": True, "activation": "gelu"}]
)
def test_transformer_end_to_end_matches_torch(config, batched, dtype):
    ref, ours = _transformer_pair(dtype, **config)
    bf = config.get("batch_first", False)
    src, tgt = _x(S, bf, dtype, 1, batched), _x(T, bf, dtype, 2, batched)
    kw = {"tgt_mask": qt.Transformer.generate_square_subsequent_mask(T, dtype=dtype)}
    if batched:
        kw |= {"src_key_padding_mask": _padding(S), "memory_key_padding_mask": _padding(S),
               "tgt_key_padding_mask": _padding(T)}
    _compare(ref, ours, [src, tgt], kw, dtype)


def test_custom_encoder_and_decoder():
    ref, ours = _transformer_pair(torch.float64)
    encoder, decoder = ours.encoder, ours.decoder
    custom = qt.Transformer(E, H, custom_encoder=encoder, custom_decoder=decoder,
                           dtype=torch.float64)
    assert custom.encoder is encoder and custom.decoder is decoder
    _load(ref, custom)  # construction re-initialised the custom stacks, as torch does
    _compare(ref, custom, [_x(S, False, torch.float64, 1), _x(T, False, torch.float64, 2)], {},
             torch.float64)


def test_eval_matches_torch_fast_paths_on_real_positions():
    """torch's nested-tensor encoder zeroes padded positions, and qkv's does too (same conditions)."""
    torch.manual_seed(0)
    ref = torch.nn.Transformer(E, H, 2, 2, FF, 0.1, batch_first=True).eval()
    ours = _load(ref, qt.Transformer(E, H, 2, 2, FF, 0.1, batch_first=True))[1].eval()
    src, tgt, kpm = _x(S, True, torch.float32, 1), _x(T, True, torch.float32, 2), _padding(S)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r_mem = ref.encoder(src, src_key_padding_mask=kpm)
        o_mem = ours.encoder(src, src_key_padding_mask=kpm)
        assert_close(o_mem[~kpm], r_mem[~kpm], **TOL[torch.float32], name="memory (real)")
        layer_kw = {"src_key_padding_mask": kpm}  # fused layer fast path: every position
        r_layer = ref.encoder.layers[0](src, **layer_kw)
        assert_close(ours.encoder.layers[0](src, **layer_kw), r_layer, **TOL[torch.float32],
                     name="encoder layer")
        kw = {"src_key_padding_mask": kpm, "memory_key_padding_mask": kpm,
              "tgt_mask": qt.generate_square_subsequent_mask(T)}
        assert_close(ours(src, tgt, **kw), ref(src, tgt, **kw), **TOL[torch.float32],
                     name="transformer output")


def test_dropout_train_and_eval():
    ref, ours = _load(torch.nn.TransformerEncoderLayer(E, H, FF, 0.3),
                      TransformerEncoderLayer(E, H, FF, 0.3))
    src = _x(S, False, torch.float32, 1)
    torch.manual_seed(1)
    a = ours(src)
    torch.manual_seed(2)
    b = ours(src)
    assert a.shape == src.shape and not torch.allclose(a, b), "dropout should change outputs"
    ref.eval(), ours.eval()
    _compare(ref, ours, [src], {}, torch.float32)


@pytest.mark.parametrize(
    "build",
    [
        lambda m, **kw: m.TransformerEncoderLayer(E, H, FF, **kw),
        lambda m, **kw: m.TransformerDecoderLayer(E, H, FF, norm_first=True, **kw),
        lambda m, **kw: m.Transformer(E, H, 2, 1, FF, bias=False, **kw),
    ],
    ids=["encoder_layer", "decoder_layer", "transformer"],
)
def test_same_seed_same_initial_weights_and_round_trip(build):
    torch.manual_seed(3)
    ref = build(torch.nn)
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = build(_Namespace)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs from torch's initial value"
    ref.load_state_dict(ours.state_dict(), strict=True)  # qkv -> torch
    ours.load_state_dict(ref.state_dict(), strict=True)  # torch -> qkv


class _Namespace:
    """qkv's classes under torch's names, for the builders above."""

    TransformerEncoderLayer = TransformerEncoderLayer
    TransformerDecoderLayer = TransformerDecoderLayer
    Transformer = qt.Transformer


@pytest.mark.parametrize("sz", [0, 1, 6])
@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_generate_square_subsequent_mask_equals_torch(sz, dtype):
    ref = torch.nn.Transformer.generate_square_subsequent_mask(sz, dtype=dtype)
    for ours in (qt.Transformer.generate_square_subsequent_mask(sz, dtype=dtype),
                 qt.generate_square_subsequent_mask(sz, dtype=dtype)):
        assert ours.dtype == ref.dtype and torch.equal(ours, ref)


def test_causal_detection():
    causal = qt.generate_square_subsequent_mask(5)
    assert qt._is_causal_mask(causal, None)
    assert qt._is_causal_mask(torch.ones(5, 5, dtype=torch.bool).triu(1), None)
    assert not qt._is_causal_mask(causal.T, None)
    assert not qt._is_causal_mask(causal[None].expand(4, 5, 5), None)  # 3-D: never detected
    assert not qt._is_causal_mask(causal, False)  # the hint wins
    assert qt._is_causal_mask(None, True) and not qt._is_causal_mask(None, None)


def test_errors():
    with pytest.raises(ValueError, match=r"activation must be 'relu', 'gelu' or a callable, "
                                         "got 'swish'"):
        TransformerEncoderLayer(E, H, activation="swish")
    with pytest.raises(TypeError, match=r"activation must be .* got int"):
        TransformerDecoderLayer(E, H, activation=3)
    with pytest.raises(ValueError, match=r"num_layers must be a non-negative int, got -1"):
        qt.TransformerEncoder(TransformerEncoderLayer(E, H), -1)
    layer = TransformerEncoderLayer(E, H, FF)
    with pytest.raises(ValueError, match=r"src must be .* E = d_model = 24, got shape \(7, 3, 5\)"):
        layer(torch.randn(7, 3, 5))
    with pytest.raises(ValueError, match=r"is_causal=True .* needs attn_mask"):
        layer(torch.randn(7, 3, E), is_causal=True)
    dec = TransformerDecoderLayer(E, H, FF)
    with pytest.raises(ValueError, match=r"memory must be .* got shape \(7, 3, 4\)"):
        dec(torch.randn(7, 3, E), torch.randn(7, 3, 4))
    model = qt.Transformer(E, H, 1, 1, FF)
    with pytest.raises(ValueError, match=r"same batch size \(dimension 1\), got src "
                                         r"\(5, 2, 24\) and tgt \(4, 3, 24\)"):
        model(torch.randn(5, 2, E), torch.randn(4, 3, E))
    with pytest.raises(ValueError, match=r"last dimension d_model=24"):
        model(torch.randn(5, 2, E), torch.randn(4, 2, 8))
    with pytest.raises(ValueError, match=r"sz must be a non-negative int, got -2"):
        qt.generate_square_subsequent_mask(-2)
