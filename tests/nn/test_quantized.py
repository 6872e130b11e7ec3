"""Weight-only int8/int4 linears: the forward equals plain torch on the dequantised weight, the
dequantised weight is within half a quantisation step of the float one, models still work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.generate import greedy
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn import quantized
from qkv.nn.quantized import Int4Linear, Int8Linear, quantize_


def _linear(i, o, bias, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=bias)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 7, 64), (5, 128)], ids=str)
@pytest.mark.parametrize("out", [1, 33, 130])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_dequantized_matmul(mode, shape, out, bias, dtype, monkeypatch):
    monkeypatch.setattr(quantized, "_ROWS", 32)  # several row blocks, one partial
    linear = _linear(shape[-1], out, bias).to(dtype)
    q = Int8Linear(linear) if mode == "int8" else Int4Linear(linear, group_size=16)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    w = q.dequantized(torch.float64)  # (out, in)
    want = x.double() @ w.T + (0 if linear.bias is None else linear.bias.double())
    got = q(x)
    assert got.dtype == dtype and got.shape == (*shape[:-1], out)
    tol = 1e-5 if dtype == torch.float32 else 3e-2 * want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= tol, f"{mode} {dtype}: forward vs x @ W_deq.T + b, max error {err:.3g}"


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_dequantized_weight_within_half_a_step(mode):
    linear = _linear(128, 70, True)
    q = Int8Linear(linear) if mode == "int8" else Int4Linear(linear, group_size=32)
    w = linear.weight.detach()
    err = (q.dequantized() - w).abs()  # (out, in)
    if mode == "int8":
        step = q.scale[:, None].expand_as(w)
    else:
        step = q.scale.repeat_interleave(32, dim=1)
    worst = (err / step).max().item()
    assert worst <= 0.5 + 1e-4, f"{mode}: error up to {worst:.4f} steps (bound 0.5)"


def _model():
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.llama_style(97, d_model=64, num_layers=2, num_heads=4,
                                                 num_kv_heads=2, max_len=64)).eval()  # fmt: skip


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_close_to_float(mode):
    model = _model()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids)
        q = quantize_(_model(), mode, group_size=16)  # 16 divides every width (64, 176)
        got = q(ids)
    linears = [m for m in q.modules() if type(m) is nn.Linear]
    assert not linears, f"left in float: {linears}"
    assert isinstance(q.embed, nn.Embedding) and torch.equal(q.embed.weight, model.embed.weight)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= (0.02 if mode == "int8" else 0.15), f"{mode}: relative logit error {rel:.4f}"
    tokens = greedy(q, [[1, 2, 3]], max_new_tokens=4)  # decoding runs on it
    assert tokens.shape == (1, 4)


def test_quantized_model_compiles_fullgraph():
    q = quantize_(_model(), "int8")
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    compiled = torch.compile(q, fullgraph=True, backend="eager")
    with torch.no_grad():
        err = (compiled(ids) - q(ids)).abs().max().item()
    assert err <= 1e-6, f"compiled vs eager max error {err:.3g}"


def test_errors():
    with pytest.raises(ValueError, match=r"quantize must be one of \('int8', 'int4'\)"):
        quantize_(_model(), "int2")
    with pytest.raises(ValueError, match="int4 needs an even group_size dividing in_features=20"):
        Int4Linear(_linear(20, 5, False), group_size=8)
    with pytest.raises(ValueError, match="x must end in in_features=16"):
        Int8Linear(_linear(16, 4, True))(torch.randn(2, 15))
    with pytest.raises(TypeError, match=r"module's parameters are torch\.float32"):
        quantize_(_model(), "int8").blocks[0].self_attn(torch.randn(1, 3, 64).double())
    kept = quantize_(_model(), "int8", skip=lambda name, m: name == "lm_head")
    assert type(kept.lm_head) is nn.Linear
    assert "int8 per-channel" in repr(kept.blocks[0].self_attn.q_proj)


def test_scratch_buffer_serves_inference_mode_and_plain_calls():
    """The reused dequantisation buffer works under inference_mode, no_grad and grad mode,
    in any order (it is never an inference tensor)."""
    q = quantize_(_model(), "int8")
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a = q(ids)
    with torch.no_grad():
        b = q(ids)
    c = q(ids)
    assert torch.equal(a, b) and torch.equal(b, c.detach())
