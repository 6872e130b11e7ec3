"""torch's mask objects and unusual tensors as ``attn_mask``: the right meaning or a clear error.

``torch.nn.attention.bias`` ships ``CausalBias`` (``causal_upper_left``, ``causal_lower_right``),
a tensor subclass with no usable storage: qkv reads it as ``is_causal``. Nested, sparse and
masked tensors are refused by name; ``nn.Parameter`` masks are ordinary tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right, causal_upper_left

import qkv
from helpers import assert_close, backend_names
from qkv.attention.call import make_call
from qkv.attention.masks import check_attn_mask

BACKENDS = backend_names()  # "auto" and every registered backend


def test_torch_ships_one_mask_subclass():
    """Every tensor subclass torch.nn.attention defines for masks is covered here."""
    import inspect

    import torch.nn.attention as attention
    import torch.nn.attention.bias as bias

    found = {
        name for module in (attention, bias) for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, torch.Tensor) and obj is not torch.Tensor
    }
    assert found == {"CausalBias"}, f"new mask subclasses to cover: {found - {'CausalBias'}}"


def _inputs(B=2, H=4, T=5, S=9, D=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype, requires_grad=True) for L in (T, S, S)]


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("T", "S"), [(5, 9), (9, 5), (7, 7), (1, 6)])
@pytest.mark.parametrize(("build", "is_causal"), [(causal_upper_left, True), (causal_lower_right, "bottom-right")])
def test_causal_bias_is_is_causal(build, is_causal, T, S, backend):
    q, k, v = _inputs(T=T, S=S)
    bias = build(T, S)
    out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend)
    want = qkv.scaled_dot_product_attention(q, k, v, is_causal=is_causal, backend="math")
    assert_close(out, want, atol=1e-12, name=f"{build.__name__}({T}, {S}) [{backend}]")
    keep = bias._materialize()  # torch's own dense reading of the object, (T, S) bool
    if bool(keep.any(-1).all()):  # no dead rows: torch's values, gradients included
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        assert_close(out, ref, atol=1e-10, name=f"vs torch {build.__name__}({T}, {S}) [{backend}]")
        got = torch.autograd.grad(out.sum(), (q, k, v))
        exp = torch.autograd.grad(ref.sum(), (q, k, v))
        for n, a, b in zip("qkv", got, exp, strict=True):
            assert_close(a, b, atol=1e-10, name=f"d{n} {build.__name__} [{backend}]")


def test_causal_bias_becomes_structure_not_a_tensor():
    q, k, v = (t.detach() for t in _inputs(T=5, S=9))
    call = make_call(q, k, v, causal_lower_right(5, 9), 0.0, False, None, False, False)
    assert call.mask is None and call.causal == 4
    call = make_call(q, k, v, causal_upper_left(5, 9), 0.0, False, None, False, False)
    assert call.mask is None and call.causal == 0
    assert qkv.explain(q, k, v, attn_mask=causal_upper_left(5, 9)).chosen == "torch"


@pytest.mark.parametrize("build", [causal_upper_left, causal_lower_right])
def test_causal_bias_with_is_causal_is_refused_as_torch_does(build):
    q, k, v = (t.detach() for t in _inputs())
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=build(5, 9), is_causal=True)
    for catch in (ValueError, RuntimeError):
        with pytest.raises(catch, match=r"already a causal mask; do not also pass is_causal"):
            qkv.scaled_dot_product_attention(q, k, v, attn_mask=build(5, 9), is_causal=True)


def test_causal_bias_of_other_lengths_is_refused():
    q, k, v = (t.detach() for t in _inputs(T=5, S=9))
    with pytest.raises(ValueError, match=r"CausalBias built for \(T, S\) = \(4, 9\) but the call has T=5 queries and S=9 keys"):
        qkv.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 9))


def test_check_attn_mask_materialises_causal_bias():
    m = check_attn_mask(causal_lower_right(3, 5), (2, 4, 3, 5))
    assert m.dtype == torch.bool and m.shape == (1, 1, 3, 5)
    assert torch.equal(m[0, 0], qkv.masks.causal(3, 5, align="bottom-right"))
    assert isinstance(causal_lower_right(3, 5), CausalBias)


UNUSUAL = {
    "nested": (
        lambda: torch.nested.nested_tensor([torch.zeros(5, 9), torch.zeros(5, 9)]),
        r"attn_mask must be a dense \(strided\) tensor, got a nested tensor",
    ),
    "sparse_coo": (
        lambda: torch.ones(5, 9, dtype=torch.bool).to_sparse(),
        r"got a tensor with layout torch.sparse_coo",
    ),
    "sparse_csr": (
        lambda: torch.zeros(5, 9).to_sparse_csr(),
        r"got a tensor with layout torch.sparse_csr",
    ),
    "masked": (
        lambda: torch.masked.masked_tensor(torch.zeros(5, 9), torch.ones(5, 9, dtype=torch.bool)),
        r"attn_mask is a torch.masked.MaskedTensor; pass a plain tensor",
    ),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(UNUSUAL))
def test_unusual_tensors_are_refused_clearly(kind, backend):
    q, k, v = (t.detach() for t in _inputs(dtype=torch.float32))
    build, message = UNUSUAL[kind]
    for catch in (TypeError, RuntimeError):
        with pytest.raises(catch, match=message):
            qkv.scaled_dot_product_attention(q, k, v, attn_mask=build(), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_mask_is_an_ordinary_mask(backend):
    q, k, v = (t.detach() for t in _inputs())
    bias = torch.nn.Parameter(torch.randn(5, 9, dtype=torch.float64))
    out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert_close(out, ref, atol=1e-10, name=f"Parameter mask [{backend}]")
