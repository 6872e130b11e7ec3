"""``qkv.nn.to_torch`` / ``from_torch``: the drop-ins convert to and from torch's modules.

Each conversion must give the same ``state_dict`` (keys and values) and, on the same inputs,
the same outputs and gradients (inputs and parameters), in float64 to 1e-10, over
``batch_first`` both ways, masks, ``norm_first``, activations and torch's MHA options.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkv.nn as qnn
from helpers import assert_close
from qkv.nn import from_torch, to_torch

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")

F64 = {"dtype": torch.float64}
TOL = 1e-10


def _seq(N, L, E, batch_first, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (N, L, E) if batch_first else (L, N, E)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _padding(N, L):
    mask = torch.zeros(N, L, dtype=torch.bool)
    mask[0, -2:] = True  # True = padding (torch's polarity)
    return mask


def _assert_same(a: nn.Module, b: nn.Module, run, what: str):
    """Same state_dict, and ``run(module, inputs)`` gives the same output and gradients."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), f"{what}: state_dict keys {list(sa)} != {list(sb)}"
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{what}: {key} differs"
        assert sa[key].data_ptr() != sb[key].data_ptr(), f"{what}: {key} shares storage"
    assert a.training == b.training
    outs, grads = [], []
    for module in (a, b):
        module.zero_grad()
        out, inputs = run(module)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
        leaves = [*inputs, *module.parameters()]
        grads.append(torch.autograd.grad(loss, leaves, allow_unused=True))
        outs.append(out)
    assert_close(outs[0], outs[1], atol=TOL, name=f"{what} output")
    for i, (ga, gb) in enumerate(zip(*grads, strict=True)):
        if ga is None or gb is None:
            assert ga is None and gb is None, f"{what}: gradient {i} missing on one side"
            continue
        assert_close(ga, gb, atol=TOL, name=f"{what} gradient {i}")


MHA_CASES = {
    "plain": dict(),
    "batch_first": dict(batch_first=True),
    "no bias": dict(bias=False),
    "bias_kv + zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
    "kdim/vdim": dict(kdim=6, vdim=5, batch_first=True),
}


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "masks"])
@pytest.mark.parametrize("direction", ["from_torch", "to_torch"])
@pytest.mark.parametrize("name", list(MHA_CASES))
def test_multihead_attention(name, direction, masked):
    kw = MHA_CASES[name]
    torch.manual_seed(0)
    if direction == "from_torch":
        source = nn.MultiheadAttention(8, 2, **kw, **F64)
        target = from_torch(source)
        assert type(target) is qnn.MultiheadAttention
    else:
        source = qnn.MultiheadAttention(8, 2, **kw, **F64)
        target = to_torch(source)
        assert type(target) is nn.MultiheadAttention
    bf = kw.get("batch_first", False)
    N, T, S = 2, 3, 5

    def run(module):
        q = _seq(N, T, 8, bf, 1).requires_grad_()
        k = _seq(N, S, kw.get("kdim", 8), bf, 2).requires_grad_()
        v = _seq(N, S, kw.get("vdim", 8), bf, 3).requires_grad_()
        masks = {}
        if masked:
            masks = dict(key_padding_mask=_padding(N, S),
                         attn_mask=torch.rand(T, S, generator=torch.Generator().manual_seed(4)) > 0.7)
        out, weights = module(q, k, v, **masks)
        return torch.cat([out.flatten(), weights.flatten()]), (q, k, v)

    _assert_same(source, target, run, f"MultiheadAttention {name} {direction}")


LAYER_CASES = {
    "post-norm relu": dict(),
    "pre-norm gelu batch_first": dict(norm_first=True, activation="gelu", batch_first=True),
    "no bias, module activation": dict(bias=False, activation=nn.GELU(), layer_norm_eps=1e-6),
}


def _layer_kwargs(case):
    return dict(dim_feedforward=12, dropout=0.0, **LAYER_CASES[case], **F64)


def _build(kind: str, qkv_side: bool, case: str):
    """A module of ``kind`` on the qkv side or the torch side, built from one seed."""
    ns = qnn if qkv_side else nn
    kw = _layer_kwargs(case)
    torch.manual_seed(0)
    if kind == "encoder_layer":
        return ns.TransformerEncoderLayer(8, 2, **kw)
    if kind == "decoder_layer":
        return ns.TransformerDecoderLayer(8, 2, **kw)
    if kind == "encoder":
        layer = ns.TransformerEncoderLayer(8, 2, **kw)
        return ns.TransformerEncoder(layer, 2, nn.LayerNorm(8, **F64), enable_nested_tensor=False)
    if kind == "decoder":
        return ns.TransformerDecoder(ns.TransformerDecoderLayer(8, 2, **kw), 2)
    kw.pop("dtype")
    return ns.Transformer(8, 2, 2, 1, **kw, **F64)


def _runner(kind: str, batch_first: bool, masked: bool):
    N, S, T = 2, 5, 4

    def run(module):
        src = _seq(N, S, 8, batch_first, 1).requires_grad_()
        tgt = _seq(N, T, 8, batch_first, 2).requires_grad_()
        causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
        pad_s = _padding(N, S) if masked else None
        if kind in ("encoder_layer", "encoder"):
            mask = torch.ones(S, S, dtype=torch.bool).triu(1)  # True = may not attend
            return module(src, mask if masked else None, pad_s), (src,)
        if kind in ("decoder_layer", "decoder"):
            return module(tgt, src, tgt_mask=causal, memory_key_padding_mask=pad_s), (tgt, src)
        return module(src, tgt, tgt_mask=causal, src_key_padding_mask=pad_s,
                      memory_key_padding_mask=pad_s), (src, tgt)

    return run


KINDS = ["encoder_layer", "decoder_layer", "encoder", "decoder", "transformer"]


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "masks"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
@pytest.mark.parametrize("direction", ["from_torch", "to_torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_transformer_modules(kind, direction, case, masked):
    source = _build(kind, direction == "to_torch", case).eval()
    target = to_torch(source) if direction == "to_torch" else from_torch(source)
    expected_ns = nn if direction == "to_torch" else qnn
    assert type(target).__name__ == type(source).__name__
    assert type(target).__module__.startswith(expected_ns.__name__), type(target).__module__
    batch_first = LAYER_CASES[case].get("batch_first", False)
    _assert_same(source, target, _runner(kind, batch_first, masked), f"{kind} {case} {direction}")


def test_round_trip_is_exact_and_keeps_training_mode():
    torch.manual_seed(0)
    model = qnn.Transformer(8, 2, 1, 1, dim_feedforward=12, batch_first=True)
    back = from_torch(to_torch(model))
    assert type(back) is qnn.Transformer and back.training
    assert back.encoder.layers[0].self_attn.batch_first
    for (ka, va), (kb, vb) in zip(model.state_dict().items(), back.state_dict().items(),
                                  strict=True):
        assert ka == kb and torch.equal(va, vb), ka
    assert back.encoder.layers[0].dropout.p == 0.1


def test_refusals():
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        to_torch(qnn.MultiheadAttention(8, 2, num_kv_heads=1))
    with pytest.raises(TypeError, match="to_torch converts"):
        to_torch(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="from_torch converts"):
        from_torch(qnn.MultiheadAttention(8, 2))
    with pytest.raises(ValueError, match="no layers"):
        to_torch(qnn.TransformerDecoder(qnn.TransformerDecoderLayer(8, 2), 0))
