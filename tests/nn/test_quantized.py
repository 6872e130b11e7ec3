"""Weight-only int8/int4 linears: the forward equals plain torch on the dequantised weight, the
dequantised weight is within half a quantisation step of the float one, models still work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.generate import greedy
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn import linear as linear_module
from qkv.nn import quantized
from qkv.nn.linear import Linear
from qkv.nn.quantized import Int4Linear, Int8Linear, quantize_


def _linear(i, o, bias, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=bias)


U_BF16 = 2.0**-8  # bfloat16's unit roundoff (8 significant bits)


def _quant(mode, linear, group_size, kernel):
    q = Int8Linear(linear) if mode == "int8" else Int4Linear(linear, group_size=group_size)
    q.kernel = kernel
    return q


def _packed_bound(q, x, want):
    """What the packed kernels may differ from ``x @ W_deqᵀ`` in float64, elementwise: the
    activations rounded to bfloat16 (u·Σ|x||w|), int4's scales and zero points rounded to
    bfloat16 (u·Σ|x|(|q-8|·s + |zero point|)), the result rounded to bfloat16 (u·|y|), and
    float32 sums over ``in`` terms."""
    x = x.double().reshape(-1, q.in_features)
    if isinstance(q, Int8Linear):
        wabs = q.dequantized(torch.float64).abs()  # (out, in)
    else:
        g = q.group_size
        s, z = q.scale.double(), q.zero.double()  # (out, G)
        codes = q.codes().double().view(q.out_features, -1, g)  # (out, G, g)
        wabs = ((codes - 8).abs() * s[..., None] + ((8 - z) * s).abs()[..., None])
        wabs = wabs.reshape(q.out_features, q.in_features)
    terms = x.abs() @ wabs.T  # (M, out)
    y = want.double().reshape(terms.shape)
    fp32_sums = 2 * q.in_features * 2.0**-24 * terms
    return (U_BF16 * (2 * terms + y.abs() + 2 * U_BF16 * terms) + fp32_sums).reshape(want.shape)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 7, 64), (5, 128), (5, 13, 96)], ids=str)
@pytest.mark.parametrize("out", [16, 33, 130, 144])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["float", "packed", "auto"])
def test_forward_equals_dequantized_matmul(mode, shape, out, bias, dtype, kernel, monkeypatch):
    monkeypatch.setattr(quantized, "_ROWS", 32)  # several row blocks, one partial
    linear = _linear(shape[-1], out, bias).to(dtype)
    q = _quant(mode, linear, 32, kernel)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    w = q.dequantized(torch.float64)  # (out, in)
    want = x.double() @ w.T + (0 if linear.bias is None else linear.bias.double())
    got = q(x)
    assert got.dtype == dtype and got.shape == (*shape[:-1], out)
    rows = x.numel() // shape[-1]
    limit = quantized.PACKED_ROWS[mode]
    packed = q.packable and (kernel == "packed" or (kernel == "auto" and rows <= limit))
    if packed:
        tol = _packed_bound(q, x, want)
        if dtype == torch.bfloat16:  # the bias added in bfloat16 too
            tol = tol + U_BF16 * want.abs()
    elif dtype == torch.float32:
        tol = torch.full_like(want, 1e-5)
    else:
        tol = torch.full_like(want, 3e-2 * want.abs().max().item())
    err = (got.double() - want).abs()
    worst = (err / tol).max().item()
    assert worst <= 1, (f"{mode} {dtype} kernel={kernel} (packed: {packed}): forward vs "
                        f"x @ W_deq.T + b, max error {err.max().item():.3g}, "
                        f"{worst:.2f} of the bound")


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize(("extra", "kernel", "calls"), [(-9999, "auto", 1), (0, "auto", 1),
                                                        (1, "auto", 0), (1, "packed", 1),
                                                        (-9999, "float", 0)])  # fmt: skip
def test_which_kernel_runs(mode, extra, kernel, calls, monkeypatch):
    """"auto" takes torch's packed kernel up to PACKED_ROWS rows of x (int8 32, int4 64), the
    float one above; "packed" and "float" force one (counted by wrapping torch's op)."""
    limit = {"int8": 32, "int4": 64}[mode]
    assert quantized.PACKED_ROWS[mode] == limit
    rows = max(1, limit + extra)
    name = "_weight_int8pack_mm" if mode == "int8" else "_weight_int4pack_mm_for_cpu"
    seen = []
    real = getattr(torch, name)
    monkeypatch.setattr(torch, name, lambda *a: seen.append(1) or real(*a))
    q = _quant(mode, _linear(64, 32, True), 32, kernel)
    with torch.no_grad():
        q(torch.randn(rows, 64))
    assert len(seen) == calls, (mode, rows, kernel, seen)


@pytest.mark.parametrize(("mode", "inp", "out", "group_size"),
                         [("int8", 24, 32, 32), ("int8", 7, 5, 32), ("int4", 64, 33, 32),
                          ("int4", 64, 32, 16)])  # fmt: skip
def test_shapes_the_packed_kernels_refuse_take_the_float_one(mode, inp, out, group_size,
                                                             monkeypatch):  # fmt: skip
    """int8 needs in % 16 == 0 (torch does not check it: other widths crash the process),
    int4 out % 16 == 0 and a group of 32, 64, 128 or 256: elsewhere even "packed" is exact."""
    name = "_weight_int8pack_mm" if mode == "int8" else "_weight_int4pack_mm_for_cpu"
    monkeypatch.setattr(torch, name, None)  # calling it would fail the test
    linear = _linear(inp, out, True)
    q = _quant(mode, linear, group_size if mode == "int4" else 32, "packed")
    x = torch.randn(2, inp, generator=torch.Generator().manual_seed(5))
    want = x.double() @ q.dequantized(torch.float64).T + linear.bias.double()
    err = (q(x).double() - want).abs().max().item()
    assert not q.packable and err <= 1e-5, f"{mode} {inp}->{out}: max error {err:.3g}"


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_autograd_through_x_takes_the_float_kernel(mode):
    """The packed kernels have no backward: an x that needs a gradient goes the float way."""
    q = _quant(mode, _linear(64, 32, False), 32, "packed")
    x = torch.randn(2, 64, requires_grad=True)
    q(x).sum().backward()
    want = q.dequantized().sum(dim=0).expand(2, 64)  # d(sum(x Wᵀ))/dx
    err = (x.grad - want).abs().max().item()
    assert err <= 1e-5, f"{mode}: grad vs column sums of W_deq, max error {err:.3g}"


def test_int4_packed_copy_is_made_again_after_load_state_dict():
    """torch's tiled copy is not saved: loading another layer's codes repacks it."""
    a = _quant("int4", _linear(64, 32, True, seed=1), 32, "packed")
    b = _quant("int4", _linear(64, 32, True, seed=2), 32, "packed")
    assert "_tiled" not in a.state_dict() and "_scale_zero" not in a.state_dict()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


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
    linears = [m for m in q.modules() if type(m) in (nn.Linear, Linear)]
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


@pytest.mark.parametrize(("mode", "head", "kind"), [("int4", None, Int8Linear),
                                                    ("int4", "int4", Int4Linear),
                                                    ("int8", None, Int8Linear),
                                                    ("int8", "int4", Int4Linear)])  # fmt: skip
def test_the_output_head_takes_its_own_mode(mode, head, kind):
    """lm_head is int8 under int4 unless asked (llama.cpp's Q4 files keep it at 8 bits)."""
    q = quantize_(_model(), mode, group_size=16, head=head)
    body = Int8Linear if mode == "int8" else Int4Linear
    assert type(q.lm_head) is kind and type(q.blocks[0].ffn.up_proj) is body, repr(q.lm_head)


def test_errors():
    with pytest.raises(ValueError, match=r"head must be None or one of \('int8', 'int4'\)"):
        quantize_(_model(), "int4", head="fp8")
    with pytest.raises(ValueError, match=r"quantize must be one of \('int8', 'int4'\)"):
        quantize_(_model(), "int2")
    with pytest.raises(ValueError, match=r"kernel must be one of \('auto', 'packed', 'float'\)"):
        quantize_(_model(), "int8", kernel="fast")
    with pytest.raises(ValueError, match="int4 needs an even group_size dividing in_features=20"):
        Int4Linear(_linear(20, 5, False), group_size=8)
    with pytest.raises(ValueError, match="x must end in in_features=16"):
        Int8Linear(_linear(16, 4, True))(torch.randn(2, 15))
    with pytest.raises(TypeError, match=r"module's parameters are torch\.float32"):
        quantize_(_model(), "int8").blocks[0].self_attn(torch.randn(1, 3, 64).double())
    kept = quantize_(_model(), "int8", skip=lambda name, m: name == "lm_head")
    assert type(kept.lm_head) is Linear
    assert "int8 per-channel" in repr(kept.blocks[0].self_attn.q_proj)


def test_scratch_buffer_serves_inference_mode_and_plain_calls(monkeypatch):
    """The reused dequantisation buffer works under inference_mode, no_grad and grad mode,
    in any order (it is never an inference tensor). The float kernel: in grad mode the
    embedding's output needs a gradient, which the packed kernel would leave to it anyway.
    The float blocks' products on BLAS in every mode (by default inference ones may run on
    oneDNN, whose bits differ from BLAS's: tests/nn/test_linear.py bounds that), so the three
    results compare bit for bit."""
    monkeypatch.setattr(linear_module, "KERNEL", "blas")
    q = quantize_(_model(), "int8", kernel="float")
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a = q(ids)
    with torch.no_grad():
        b = q(ids)
    c = q(ids)
    assert torch.equal(a, b) and torch.equal(b, c.detach())
