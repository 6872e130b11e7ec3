"""``qkv inspect CHECKPOINT_OR_MODEL_NAME "text" [--target "text"] --out DIR``."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from qkv.cli.app import app
from qkv.data.tokenizers import CharTokenizer
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer

checkpoint = pytest.importorskip("qkv.train.checkpoint")
runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
TEXT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    tok = CharTokenizer.fit(TEXT)
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(tok.vocab_size, d_model=16, num_layers=2, num_heads=2,
                                      max_len=64, positions="sinusoidal"))  # fmt: skip
    path = tmp_path_factory.mktemp("ck") / "lm"
    checkpoint.save_checkpoint(path, model, tokenizers={"text": tok})
    return path


@pytest.fixture(scope="module")
def seq2seq_checkpoint(tmp_path_factory):
    src, tgt = CharTokenizer.fit(TEXT), CharTokenizer.fit("le chat assis")
    torch.manual_seed(0)
    model = Seq2SeqTransformer(Seq2SeqConfig(src.vocab_size, tgt.vocab_size, d_model=16,
                                             num_heads=2, d_ff=32, max_len=64))  # fmt: skip
    path = tmp_path_factory.mktemp("ck") / "mt"
    checkpoint.save_checkpoint(path, model, tokenizers={"src": src, "tgt": tgt})
    return path


def test_help_shows_the_example():
    result = runner.invoke(app, ["inspect", "--help"])
    assert result.exit_code == 0
    assert "qkv inspect all-MiniLM-L6-v2" in result.output and "--target" in result.output


def test_writes_pngs_trace_and_viewer_for_a_language_model(lm_checkpoint, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["inspect", str(lm_checkpoint), TEXT, "--out", str(out)])
    assert result.exit_code == 0, result.output
    names = {p.name for p in out.iterdir()}
    assert {"grid-blocks-self-attn.png", "head-blocks-0-self-attn-h0.png", "rollout.png",
            "masks.png", "positions.png", "trace.txt", "trace.json",
            "viewer.html"} <= names, names  # fmt: skip
    assert all((out / n).stat().st_size > 1000 for n in names if n.endswith(".png"))
    assert f"viewer: {out / 'viewer.html'}" in result.output
    assert "22 tokens: t h e" in result.output
    journey = json.loads((out / "trace.json").read_text())
    assert journey["position"] == 21 and journey["token"] == "t"


@pytest.mark.parametrize("target", [None, "le chat"])
def test_encoder_decoder_with_and_without_a_target(seq2seq_checkpoint, tmp_path, target):
    args = ["inspect", str(seq2seq_checkpoint), "the cat", "--out", str(tmp_path)]
    result = runner.invoke(app, args + (["--target", target] if target else []))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "alignment.png").exists()
    assert (tmp_path / "grid-decoder-blocks-cross-attn.png").exists()
    if target is None:
        assert "target: the model's own greedy output" in result.output


def test_errors_are_reported_not_raised(lm_checkpoint, tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path / "missing"), "hi", "--out",
                                 str(tmp_path)])  # fmt: skip
    assert result.exit_code == 2 and "error:" in result.output
    result = runner.invoke(app, ["inspect", str(lm_checkpoint), "the", "--target", "x",
                                 "--out", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 2
    assert "--target is only for encoder-decoder models" in result.output
    long = runner.invoke(app, ["inspect", str(lm_checkpoint), TEXT, "--max-tokens", "5",
                               "--out", str(tmp_path / "short")])  # fmt: skip
    assert long.exit_code == 0 and "input cut to its first 5 of 22 tokens" in long.output


def test_past_the_picture_budget_only_streamed_files_are_written(lm_checkpoint, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    """An input whose full weights would not fit gets the viewer and the trace (streamed)
    and a note saying why the PNGs were skipped, instead of running out of memory."""
    from qkv.inspect import report

    model = checkpoint.load_checkpoint(lm_checkpoint).model
    need = report.weights_bytes(model, torch.zeros(1, 22, dtype=torch.long))
    assert need == 2 * 2 * 22 * 22 * 4  # 2 layers x 2 heads x T x T float32
    monkeypatch.setattr(report, "PICTURE_BUDGET", need - 1)
    out = tmp_path / "out"
    result = runner.invoke(app, ["inspect", str(lm_checkpoint), TEXT, "--out", str(out)])
    assert result.exit_code == 0, result.output
    names = {p.name for p in out.iterdir()}
    assert {"note.txt", "viewer.html", "trace.txt", "trace.json", "masks.png"} <= names, names
    assert not any(n.startswith(("grid-", "head-", "rollout")) for n in names), names
    assert "PNG pictures were skipped" in (out / "note.txt").read_text()
    journey = json.loads((out / "trace.json").read_text())
    assert journey["position"] == 21 and journey["token"] == "t"
