"""Feed-forward layers and norms against torch's modules and closed forms, forward and backward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import TOL, assert_close
from qkv.nn.feedforward import FeedForward, SwiGLU, make_feedforward
from qkv.nn.norms import make_norm

DTYPES = [torch.float64, torch.float32]


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x)


# Closed forms in NumPy float64, written from the papers' formulas.
NUMPY_ACT = {
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
}


def np_linear(x: np.ndarray, layer: torch.nn.Linear) -> np.ndarray:
    w = layer.weight.detach().double().numpy()
    b = 0.0 if layer.bias is None else layer.bias.detach().double().numpy()
    return x @ w.T + b


def _grads(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad()
    x = x.detach().requires_grad_(True)
    module(x).backward(g)
    return [x.grad, *(p.grad for p in module.parameters())]


# ---------------------------------------------------------------- FeedForward


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_feedforward_equals_torch_encoder_layer_block(activation, dtype):
    E, F = 59, 113
    torch_layer = torch.nn.TransformerEncoderLayer(
        E, 1, F, dropout=0.0, activation=activation, dtype=dtype
    ).eval()
    ff = FeedForward(E, F, activation=activation).to(dtype).eval()
    ff.load_state_dict(
        {k: v for k, v in torch_layer.state_dict().items() if k.startswith(("linear1", "linear2"))}
    )
    x = torch.randn(3, 7, E, dtype=dtype, requires_grad=True)
    out = ff(x)
    expected = torch_layer._ff_block(x)  # linear2(dropout(act(linear1(x)))) then dropout2
    assert_close(out, expected, **TOL[dtype], name="forward")
    g = torch.randn_like(out)
    names = ["x", "w1", "b1", "w2", "b2"]
    ours = torch.autograd.grad(out, [x, *ff.parameters()], g)
    ref_params = [torch_layer.linear1.weight, torch_layer.linear1.bias]
    ref_params += [torch_layer.linear2.weight, torch_layer.linear2.bias]
    theirs = torch.autograd.grad(expected, [x, *ref_params], g)
    for k, a, e in zip(names, ours, theirs, strict=True):
        assert_close(a, e, **TOL[dtype], name=f"grad {k}")


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", [True, False])
def test_feedforward_equals_closed_form(activation, bias):
    E, F = 16, 37
    ff = FeedForward(E, F, activation=activation, bias=bias).double()
    x = torch.randn(2, 5, E, dtype=torch.float64)
    xn = x.numpy()
    expected = np_linear(NUMPY_ACT[activation](np_linear(xn, ff.linear1)), ff.linear2)
    assert_close(ff(x), expected, atol=1e-10, name=f"{activation} forward")
    assert len(list(ff.parameters())) == (4 if bias else 2)


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_feedforward_backward_matches_autograd_of_closed_form(activation):
    # The reference is the formula written out in torch ops, differentiated by autograd.
    C = math.sqrt(2 / math.pi)
    formulas = {
        "gelu_tanh": lambda h: 0.5 * h * (1 + torch.tanh(C * (h + 0.044715 * h**3))),
        "silu": lambda h: h / (1 + torch.exp(-h)),
    }
    ff = FeedForward(9, 21, activation=activation).double()
    w1, b1, w2, b2 = ff.linear1.weight, ff.linear1.bias, ff.linear2.weight, ff.linear2.bias
    x = torch.randn(4, 9, dtype=torch.float64)
    g = torch.randn(4, 9, dtype=torch.float64)
    ours = _grads(ff, x, g)
    xr = x.clone().requires_grad_(True)
    ref = formulas[activation](xr @ w1.T + b1) @ w2.T + b2  # (4, E)
    theirs = torch.autograd.grad(ref, [xr, w1, b1, w2, b2], g)
    for name, a, e in zip(["x", "w1", "b1", "w2", "b2"], ours, theirs, strict=True):
        assert_close(a, e, atol=1e-10, name=f"grad {name}")


def test_feedforward_callable_activation_and_dropout():
    ff = FeedForward(6, 10, activation=torch.tanh).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    expected = np_linear(np.tanh(np_linear(x.numpy(), ff.linear1)), ff.linear2)
    assert_close(ff(x), expected, atol=1e-10, name="tanh")
    assert "tanh" in repr(ff)
    with_module = FeedForward(6, 10, activation=torch.nn.Tanh())
    assert isinstance(with_module.activation, torch.nn.Tanh)
    dropped = FeedForward(6, 50, dropout=0.5)
    x32 = torch.randn(4, 6)
    assert not torch.equal(dropped.train()(x32), dropped.train()(x32)), "dropout in training"
    assert torch.equal(dropped.eval()(x32), dropped.eval()(x32)), "no dropout in evaluation"


def test_feedforward_errors():
    with pytest.raises(
        ValueError, match=r"activation must be one of \('relu', 'gelu', 'gelu_tanh', 'silu'\)"
    ):
        FeedForward(4, 8, activation="swish")
    with pytest.raises(TypeError, match=r"activation must be a name in .* got int"):
        FeedForward(4, 8, activation=3)
    with pytest.raises(ValueError, match="d_ff must be a positive int, got 0"):
        FeedForward(4, 0)
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\], got 1.5"):
        FeedForward(4, 8, dropout=1.5)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., E=4\), got \(2, 5\)"):
        FeedForward(4, 8)(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., E=4\), got \(2, 5\)"):
        SwiGLU(4, 8)(torch.zeros(2, 5))


# ---------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_forward_and_backward_closed_form(bias, dtype):
    E, F = 59, 113
    m = SwiGLU(E, F, bias=bias).to(dtype)
    assert [n for n, _ in m.named_children()][:3] == ["gate_proj", "up_proj", "down_proj"]
    x = torch.randn(2, 7, E, dtype=dtype)
    xn = x.double().numpy()
    gate, up = np_linear(xn, m.gate_proj), np_linear(xn, m.up_proj)
    expected = np_linear(gate / (1 + np.exp(-gate)) * up, m.down_proj)
    assert_close(m(x), expected, **TOL[dtype], name="forward")
    # Backward against autograd of the written-out formula in float64.
    g = torch.randn(2, 7, E, dtype=dtype)
    ours = _grads(m, x, g)
    params = [p.detach().double().requires_grad_(True) for p in m.parameters()]
    xr = x.double().requires_grad_(True)
    lin = {n: params[i] for i, (n, _) in enumerate(m.named_parameters())}

    def ref_linear(name, h):
        out = h @ lin[f"{name}.weight"].T
        return out + lin[f"{name}.bias"] if bias else out

    gr, ur = ref_linear("gate_proj", xr), ref_linear("up_proj", xr)
    ref = ref_linear("down_proj", gr * torch.sigmoid(gr) * ur)
    theirs = torch.autograd.grad(ref, [xr, *params], g.double())
    names = ["x", *(n for n, _ in m.named_parameters())]
    for name, a, e in zip(names, ours, theirs, strict=True):
        # float32: a sum over d_ff=113 products; 1e-5 relative to the gradient's scale.
        assert_close(a, e, **TOL[dtype], name=f"grad {name}")


def test_make_feedforward_kinds():
    for kind in ["relu", "gelu", "gelu_tanh", "silu"]:
        m = make_feedforward(kind, 8, 16, dropout=0.1)
        assert isinstance(m, FeedForward) and m.activation_name == kind
        assert m.dropout.p == 0.1 and m.linear1.bias is not None
    s = make_feedforward("swiglu", 8, 16)
    assert isinstance(s, SwiGLU) and s.gate_proj.bias is None
    assert make_feedforward("swiglu", 8, 16, bias=True).up_proj.bias is not None
    assert make_feedforward("gelu", 8, 16, bias=False).linear2.bias is None
    with pytest.raises(ValueError, match=r"kind must be one of \(.*'geglu'\), got 'reglu'"):
        make_feedforward("reglu", 8, 16)
    with pytest.raises(TypeError, match="takes the activation from `kind`"):
        make_feedforward("relu", 8, 16, activation="gelu")


# ---------------------------------------------------------------- norms


def np_layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + (0.0 if b is None else b)


def np_rmsnorm(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_make_norm_equals_closed_form(kind, dtype, bias):
    E, eps = 59, 1e-6
    norm = make_norm(kind, E, eps=eps, bias=bias).to(dtype)
    expected_type = torch.nn.LayerNorm if kind == "layernorm" else torch.nn.RMSNorm
    assert type(norm) is expected_type
    assert norm.eps == eps
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p))
    x = 3 * torch.randn(4, 13, E, dtype=dtype) + 1
    w = norm.weight.detach().double().numpy()
    if kind == "layernorm":
        b = None if norm.bias is None else norm.bias.detach().double().numpy()
        assert (norm.bias is None) == (not bias)
        expected = np_layernorm(x.double().numpy(), w, b, eps)
    else:
        assert not hasattr(norm, "bias") or norm.bias is None
        expected = np_rmsnorm(x.double().numpy(), w, eps)
    assert_close(norm(x), expected, **TOL[dtype], name=f"{kind} forward")


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_make_norm_backward_matches_autograd_of_closed_form(kind):
    E, eps = 31, 1e-5
    norm = make_norm(kind, E, eps=eps).double()
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, E, dtype=torch.float64)
    g = torch.randn(5, E, dtype=torch.float64)
    ours = _grads(norm, x, g)
    params = [p.detach().clone().requires_grad_(True) for p in norm.parameters()]
    xr = x.clone().requires_grad_(True)
    if kind == "layernorm":
        mu = xr.mean(-1, keepdim=True)
        ref = (xr - mu) / torch.sqrt(((xr - mu) ** 2).mean(-1, keepdim=True) + eps)
        ref = ref * params[0] + params[1]
    else:
        ref = xr / torch.sqrt((xr**2).mean(-1, keepdim=True) + eps) * params[0]
    theirs = torch.autograd.grad(ref, [xr, *params], g)
    for i, (a, e) in enumerate(zip(ours, theirs, strict=True)):
        assert_close(a, e, atol=1e-10, name=f"{kind} grad {i}")


def test_make_norm_errors(monkeypatch):
    expected = r"norm kind must be one of \('layernorm', 'rmsnorm'\), got 'batchnorm'"
    with pytest.raises(ValueError, match=expected):
        make_norm("batchnorm", 8)
    with pytest.raises(ValueError, match="d_model must be a positive int, got 0"):
        make_norm("layernorm", 0)
    with pytest.raises(ValueError, match="eps must be a positive number, got 0"):
        make_norm("rmsnorm", 8, eps=0)
    assert isinstance(make_norm("layernorm", 8), torch.nn.LayerNorm)  # unaffected below
    monkeypatch.delattr(torch.nn, "RMSNorm")
    with pytest.raises(RuntimeError, match=r"needs torch.nn.RMSNorm \(torch >= 2.4\)"):
        make_norm("rmsnorm", 8)
