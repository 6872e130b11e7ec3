"""torch's own OpInfo sample inputs for SDPA, through qkv on every backend, in float64.

``torch.testing._internal.common_methods_invocations.op_db`` holds the inputs torch tests its
``scaled_dot_product_attention`` with (3-D and 4-D inputs, query/key ranks that differ and
broadcast, causal, dropout, a float mask). Every one must give torch's output and gradients.
Dropout samples are compared bit for bit in the dropped positions: with the same seed qkv
draws torch's dropout mask on every backend. Fully masked rows are the one documented
difference (zeros where torch's math path gives NaN), checked explicitly below.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import qkv
from helpers import assert_close, backend_names, skip_if_refused

BACKENDS = backend_names()  # "auto" and every registered backend
OP_NAME = "nn.functional.scaled_dot_product_attention"


@functools.lru_cache(maxsize=1)
def samples() -> list:
    """The OpInfo samples on CPU in float64 (importing op_db takes a few seconds, once)."""
    from torch.testing._internal.common_methods_invocations import op_db

    op = next(o for o in op_db if o.name == OP_NAME)
    return list(op.sample_inputs("cpu", torch.float64, requires_grad=True))


def _describe(s) -> str:
    q, k, v = s.input, *s.args[:2]
    kw = {n: (tuple(x.shape) if isinstance(x, torch.Tensor) else x) for n, x in s.kwargs.items()}
    return f"q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} {kw}"


def _fresh(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _run(fn, tensors, kwargs, seed, grad_seed):
    """Output and the gradients of ``<output, g>`` for a fixed random ``g``."""
    torch.manual_seed(seed)
    out = fn(*tensors, **kwargs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=out.dtype)
    return out, torch.autograd.grad(out, tensors, g)


def _sample_ids() -> list[str]:
    return [f"{i}" for i in range(len(samples()))]


def test_samples_cover_the_broadcast_cases():
    """The samples include query/key ranks that differ, which qkv used to refuse."""
    ranks = {(s.input.dim(), s.args[0].dim()) for s in samples()}
    assert (3, 4) in ranks, f"expected a 3-D query with 4-D keys among {sorted(ranks)}"
    assert any(s.kwargs.get("dropout_p", 0.0) > 0 for s in samples())
    assert any("attn_mask" in s.kwargs for s in samples())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", range(len(samples())), ids=_sample_ids())
def test_sample_matches_torch(index, backend):
    s = samples()[index]
    q, k, v = s.input, *s.args[:2]
    kwargs = dict(s.kwargs)
    skip_if_refused(backend, q.detach(), k.detach(), v.detach(), **kwargs)  # e.g. dropout
    what = f"[{backend}] {_describe(s)}"
    # The same seed before each call: dropout draws the same mask in torch and in qkv.
    ref, ref_grads = _run(F.scaled_dot_product_attention, _fresh(q, k, v), kwargs, 0, 1)
    sdpa = functools.partial(qkv.scaled_dot_product_attention, backend=backend)
    out, grads = _run(sdpa, _fresh(q, k, v), kwargs, 0, 1)
    assert_close(out, ref, atol=1e-9, name=f"output {what}")
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(a, b, atol=1e-9, name=f"{name} {what}")


@pytest.mark.parametrize("kernel", ["default", "math"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero_where_torch_gives_nan(backend, kernel):
    """The documented difference: a row with no visible key is zero in qkv; torch gives NaN
    (its math kernel before 2.5) or zeros (its "safe softmax" since); every other row equals
    torch's, gradients included."""
    s = next(s for s in samples() if "attn_mask" in s.kwargs)
    q, k, v = s.input, *s.args[:2]
    mask = s.kwargs["attn_mask"].detach().clone()  # (T, S) float
    mask[1] = float("-inf")  # query row 1 sees no key
    kwargs = {**s.kwargs, "attn_mask": mask}
    skip_if_refused(backend, q.detach(), k.detach(), v.detach(), **kwargs)
    backends = [SDPBackend.MATH] if kernel == "math" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        ref, ref_grads = _run(F.scaled_dot_product_attention, _fresh(q, k, v), kwargs, 0, 1)
    sdpa = functools.partial(qkv.scaled_dot_product_attention, backend=backend)
    out, grads = _run(sdpa, _fresh(q, k, v), kwargs, 0, 1)
    dead = ref[..., 1, :]
    assert torch.isnan(dead).all() or (dead == 0).all(), "torch: NaN or zero on a dead row"
    assert out[..., 1, :].abs().max() == 0, f"[{backend}] dead row must be zero"
    live = torch.ones(out.shape[-2], dtype=torch.bool)
    live[1] = False
    assert_close(out[..., live, :], ref[..., live, :], atol=1e-9, name=f"live rows [{backend}]")
    assert grads[0][..., 1, :].abs().max() == 0, f"[{backend}] dead row gets zero gradient"
    assert_close(grads[0][..., live, :], torch.nan_to_num(ref_grads[0])[..., live, :], atol=1e-9,
                 name=f"dq of live rows [{backend}]")
    for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
        assert torch.isfinite(g).all(), f"[{backend}] {name} has NaN or inf"
