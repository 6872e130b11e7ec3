"""qkv.inspect.trace: a token's journey, whose numbers equal the captured ones."""

from __future__ import annotations

import json

import pytest
import torch
from inspect_refs import build

import qkv.inspect as qi


def _stream(cap, name, batch, position):
    return cap.values[name][0][batch, position].double()


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "encoder", "vit"])
def test_trace_numbers_equal_the_captured_ones(kind):
    model, run = build(kind)
    blocks = len(model.blocks)
    points = ["blocks.0.hook_resid_pre"] + [
        f"blocks.{i}.{h}" for i in range(blocks) for h in ("hook_resid_mid", "hook_resid_post")
    ]
    with qi.capture(model, record=points) as cap, torch.no_grad():
        run()
    ids = run.args[0]
    position, batch = 3, 1
    t = qi.trace(model, ids, position, batch=batch, top_k=2, model_kwargs=run.kwargs)
    attention = [s for s in t.steps if s.heads is not None]
    assert [s.stage for s in attention] == [f"layer {i} self-attention" for i in range(blocks)]
    for i, step in enumerate(attention):
        w = cap.weights[f"blocks.{i}.self_attn"][batch, :, position]  # (H, S)
        for h, head in enumerate(step.heads):
            vals, idx = w[h].topk(2)
            assert [e["index"] for e in head["top"]] == idx.tolist()
            assert [e["weight"] for e in head["top"]] == pytest.approx(vals.tolist(), abs=1e-7)
    vectors = [s for s in t.steps if s.norm is not None and s.stage != "embedding"]
    assert len(vectors) == len(points)
    previous = None
    for step, name in zip(vectors, points, strict=True):
        v = _stream(cap, name, batch, position)
        assert step.norm == pytest.approx(float(v.norm()), rel=1e-12), step.stage
        if previous is not None:
            assert step.change == pytest.approx(float((v - previous).norm()), rel=1e-9)
        previous = v


def test_seq2seq_trace_has_cross_attention_over_source_labels():
    model, _ = build("seq2seq")
    src = torch.randint(3, 30, (1, 6), generator=torch.Generator().manual_seed(0))
    tgt = torch.randint(3, 30, (1, 4), generator=torch.Generator().manual_seed(1))
    t = qi.trace(model, src, -1, target=tgt, tokens=list("abcdef"), target_tokens=list("WXYZ"))
    assert t.position == 3 and t.token == "Z"
    cross = [s for s in t.steps if s.stage.endswith("cross-attention")]
    assert len(cross) == 2
    assert all(e["token"] in "abcdef" for h in cross[0].heads for e in h["top"])
    selfs = [s for s in t.steps if s.stage.endswith(" self-attention")]
    assert all(e["token"] in "WXYZ" for h in selfs[0].heads for e in h["top"])
    # Without a target the encoder is traced.
    enc = qi.trace(model, src, 0, tokens=list("abcdef"))
    assert enc.token == "a" and not any("cross" in s.stage for s in enc.steps)


def test_trace_table_and_json():
    model, _ = build("gpt2")
    ids = torch.arange(3, 10)[None]
    t = qi.trace(model, ids, 2, tokens=[f"w{i}" for i in range(7)])
    text = t.table()
    assert "journey of position 2 ('w2')" in text and "layer 1 after feed-forward" in text
    assert str(t) == text
    back = json.loads(t.to_json())
    assert back["position"] == 2 and len(back["steps"]) == len(t.steps)
    assert back["steps"][2]["heads"][0]["top"][0]["token"].startswith("w")


def test_trace_errors():
    model, _ = build("gpt2")
    ids = torch.arange(3, 8)[None]
    with pytest.raises(ValueError, match="position=5 is out of range for a sequence of 5"):
        qi.trace(model, ids, 5)
    with pytest.raises(ValueError, match="batch=1 is out of range for a batch of 1"):
        qi.trace(model, ids, 0, batch=1)
    with pytest.raises(ValueError, match="top_k must be a positive int, got 0"):
        qi.trace(model, ids, 0, top_k=0)
    with pytest.raises(ValueError, match="tokens has 2 labels but the sequence has 5"):
        qi.trace(model, ids, 0, tokens=["a", "b"])
    with pytest.raises(ValueError, match="target= is only for encoder-decoder models"):
        qi.trace(model, ids, 0, target=ids)
