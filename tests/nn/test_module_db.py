"""qkv.nn's drop-ins against PyTorch's own module test inputs (``module_db``).

For every sample that ``torch.testing._internal.common_modules`` generates for
``MultiheadAttention``, ``TransformerEncoderLayer``, ``TransformerEncoder``,
``TransformerDecoderLayer`` and ``Transformer`` (float64, training and eval mode), the test
builds torch's module from the sample's constructor arguments, builds qkv's class with the same
arguments, loads torch's ``state_dict`` (strict) and compares, at 1e-9:

1. the output and the gradients of every floating input and every parameter, in the sample's
   mode with autograd on (torch's general path: its parameters require grad);
2. the output in eval mode under ``torch.no_grad()``, where torch takes its fast paths (native
   MHA, the fused encoder layer, the nested-tensor encoder).

``module_db`` has no ``TransformerDecoder`` entry: its samples are derived here from the
``TransformerDecoderLayer`` samples (two layers), as torch derives ``TransformerEncoder``'s
from the encoder layer's. Every sample sets ``dropout=0.0``, so training mode needs no shared
seed. No sample is skipped and qkv refuses none. No sample has a fully masked row; that
difference (torch NaN, qkv zeros) is checked on its own below, on module_db's MHA samples with
every key masked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch

import qkv.nn as qn
from helpers import assert_close

# module_db lives in torch's test utilities, which import expecttest (a test-only dependency).
pytest.importorskip("expecttest", reason="torch's module_db imports expecttest (dev extra)")
common_modules = pytest.importorskip("torch.testing._internal.common_modules")

F64 = torch.float64
TOL = dict(atol=1e-9, rtol=1e-9)
DB = {m.name[3:]: m for m in common_modules.module_db if m.name.startswith("nn.")}


@dataclass
class Case:
    """One sample: how to build torch's and qkv's module, the forward inputs, the mode."""

    id: str
    make_torch: Callable[[], torch.nn.Module]
    make_qkv: Callable[[], torch.nn.Module]
    args: tuple
    kwargs: dict
    training: bool


def _samples(name: str, training: bool) -> list:
    torch.manual_seed(0)
    if name not in DB:  # a layer's samples, for the stacks built on them
        fn = getattr(common_modules, f"module_inputs_torch_nn_{name}")
        return fn(None, device="cpu", dtype=F64, requires_grad=True, training=training)
    info = DB[name]
    return info.module_inputs_func(info, device="cpu", dtype=F64, requires_grad=True,
                                   training=training)


def _stack(stack_cls, layer_cls, args, kwargs) -> torch.nn.Module:
    """``stack_cls`` of two copies of ``layer_cls(*args, **kwargs)``, as module_db builds it."""
    return stack_cls(layer_cls(*args, **{**kwargs, "dtype": F64}), 2)


def _cases(training: bool) -> list[Case]:
    mode = "train" if training else "eval"
    cases = []
    for name in ("MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer",
                 "Transformer"):
        for i, s in enumerate(_samples(name, training)):
            a, kw = s.constructor_input.args, s.constructor_input.kwargs
            cases.append(Case(f"{name}-{mode}-{i}-{s.desc}",
                              partial(getattr(torch.nn, name), *a, **kw),
                              partial(getattr(qn, name), *a, **kw),
                              s.forward_input.args, s.forward_input.kwargs, training))
    # module_db's TransformerEncoder samples pass a built torch layer; qkv's stack gets qkv's
    # layer from the same layer sample (module_db builds its samples from those, in order).
    layers = _samples("TransformerEncoderLayer", training)
    for i, (s, layer) in enumerate(zip(_samples("TransformerEncoder", training), layers,
                                       strict=True)):
        assert s.desc == layer.desc
        la, lkw = layer.constructor_input.args, layer.constructor_input.kwargs
        cases.append(Case(f"TransformerEncoder-{mode}-{i}-{s.desc}",
                          partial(torch.nn.TransformerEncoder, *s.constructor_input.args),
                          partial(_stack, qn.TransformerEncoder, qn.TransformerEncoderLayer,
                                  la, lkw),
                          s.forward_input.args, s.forward_input.kwargs, training))
    # Derived: TransformerDecoder of two layers on the decoder layer's samples.
    for i, s in enumerate(_samples("TransformerDecoderLayer", training)):
        a, kw = s.constructor_input.args, s.constructor_input.kwargs
        cases.append(Case(f"TransformerDecoder-{mode}-{i}-{s.desc}",
                          partial(_stack, torch.nn.TransformerDecoder,
                                  torch.nn.TransformerDecoderLayer, a, kw),
                          partial(_stack, qn.TransformerDecoder, qn.TransformerDecoderLayer,
                                  a, kw),
                          s.forward_input.args, s.forward_input.kwargs, training))
    return cases


CASES = _cases(training=False) + _cases(training=True)


def _pair(case: Case) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "enable_nested_tensor is True, but ..."
        ref = case.make_torch().to(F64)
    ours = case.make_qkv().to(F64)
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(ref.state_dict())
    return ref.train(case.training), ours.train(case.training)


def _output(out):
    return out[0] if isinstance(out, tuple) else out  # MHA returns (output, weights)


def _forward_backward(module, case: Case):
    """Output, then gradients of a fixed projection of it w.r.t. float inputs and parameters."""
    leaves = [x.detach().clone().requires_grad_() if torch.is_tensor(x) else x
              for x in case.args]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _output(module(*leaves, **case.kwargs))
    names, params = zip(*module.named_parameters(), strict=True)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    wrt = [x for x in leaves if torch.is_tensor(x)] + list(params)
    grads = torch.autograd.grad((out * cot).sum(), wrt)
    labels = [f"grad input {i}" for i in range(len(wrt) - len(params))]
    return out, dict(zip(labels + [f"grad {n}" for n in names], grads, strict=True))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_module_db_sample_matches_torch(case):
    ref, ours = _pair(case)
    r_out, r_grads = _forward_backward(ref, case)
    assert not r_out.isnan().any(), "torch gave NaN: a fully masked row (see the test below)"
    o_out, o_grads = _forward_backward(ours, case)
    assert_close(o_out, r_out, **TOL, name=f"{case.id} output")
    for label, g in r_grads.items():
        assert_close(o_grads[label], g, **TOL, name=f"{case.id} {label}")
    # Eval mode without autograd: torch's fast paths (nested encoder: zeros at padding).
    ref.eval(), ours.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r_fast = _output(ref(*case.args, **case.kwargs))
        o_fast = _output(ours(*case.args, **case.kwargs))
    assert_close(o_fast, r_fast, **TOL, name=f"{case.id} eval no_grad output")


def test_sample_counts():
    """The grid above is module_db's, all of it: a change in torch's samples shows here."""
    counts = {}
    for case in CASES:
        key = f"{case.id.split('-')[0]}-{case.id.split('-')[1]}"
        counts[key] = counts.get(key, 0) + 1
    assert counts == {
        "MultiheadAttention-eval": 64, "MultiheadAttention-train": 64,
        "TransformerEncoderLayer-eval": 35, "TransformerEncoderLayer-train": 39,
        "TransformerEncoder-eval": 35, "TransformerEncoder-train": 39,
        "TransformerDecoderLayer-eval": 67, "TransformerDecoderLayer-train": 67,
        "TransformerDecoder-eval": 67, "TransformerDecoder-train": 67,
        "Transformer-eval": 64, "Transformer-train": 64,
    }


MHA_MASKED = [c for c in CASES if c.id.startswith("MultiheadAttention-eval")
              and c.kwargs.get("key_padding_mask") is not None]


@pytest.mark.parametrize("case", MHA_MASKED, ids=[c.id for c in MHA_MASKED])
def test_fully_masked_rows_torch_nan_qkv_zero_context(case):
    """Every key masked: torch's rows are NaN, qkv's attend to nothing (output = out_proj's
    bias, weights 0, finite gradients); rows that still see a key (add_bias_kv/add_zero_attn
    append visible keys) equal torch's."""
    ref, ours = _pair(case)
    kwargs = {**case.kwargs, "key_padding_mask": torch.ones_like(case.kwargs["key_padding_mask"])}
    q, k, v = (x.detach().clone().requires_grad_() for x in case.args)
    r_out, r_w = ref(q, k, v, **kwargs)
    o_out, o_w = ours(q, k, v, **kwargs)
    appended = ours.bias_k is not None or ours.add_zero_attn
    assert r_out.isnan().all().item() is not appended, "torch NaN exactly when no key is left"
    if appended:
        assert_close(o_out, r_out, **TOL, name="output with appended keys")
        assert_close(o_w, r_w, **TOL, name="weights with appended keys")
        return
    bias = ours.out_proj.bias if ours.out_proj.bias is not None else torch.zeros(3, dtype=F64)
    assert_close(o_out, bias.expand_as(o_out), **TOL, name="fully masked output")
    assert_close(o_w, torch.zeros_like(o_w), **TOL, name="fully masked weights")
    grads = torch.autograd.grad(o_out.sum(), [q, k, v, *ours.parameters()], allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads), "NaN gradient"
