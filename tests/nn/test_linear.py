"""qkv.nn.linear.Linear: nn.Linear whose inference calls of several rows run on oneDNN, equal
to a float64 reference within a float32 dot product's rounding, on both kernels, and
nn.Linear in every other respect."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import dot_rounding_bound
from qkv.nn import linear as linear_mod
from qkv.nn.linear import Linear, uses_onednn

pytestmark = pytest.mark.skipif(not linear_mod._ONEDNN, reason="this torch has no oneDNN")
EPS = torch.finfo(torch.float32).eps


def _layer(n_in, n_out, bias):
    torch.manual_seed(0)
    return Linear(n_in, n_out, bias=bias)


def _check(layer, x, name):
    got = layer(x)
    w, b = layer.weight.double(), None if layer.bias is None else layer.bias.double()
    want = F.linear(x.double(), w, b)
    bound = dot_rounding_bound(x, w) * 2
    if b is not None:
        bound = bound + EPS * b.abs()
    err = (got.double() - want).abs()
    assert got.shape == want.shape and got.dtype == torch.float32, name
    assert bool((err <= bound).all()), (f"{name}: max error {err.max().item():.3g} past the "
                                        f"rounding bound")  # fmt: skip


@pytest.mark.parametrize("kernel", ["auto", "blas", "onednn"])
@pytest.mark.parametrize("shape", [(1, 7, 5), (2, 13, 37), (48, 576, 768), (3, 1, 1)],
                         ids=["one-row", "odd", "prefill", "k1"])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("one_row", [False, True], ids=["intel", "amd"])
def test_both_kernels_agree_with_float64(kernel, shape, bias, one_row, monkeypatch):
    monkeypatch.setattr(linear_mod, "KERNEL", kernel)
    monkeypatch.setattr(linear_mod, "ONE_ROW", one_row)  # the CPU rule, both ways
    rows, n_in, n_out = shape
    layer = _layer(n_in, n_out, bias)
    x = torch.randn(rows, n_in)
    with torch.inference_mode():
        onednn = uses_onednn(x, layer.weight, layer.bias)
        auto = rows >= 2 or one_row
        assert onednn == (kernel == "onednn" or (kernel == "auto" and auto)), (kernel, rows)
        _check(layer, x, f"{kernel} {shape} 2-D")
        _check(layer, x.reshape(1, rows, n_in), f"{kernel} {shape} 3-D")
        _check(layer, torch.randn(n_in, rows).T, f"{kernel} {shape} transposed input")


def test_training_and_other_dtypes_take_f_linear_and_get_gradients():
    layer = _layer(9, 4, True)
    x = torch.randn(5, 9, requires_grad=True)
    assert not uses_onednn(x, layer.weight, layer.bias)  # a gradient is wanted
    y = layer(x)
    y.sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(5, 9).detach())
    with torch.no_grad():
        assert uses_onednn(x, layer.weight, layer.bias)
        double = _layer(9, 4, True).double()
        assert not uses_onednn(x.double(), double.weight, double.bias)
        bf16 = _layer(9, 4, False).bfloat16()
        assert not uses_onednn(x.bfloat16(), bf16.weight)
        assert not uses_onednn(torch.randn(5, 0), torch.randn(4, 0))  # K = 0


def test_wrong_shapes_get_f_linears_message():
    layer = _layer(9, 4, False)
    with torch.no_grad(), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        layer(torch.randn(5, 8))


def test_an_unknown_kernel_setting_is_named(monkeypatch):
    monkeypatch.setattr(linear_mod, "KERNEL", "mkl")
    with torch.no_grad(), pytest.raises(ValueError, match="KERNEL must be one of"):
        _layer(3, 2, False)(torch.randn(2, 3))


def test_it_is_nn_linear_to_everything_else():
    layer, plain = _layer(6, 3, True), nn.Linear(6, 3, bias=True)
    assert isinstance(layer, nn.Linear) and repr(layer) == repr(plain)
    assert list(layer.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-6)


def test_a_traced_call_is_left_to_the_compiler():
    layer = _layer(8, 4, False)
    seen = []

    def fn(x):
        seen.append(uses_onednn(x, layer.weight))
        return layer(x)

    with torch.no_grad():
        torch.compile(fn, fullgraph=True, backend="eager")(torch.randn(3, 8))
    assert seen == [False], seen


def test_the_vendor_rule_reads_the_cpu(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open
    for vendor, intel in (("GenuineIntel", True), ("AuthenticAMD", False)):
        info = tmp_path / f"{vendor}.txt"
        info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t: fpu\n")
        monkeypatch.setattr(linear_mod.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(builtins, "open", lambda path, *a, _i=info, **k: real_open(
            _i if str(path) == "/proc/cpuinfo" else path, *a, **k))
        assert linear_mod._intel_or_not_x86() is intel, vendor
        monkeypatch.setattr(builtins, "open", real_open)
    monkeypatch.setattr(linear_mod.platform, "machine", lambda: "aarch64")
    assert linear_mod._intel_or_not_x86() is True
