"""A model's structure fingerprint: what a compiled step with torch's module guards dropped
is checked against once a session, so a changed model never runs a stale graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.generate import greedy
from qkv.generate.structure import structure
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn.quantized import quantize_

# qkv against qkv (fingerprints; a compiled step against the eager one): other kernels move
# both sides together, so make test's AVX2 pass leaves these to the first.
pytestmark = pytest.mark.self_check


def _model(num_layers=2):
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.llama_style(37, d_model=32, num_layers=num_layers,
                                                 num_heads=4, num_kv_heads=2,
                                                 max_len=64)).eval()  # fmt: skip


def _first_linear(model):
    return next(m for m in model.modules() if isinstance(m, nn.Linear))


CHANGES = {
    "a forward hook": lambda m: _first_linear(m).register_forward_hook(lambda *a: None),
    "a pre-hook": lambda m: m.register_forward_pre_hook(lambda *a: None),
    "training mode": lambda m: m.train(),
    "a weight of another dtype": lambda m: setattr(
        _first_linear(m), "weight", nn.Parameter(_first_linear(m).weight.double())),
    "a weight of another shape": lambda m: setattr(
        _first_linear(m), "weight", nn.Parameter(_first_linear(m).weight[:-1].clone())),
    "a transposed weight": lambda m: setattr(
        _first_linear(m), "weight", nn.Parameter(_first_linear(m).weight.t().contiguous().t())),
    "requires_grad off": lambda m: _first_linear(m).weight.requires_grad_(False),
    "a plain attribute": lambda m: setattr(_first_linear(m), "in_features", 999),
    "a tie broken": lambda m: setattr(m.lm_head, "weight", nn.Parameter(m.embed.weight + 0)),
    "a module swapped": lambda m: setattr(m, "norm_f", nn.Identity()),
    "a module added": lambda m: m.add_module("extra", nn.ReLU()),
    "quantised in place": lambda m: quantize_(m, "int8"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_a_compiled_step_was_traced_on_changes_the_fingerprint(change):
    model = _model()
    before = structure(model)
    assert structure(model) == before, "two fingerprints of one unchanged model differ"
    CHANGES[change](model)
    assert structure(model) != before, f"{change}: the fingerprint did not change"


def test_a_global_hook_changes_it_and_in_place_updates_do_not():
    model = _model()
    before = structure(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)  # values a compiled graph reads afresh on every call
    assert structure(model) == before
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert structure(model) != before
    finally:
        handle.remove()
    assert structure(model) == before


def test_a_changed_model_gets_a_new_compiled_step_and_the_eager_tokens():
    model = _model(num_layers=1)  # (one block: each compile here is a cold one)
    prompt = [[3, 4, 5, 6]]
    assert torch.equal(greedy(model, prompt, max_new_tokens=5, eos_id=None, compile=True),
                       greedy(model, prompt, max_new_tokens=5, eos_id=None))  # fmt: skip
    first = model.__dict__["_qkv_compiled_step"][1]
    # New weights of the same shape and ties are read by the same graph (no recompile) ...
    head = model.lm_head
    assert head.weight is model.embed.weight
    head.weight = model.embed.weight = nn.Parameter(torch.randn_like(head.weight))
    want = greedy(model, prompt, max_new_tokens=5, eos_id=None)
    assert torch.equal(greedy(model, prompt, max_new_tokens=5, eos_id=None, compile=True), want)
    assert model.__dict__["_qkv_compiled_step"][1] is first
    # ... a hook that changes the logits is traced into a new step.
    head.register_forward_hook(lambda mod, args, out: -out)
    want = greedy(model, prompt, max_new_tokens=5, eos_id=None)
    got = greedy(model, prompt, max_new_tokens=5, eos_id=None, compile=True)
    assert model.__dict__["_qkv_compiled_step"][1] is not first
    assert torch.equal(got, want), (got.tolist(), want.tolist())
