"""``qkv inspect whisper-tiny.en AUDIO``: the transcription's cross-attention over a time axis."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner
from whisper_refs import SENTENCES, espeak, whisper

import qkv.pretrained
from qkv.cli.app import app
from qkv.inspect import capture

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})


def _page_data(html: str) -> dict:
    block = re.search(r'<script type="application/json"[^>]*>(.*?)</script>', html, re.S)
    assert block, "no JSON data block in the page"
    return json.loads(block.group(1))


@pytest.mark.self_check
def test_inspect_speech_writes_time_axis_viewer_and_alignment(tmp_path, monkeypatch):
    clip = espeak(SENTENCES[1], tmp_path, "clip")
    bundle = whisper()
    monkeypatch.setattr(qkv.pretrained, "load", lambda name, **options: bundle)
    out = tmp_path / "inspect"
    result = runner.invoke(app, ["inspect", "whisper-tiny.en", str(clip), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "alignment.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # issue 27: the transcript it drew is printed, and each stage says what it does
    features = bundle.features(str(clip))[:1]
    said = bundle.text(bundle.tokens(features)[0])
    assert f"transcript (first 30 s): {said}" in result.stdout, result.stdout
    data = _page_data((out / "viewer.html").read_text(encoding="utf-8"))
    # the time axis in rows of 0.5 s: 60 for the window, not 1,500 frames
    assert data["tokens"]["source"][:2] == ["0.00 s", "0.50 s"], data["tokens"]["source"][:3]
    assert len(data["tokens"]["source"]) == 60 and data["axes"]["source"]["frames"] == 25
    kinds = {g["kind"] for g in data["groups"]}
    assert "cross" in kinds, f"no cross-attention in the page: {kinds}"
    # The page's cross-attention is the model's: the greedy transcription fed back.
    tokens = torch.tensor([[*bundle.prompt, *bundle.tokens(features)[0]]])
    with capture(bundle.model) as cap:
        bundle.model(features, tokens)
    rows = cap.weights["decoder_blocks.0.cross_attn"].sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5)


def test_inspect_speech_refuses_text_options(tmp_path, monkeypatch):
    bundle = whisper()
    monkeypatch.setattr(qkv.pretrained, "load", lambda name, **options: bundle)
    result = runner.invoke(app, ["inspect", "whisper-tiny.en", str(tmp_path / "no.wav")])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert "audio file" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["inspect", "whisper-tiny.en", "x.wav", "--generate", "3"])
    assert result.exit_code == 2 and "--generate" in result.output


@pytest.mark.parametrize("flag", ["--target"])
def test_inspect_speech_refuses_target(flag, monkeypatch):
    bundle = whisper()
    monkeypatch.setattr(qkv.pretrained, "load", lambda name, **options: bundle)
    result = runner.invoke(app, ["inspect", "whisper-tiny.en", "x.wav", flag, "hello"])
    assert result.exit_code == 2 and flag in result.output
