"""``load(..., quantize=)`` on SmolLM2-135M: every linear quantised, logits near float32, and
greedy decoding agrees with float32 on a prompt (the measured rates: benchmarks/quantize.py)."""

from __future__ import annotations

import pytest
import torch
from pretrained_refs import smollm2
from torch import nn

import qkv.pretrained
from qkv.generate import greedy
from qkv.nn.quantized import Int4Linear, Int8Linear


@pytest.mark.parametrize(("mode", "kind", "bound"), [("int8", Int8Linear, 0.05),
                                                     ("int4", Int4Linear, 0.15)])
def test_load_quantized_smollm2(mode, kind, bound):
    float_bundle = smollm2()
    bundle = qkv.pretrained.load("SmolLM2-135M-Instruct", quantize=mode)
    assert bundle.source["quantize"] == mode
    assert not [m for m in bundle.model.modules() if type(m) is nn.Linear]
    assert sum(isinstance(m, kind) for m in bundle.model.modules()) == 30 * 7 + (mode == "int8")
    assert isinstance(bundle.model.lm_head, Int8Linear)  # int4's head at 8 bits, as llama.cpp
    ids = torch.tensor([bundle.tokenizer.encode("The capital of France is Paris, and the")])
    with torch.inference_mode():
        want, got = float_bundle.model(ids), bundle.model(ids)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= bound, f"{mode}: relative logit error {rel:.4f} vs float32 (bound {bound})"
    if mode == "int8":
        a = greedy(float_bundle.model, ids, max_new_tokens=8)
        b = greedy(bundle.model, ids, max_new_tokens=8)
        assert torch.equal(a, b), (a.tolist(), b.tolist())


def test_load_refuses_unknown_quantize():
    with pytest.raises(ValueError, match=r"quantize must be None or one of \('int8', 'int4'\)"):
        qkv.pretrained.load("SmolLM2-135M-Instruct", quantize="fp8")
