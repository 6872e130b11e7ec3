"""Packed rows: ``DecoderLM`` and ``Encoder`` with ``document_ids`` equal each document run
alone, outputs and gradients (parameters and the embeddings' outputs), float64 <= 1e-10.

The reference is the same model called once per document with no document ids (positions
0..n-1, the ordinary attention path); a packed row runs the flex kernel with a document block
mask and per-document positions. Rows use several layouts, one with padding at the end (a
document of its own, id -1), and documents longer than one kernel tile.
"""

from __future__ import annotations

import pytest
import torch
from model_refs import perturb_

import qkv
from helpers import assert_close
from qkv.models import DecoderLM, DecoderLMConfig, Encoder, EncoderConfig
from qkv.models.parts import document_positions

TOL = dict(atol=1e-10, rtol=1e-10)
V = 19
# Two rows of T=40: documents (lengths) per row; -1 marks padding at the end of a row.
LAYOUTS = [[5, 17, 3, 15], [33, 7]]
PADDED = [[12, 20, -8], [40]]


def layout_ids(layouts):
    """``(document_ids (B, T), [(row, start, stop)] of the real documents)``."""
    rows, spans = [], []
    for r, lengths in enumerate(layouts):
        ids, at = [], 0
        for d, n in enumerate(lengths):
            ids += [-1 if n < 0 else d] * abs(n)
            if n > 0:
                spans.append((r, at, at + n))
            at += abs(n)
        rows.append(ids)
    return torch.tensor(rows), spans


def decoder(positions, kv_heads=None, **extra):
    torch.manual_seed(0)
    config = DecoderLMConfig(V, d_model=16, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                             max_len=48, positions=positions, **extra)  # fmt: skip
    return perturb_(DecoderLM(config).double())


def encoder(positions):
    torch.manual_seed(0)
    config = EncoderConfig(V, d_model=16, num_layers=2, num_heads=4, max_len=48,
                           positions=positions, dropout=0.0)  # fmt: skip
    return perturb_(Encoder(config).double())


def run_and_grads(model, calls):
    """Outputs of ``calls`` (a list of kwargs), and the gradients of one probe loss over all
    of them: parameters, and each call's embedding output (the input side of the model)."""
    embedded = []

    def keep(_module, _args, out):
        out.retain_grad()
        embedded.append(out)

    handle = model.embed.register_forward_hook(keep)
    try:
        outs = [model(**kw) for kw in calls]
    finally:
        handle.remove()
    return outs, embedded


def probe_loss(outputs, spans, probe):
    """sum over documents of <output rows, probe rows>: the same scalar packed or alone."""
    return sum((out * probe[r, a:b]).sum() for out, (r, a, b) in zip(outputs, spans, strict=True))


def check_packed_equals_alone(model, layouts, ids_kw="input_ids"):
    docs, spans = layout_ids(layouts)
    B, T = docs.shape
    torch.manual_seed(1)
    tokens = torch.randint(4, V, (B, T))
    (packed,), (emb_packed,) = run_and_grads(model, [{ids_kw: tokens, "document_ids": docs}])
    alone, emb_alone = run_and_grads(model, [{ids_kw: tokens[r : r + 1, a:b]}
                                             for r, a, b in spans])  # fmt: skip
    for (r, a, b), out in zip(spans, alone, strict=True):
        assert_close(packed[r : r + 1, a:b], out, **TOL, name=f"output of row {r} [{a}:{b}]")
    probe = torch.randn(packed.shape, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    pieces = [packed[r : r + 1, a:b] for r, a, b in spans]
    g_packed = torch.autograd.grad(probe_loss(pieces, spans, probe), [*params, emb_packed])
    g_alone = torch.autograd.grad(probe_loss(alone, spans, probe), [*params, *emb_alone])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, got, want in zip(names, g_packed[:-1], g_alone[: len(params)], strict=True):
        assert_close(got, want, **TOL, name=f"grad {name}")
    for k, (r, a, b) in enumerate(spans):
        assert_close(g_packed[-1][r : r + 1, a:b], g_alone[len(params) + k], **TOL,
                     name=f"grad of the embeddings of row {r} [{a}:{b}]")  # fmt: skip


@pytest.mark.parametrize("positions,kv_heads", [
    ("learned", None), ("rope", None), ("rope", 2), ("alibi", None), ("alibi", 1),
    ("sinusoidal", None), (None, 2),
])  # fmt: skip
@pytest.mark.parametrize("layouts", [LAYOUTS, PADDED], ids=["full", "padded"])
def test_decoder_packed_equals_each_document_alone(positions, kv_heads, layouts):
    check_packed_equals_alone(decoder(positions, kv_heads), layouts)


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi", "sinusoidal"])
@pytest.mark.parametrize("layouts", [LAYOUTS, PADDED], ids=["full", "padded"])
def test_encoder_packed_equals_each_document_alone(positions, layouts):
    check_packed_equals_alone(encoder(positions), layouts)


def test_llama_style_packed_equals_alone():
    model = decoder("rope", 2, norm_kind="rmsnorm", activation="swiglu", bias=False)
    check_packed_equals_alone(model, LAYOUTS)


def test_learned_positions_allow_rows_longer_than_max_len():
    """Positions restart per document: a row may exceed max_len when its documents do not."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(V, d_model=16, num_layers=1, num_heads=2, max_len=16))
    docs = torch.tensor([[0] * 16 + [1] * 16 + [2] * 8])  # T = 40 > max_len
    model(torch.randint(0, V, (1, 40)), document_ids=docs)
    with pytest.raises(ValueError, match="max_len=16"):
        model(torch.randint(0, V, (1, 40)), document_ids=torch.tensor([[0] * 20 + [1] * 20]))


def test_document_positions_restart():
    ids = torch.tensor([[4, 4, 4, 7, 7, -1], [0, 1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]])
    assert torch.equal(document_positions(ids), expected), document_positions(ids)


@pytest.mark.parametrize("positions", ["rope", "alibi"])
def test_capture_on_a_packed_forward(positions):
    """Captured weights are zero across documents, rows sum to 1, and equal each document's
    weights alone."""
    model = decoder(positions, 2)
    docs, spans = layout_ids(PADDED)
    tokens = torch.randint(4, V, docs.shape)
    with qkv.inspect.capture(model) as cap:
        model(tokens, document_ids=docs)
    for name, w in cap.weights.items():  # (B, H, T, T)
        same = docs[:, None, :, None] == docs[:, None, None, :]  # (B, 1, T, T)
        assert float(w.masked_select(~same.expand_as(w)).abs().max()) == 0.0, name
        assert_close(w.sum(-1), torch.ones(w.shape[:-1], dtype=w.dtype), **TOL,
                     name=f"{name} row sums")  # fmt: skip
        assert cap.kinds[name] == "causal self"
    for r, a, b in spans:
        with qkv.inspect.capture(model) as alone:
            model(tokens[r : r + 1, a:b])
        for name, w in alone.weights.items():
            assert_close(cap.weights[name][r : r + 1, :, a:b, a:b], w, **TOL,
                         name=f"{name} row {r} [{a}:{b}]")  # fmt: skip


def test_document_ids_errors_are_named():
    model = decoder("rope")
    tokens = torch.randint(0, V, (2, 6))
    docs = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="cannot be combined with a cache or an attention_mask"):
        model(tokens, document_ids=docs, cache=model.new_cache())
    with pytest.raises(ValueError, match="cannot be combined with a cache or an attention_mask"):
        model(tokens, document_ids=docs, attention_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"document_ids must have the shape of input_ids \(2, 6\)"):
        model(tokens, document_ids=docs[:, :5])
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        model(tokens, document_ids=docs.double())
    split = torch.tensor([[0, 0, 1, 1, 0, 0]] * 2)
    with pytest.raises(ValueError, match="row 0 uses a document id in more than one separate run"):
        model(tokens, document_ids=split)
    enc = encoder("learned")
    with pytest.raises(ValueError, match="cannot be combined with an attention_mask"):
        enc(tokens, attention_mask=torch.ones(2, 6), document_ids=docs)
