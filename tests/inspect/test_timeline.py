"""The generation timeline: each cached decoding step's weights, exact, and its page data."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
import torch
from inspect_refs import build, math_weights
from typer.testing import CliRunner

import qkv.inspect.timeline as timeline
from qkv.generate import greedy
from qkv.inspect.capture import capture
from qkv.inspect.timeline import record_generation
from qkv.inspect.viewer import view

N = 6


def _prompt(run, P: int = 5) -> torch.Tensor:
    return run.args[0][0, :P]  # (P,)


@pytest.fixture(scope="module", params=["gpt2", "llama_gqa", "alibi"])
def recorded(request):
    model, run = build(request.param)
    prompt = _prompt(run)
    return request.param, model, prompt, record_generation(model, prompt, N)


def test_ids_equal_qkv_generate_greedy(recorded):
    kind, model, prompt, gen = recorded
    expected = greedy(model, prompt[None], max_new_tokens=N)[0]
    assert torch.equal(gen.new_ids, expected), (kind, gen.new_ids, expected)
    assert torch.equal(gen.ids[: gen.prompt_len], prompt) and gen.steps == N


def test_step_weights_equal_full_sequence_causal_rows(recorded):
    """Step s's cached-call weights equal row P - 1 + s of one uncached forward pass over the
    prompt and the generated tokens (the math backend's weights, need_weights=True)."""
    kind, model, _, gen = recorded
    P = gen.prompt_len
    seq = gen.ids[None, :-1]  # (1, P + N - 1): every token that was fed
    ref = math_weights(model, lambda: model(seq))
    assert list(gen.weights) == list(ref)
    for name, w in gen.weights.items():
        full = ref[name][0][0]  # (H, L, L), one call
        expected = full[:, P - 1 :].transpose(0, 1)  # (N, H, L)
        assert w.shape == expected.shape == (N, full.shape[0], P + N - 1), name
        err = (w - expected).abs().max().item()
        assert err < 1e-5, f"{kind} {name}: max error {err:.2e}"
        # Each step sees exactly its keys: the prompt and the tokens generated before it.
        for s in range(N):
            step = gen.step(s, name)
            assert step.shape[-1] == P + s
            assert (w[s, :, P + s :] == 0).all(), f"{name} step {s} attends to the future"
            assert (step.sum(-1) - 1).abs().max() < 1e-5


def test_layers_and_heads_are_chosen_as_in_capture():
    model, run = build("gpt2")
    gen = record_generation(model, _prompt(run).tolist(), 3, layers=[-1], heads=[2, 0])
    assert list(gen.weights) == ["blocks.1.self_attn"] and gen.heads["blocks.1.self_attn"] == [2, 0]
    full = record_generation(model, _prompt(run)[None], 3)
    err = (gen.weights["blocks.1.self_attn"] - full.weights["blocks.1.self_attn"][:, [2, 0]]).abs()
    assert err.max() == 0, f"max error {err.max():.2e}"


def test_stops_at_eos_and_keeps_it():
    model, run = build("gpt2")
    prompt = _prompt(run)
    first = int(greedy(model, prompt[None], max_new_tokens=1)[0, 0])
    gen = record_generation(model, prompt, N, eos_id=first)
    assert gen.new_ids.tolist() == [first]
    assert all(w.shape[0] == 1 for w in gen.weights.values())
    assert torch.equal(gen.new_ids, greedy(model, prompt[None], max_new_tokens=N, eos_id=first)[0])


def test_page_data_holds_the_codes_of_the_weights(recorded):
    _, model, _, gen = recorded
    labels = [f"w{i}" for i in range(gen.ids.numel())]
    v = view(gen, labels)
    assert v.data["groups"] == [] and "timeline (6 steps)" in repr(v)
    tl = json.loads(json.dumps(v.data))["timeline"]
    assert (tl["prompt"], tl["steps"], tl["labels"]) == (gen.prompt_len, N, labels)
    for layer in tl["layers"]:
        w = gen.weights[layer["name"]].double().numpy()  # (N, H, S)
        codes = np.frombuffer(base64.b64decode(layer["w"]), dtype=np.uint8).reshape(w.shape)
        decoded = (codes / 255.0) ** 2
        bound = (2 * np.sqrt(w) + 0.5 / 255) * (0.5 / 255) + 1e-9
        assert (np.abs(decoded - w) <= bound).all(), layer["name"]
    # With a model's head view: labels of the whole generated text serve both.
    full = view(model, labels[:-1], input_ids=gen.ids[None, :-1], timeline=gen)
    assert full.data["timeline"]["labels"] == [str(i) for i in gen.ids.tolist()]  # too few
    both = view(model, labels, input_ids=gen.ids[None], timeline=gen)
    assert both.data["timeline"]["labels"] == labels and both.data["groups"]


def test_errors(monkeypatch):
    model, run = build("gpt2")
    prompt = _prompt(run)
    s2s, _ = build("seq2seq")
    with pytest.raises(TypeError, match="needs a decoder-only LM with new_cache"):
        record_generation(s2s, prompt, 3)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        record_generation(model, prompt, 0)
    with pytest.raises(ValueError, match=r"5 tokens \+ max_new_tokens=1020 exceeds the model's max_len=1024"):
        record_generation(model, prompt, 1020)
    with pytest.raises(ValueError, match=r"must hold integer token ids, got dtype torch\.float32"):
        record_generation(model, prompt.float(), 3)
    with pytest.raises(ValueError, match=r"ids outside \[0, 37\)"):
        record_generation(model, [1, 99], 3)
    with pytest.raises(ValueError, match=r"one non-empty prompt, \(P,\) or \(1, P\), got shape \(2, 5\)"):
        record_generation(model, torch.stack([prompt, prompt]), 3)
    with pytest.raises(TypeError, match="prompt_ids must be a"):
        record_generation(model, "abc", 3)
    gen = record_generation(model, prompt, 2)
    with pytest.raises(ValueError, match=r"step must be an int in \[0, 2\), got 2"):
        gen.step(2, "blocks.0.self_attn")
    with pytest.raises(ValueError, match="the timeline needs 7 labels"):
        gen.page_data(["a"])
    with pytest.raises(TypeError, match="timeline must be a Generation"):
        view(model, input_ids=gen.ids[None], timeline="x")
    with pytest.raises(ValueError, match="either as source or as timeline="):
        view(gen, timeline=gen)
    monkeypatch.setattr(timeline, "TIMELINE_BUDGET", 10)
    with pytest.raises(ValueError, match="more than the page's budget of 10"):
        view(gen)


def test_a_capture_of_generation_agrees(recorded):
    """capture() around qkv.generate's own loop (rows=-1) sees the same step weights."""
    kind, model, prompt, gen = recorded
    with capture(model, rows=-1) as cap:
        greedy(model, prompt[None], max_new_tokens=N)
    for name, w in gen.weights.items():
        other = cap.weights[name][0].transpose(0, 1)  # (N, H, S)
        err = (w - other).abs().max().item()
        assert err == 0, f"{kind} {name}: max error {err:.2e}"


def test_cli_generate_adds_the_timeline(tmp_path):
    checkpoint = pytest.importorskip("qkv.train.checkpoint")
    from qkv.cli.app import app
    from qkv.data.tokenizers import CharTokenizer
    from qkv.models import DecoderLM, DecoderLMConfig

    tok = CharTokenizer.fit("the cat sat on the mat")
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(tok.vocab_size, d_model=16, num_layers=2, num_heads=2,
                                      max_len=32))  # fmt: skip
    ck = tmp_path / "lm"
    checkpoint.save_checkpoint(ck, model, tokenizers={"text": tok})
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    out = tmp_path / "out"
    result = runner.invoke(app, ["inspect", str(ck), "the cat", "--generate", "4", "--out",
                                 str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "generated 4 tokens greedily with the KV cache" in result.output
    html = (out / "viewer.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'class="qkv-data">(.*?)</script>', html, re.S).group(1))
    assert data["timeline"]["prompt"] == 7 and data["timeline"]["steps"] == 4
    assert len(data["tokens"]["source"]) == 11 and data["tokens"]["source"][:3] == ["t", "h", "e"]
    too_long = runner.invoke(app, ["inspect", str(ck), "the cat", "--generate", "30", "--out",
                                   str(out)])  # fmt: skip
    assert too_long.exit_code != 0 and "--generate 30 after 7 tokens exceeds" in too_long.output
    assert "Traceback" not in too_long.output


def test_cli_generate_refuses_an_encoder_decoder():
    from qkv.cli.inspect_cmd import Prepared, add_generation

    model, run = build("seq2seq")
    src, tgt = run.args
    p = Prepared(model, src[:1], ["s"] * 9, target=tgt[:1], target_tokens=["t"] * 7)
    with pytest.raises(ValueError, match="--generate is for decoder-only models"):
        add_generation(p, None, 3)
