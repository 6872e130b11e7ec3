"""The neuron view: the D terms q_i ⊙ k_j · scale sum to the score the kernel uses."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from inspect_refs import build

from qkv.inspect.capture import capture
from qkv.inspect.hookpoints import hooks
from qkv.inspect.neuron import neuron_page_layers, qk_terms
from qkv.inspect.viewer import view

# (kind, layer, head, batch row, query, key): causal self-attention (learned positions; RoPE
# with grouped-query heads and left padding) and an encoder-decoder's cross-attention.
PAIRS = [
    ("gpt2", "blocks.1.self_attn", 2, 0, 7, 3),
    ("llama_gqa", "blocks.0.self_attn", 3, 1, 12, 6),
    ("llama_gqa", "blocks.1.self_attn", 0, 0, 5, 5),
    ("seq2seq", "decoder_blocks.0.cross_attn", 1, 1, 4, 2),
]


def _scores(model, run, layer):
    """The scaled, masked scores the math path forms, read at the layer's hook_scores."""
    seen = []
    with hooks(model, {f"{layer}.hook_scores": lambda v, _n: seen.append(v.clone())}), \
            torch.no_grad():
        run()
    return seen[0]  # (B, H, T, S)


@pytest.mark.parametrize(("kind", "layer", "head", "b", "i", "j"), PAIRS)
def test_terms_sum_to_the_kernels_score(kind, layer, head, b, i, j):
    model, run = build(kind)
    args = run.args
    kw = {"target": args[1]} if kind == "seq2seq" else {}
    t = qk_terms(model, args[0], layer, head, i, j, batch=b, model_kwargs=run.kwargs or None, **kw)
    D = t.query.numel()
    assert t.terms.shape == (D,) and t.scale == pytest.approx(D**-0.5)
    assert torch.equal(t.terms, t.query * t.key * t.scale)
    ref = float(_scores(model, run, layer)[b, head, i, j])
    err = abs(float(t.terms.double().sum()) - ref)
    assert err < 1e-5, f"{kind} {layer}: sum of terms vs score, max error {err:.2e}"
    assert abs(t.score - ref) < 1e-5


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_softmax_of_the_scores_is_the_exact_weight_row(kind):
    """Every key's score from the terms, through a softmax over the visible keys, gives the
    weights capture() rebuilds (for a row with left padding too)."""
    model, run = build(kind)
    layer, head, b, i = "blocks.1.self_attn", 1, 1, 9
    with capture(model, layers=layer) as cap, torch.no_grad():
        run()
    w_true = cap.weights[layer][b, head, i]  # (S,)
    visible = w_true > 0
    scores = torch.tensor([qk_terms(model, run.args[0], layer, head, i, j, batch=b,
                                    model_kwargs=run.kwargs or None).score
                           for j in range(w_true.numel())], dtype=torch.float64)  # fmt: skip
    w = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    err = (w - w_true.double()).abs().max().item()
    assert err < 1e-5, f"{kind}: softmax of the terms' sums vs captured weights, max error {err:.2e}"


def test_page_carries_q_and_k_whose_products_are_the_terms():
    model, run = build("llama_gqa")
    ids = run.args[0]
    v = view(model, None, input_ids=ids, model_kwargs=run.kwargs, batch=1, heads=[3, 1])
    data = json.loads(json.dumps(v.data))
    assert [x["name"] for x in data["neuron"]] == ["blocks.0.self_attn", "blocks.1.self_attn"]
    assert data["neuronLeftOut"] == []
    entry = data["neuron"][1]
    assert entry["heads"] == [3, 1] and (entry["T"], entry["S"], entry["D"]) == (13, 13, 8)
    q = np.frombuffer(base64.b64decode(entry["q"]), "<f4").reshape(2, 13, 8)
    k = np.frombuffer(base64.b64decode(entry["k"]), "<f4").reshape(2, 13, 8)
    for hi, h in enumerate(entry["heads"]):
        t = qk_terms(model, ids, "blocks.1.self_attn", h, 10, 4, batch=1, model_kwargs=run.kwargs)
        page_terms = q[hi, 10] * k[hi, 4] * entry["scale"]
        err = np.abs(page_terms - t.terms.numpy()).max()
        assert err < 1e-6, f"head {h}: page terms vs qk_terms, max error {err:.2e}"


def test_neuron_data_from_a_capture_and_the_budget():
    model, run = build("gpt2")
    with capture(model) as plain, torch.no_grad():
        run()
    assert "neuron" not in view(plain).data  # no inputs kept: nothing to show
    with capture(model, keep_inputs=True) as cap, torch.no_grad():
        run()
    data = view(cap).data
    assert [x["name"] for x in data["neuron"]] == cap.layers
    assert "neuron" not in view(cap, neuron=False).data
    # Layers in order while they fit: each layer is 3 heads × 11 × 8 × 2 = 528 floats.
    inputs = {n: cap.inputs[n][0] for n in cap.layers}
    kept, left = neuron_page_layers(inputs, {n: [0, 1, 2] for n in inputs}, 0, budget=600)
    assert [x["name"] for x in kept] == ["blocks.0.self_attn"] and left == ["blocks.1.self_attn"]


def test_errors():
    model, run = build("gpt2")
    ids = run.args[0]
    with pytest.raises(ValueError, match=r"layer must name one attention layer"):
        qk_terms(model, ids, "blocks.*", 0, 0, 0)
    with pytest.raises(ValueError, match=r"head must be an int in \[-3, 3\), got 3"):
        qk_terms(model, ids, 0, 3, 0, 0)
    with pytest.raises(ValueError, match=r"query must be an int in \[-11, 11\), got 11"):
        qk_terms(model, ids, 0, 0, 11, 0)
    with pytest.raises(ValueError, match=r"batch must be an int in \[-2, 2\), got 5"):
        qk_terms(model, ids, 0, 0, 0, 0, batch=5)
    with pytest.raises(ValueError, match="layer 'nope' matches no name"):
        qk_terms(model, ids, "nope", 0, 0, 0)
