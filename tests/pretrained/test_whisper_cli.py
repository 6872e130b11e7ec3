"""``qkv transcribe``, the time alignment figure, and decoding from encoder memory
(:class:`qkv.generate.session.EncodedInputs`) on a tiny random speech model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner
from whisper_refs import SENTENCES, espeak, wer, whisper

import qkv.pretrained
from helpers import assert_close
from qkv.cli.app import app
from qkv.generate import beam_search, greedy, sample
from qkv.generate.session import EncodedInputs
from qkv.inspect.alignment import cross_attention_alignment, plot_time_alignment
from qkv.models.speech import SpeechSeq2Seq, SpeechSeq2SeqConfig

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
TINY = SpeechSeq2SeqConfig(vocab_size=50, n_mels=8, d_model=16, num_heads=2, num_encoder_layers=1,
                           num_decoder_layers=2, d_ff=32, max_source_len=20, max_len=24,
                           pad_id=0, bos_id=1, eos_id=2)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return SpeechSeq2Seq(TINY).eval()


def test_transcribe_command_prints_text_and_writes_alignment(tmp_path, monkeypatch):
    clip = espeak(SENTENCES[3], tmp_path, "clip")
    bundle = whisper()  # loaded once per process
    monkeypatch.setattr(qkv.pretrained, "load", lambda name, **options: bundle)
    result = runner.invoke(app, ["transcribe", str(clip), "--align", str(tmp_path / "a.png")])
    assert result.exit_code == 0, result.output
    assert wer(SENTENCES[3], result.stdout) <= 0.2, result.stdout
    png = (tmp_path / "a.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_transcribe_command_errors_are_one_line(tmp_path):
    result = runner.invoke(app, ["transcribe", str(tmp_path / "absent.wav")])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert "Traceback" not in result.output
    (tmp_path / "bad.wav").write_bytes(b"RIFF0000WAVEjunk")
    result = runner.invoke(app, ["transcribe", str(tmp_path / "bad.wav")])
    assert result.exit_code == 2 and "cannot decode audio" in result.output


def test_key_bias_is_a_config_option():
    import dataclasses

    plain = SpeechSeq2Seq(TINY)
    biased = SpeechSeq2Seq(dataclasses.replace(TINY, k_bias=True))
    for model, has in ((plain, False), (biased, True)):
        for block in [*model.encoder_blocks, *model.decoder_blocks]:
            attns = [block.self_attn] + ([block.cross_attn] if block.cross_attn else [])
            assert all((a.k_proj.bias is not None) == has for a in attns)
            assert all(a.v_proj.bias is not None for a in attns)
    with pytest.raises(ValueError, match="k_bias must be a bool"):
        dataclasses.replace(TINY, k_bias=1)


def test_alignment_rows_sum_to_one_and_follow_heads(tiny):
    features = torch.randn(1, 8, 40)
    matrix = cross_attention_alignment(tiny, features, [1, 5, 7], heads=[(1, 0), (1, 1)])
    assert matrix.shape == (3, 20)
    assert_close(matrix.sum(-1), torch.ones(3), atol=1e-5, name="alignment row sums")
    default = cross_attention_alignment(tiny, features, [1, 5, 7])  # second half: layer 1
    assert_close(default, matrix, atol=1e-6, name="default heads")
    with pytest.raises(ValueError, match=r"heads has \(5, 0\)"):
        cross_attention_alignment(tiny, features, [1, 5], heads=[(5, 0)])


def test_time_alignment_figure(tmp_path):
    path = plot_time_alignment(torch.rand(3, 20), tmp_path / "t.png", tokens=["a", "b", "c"],
                               seconds_per_frame=0.02, duration=0.2)
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="2 labels for 3 rows"):
        plot_time_alignment(torch.rand(3, 20), tmp_path / "u.png", tokens=["a", "b"],
                            seconds_per_frame=0.02)
    assert not (tmp_path / "u.png").exists()
    marked = plot_time_alignment(torch.rand(3, 20), tmp_path / "w.png", tokens=["a", "b", "c"],
                                 seconds_per_frame=0.02, words=[(" hi", 0.0, 0.1),
                                                                (" there", 0.12, 0.3)])
    assert marked.stat().st_size > path.stat().st_size  # the bands and the word axis
    with pytest.raises(ValueError, match=r"ends at 0\.1 before it starts at 0\.2"):
        plot_time_alignment(torch.rand(3, 20), tmp_path / "v.png", tokens=["a", "b", "c"],
                            seconds_per_frame=0.02, words=[(" hi", 0.2, 0.1)])
    assert not (tmp_path / "v.png").exists()


def _inputs(tiny, B=3, **kw):
    torch.manual_seed(1)
    memory = tiny.encode(torch.randn(B, 8, 30))
    return EncodedInputs(memory, [[1, 3]] * B, **kw), memory


@torch.no_grad()
def test_memory_session_greedy_equals_full_recompute(tiny):
    inputs, memory = _inputs(tiny)
    out = greedy(tiny, inputs, max_new_tokens=6, eos_id=None)  # (B, 6)
    seq = torch.cat([torch.tensor([[1, 3]] * 3), out], dim=1)  # (B, 8)
    logits = tiny.decode(seq[:, :-1], memory)[:, 1:]  # the steps that chose out
    assert torch.equal(logits.argmax(-1), out)
    single = [greedy(tiny, EncodedInputs(memory[b : b + 1], [[1, 3]]), max_new_tokens=6,
                     eos_id=None) for b in range(3)]  # fmt: skip
    assert torch.equal(torch.cat(single), out), "batched != one at a time"


@torch.no_grad()
def test_memory_session_suppression_and_beam(tiny):
    inputs, _ = _inputs(tiny, suppress=list(range(3, 50, 2)), suppress_first=[4, 6])
    out = greedy(tiny, inputs, max_new_tokens=5, eos_id=None)
    assert not bool((out % 2 == 1)[out >= 3].any()), out  # odd ids >= 3 never chosen
    assert not bool(torch.isin(out[:, 0], torch.tensor([4, 6])).any())
    beam1 = beam_search(tiny, inputs, beam_size=1, alpha=0.0, max_new_tokens=5, eos_id=None)
    assert torch.equal(beam1, out)
    beam = beam_search(tiny, inputs, beam_size=3, max_new_tokens=5, eos_id=None)
    assert beam.shape == (3, 5)
    drawn = sample(tiny, inputs, max_new_tokens=5, temperature=1.0, seed=0, eos_id=None)
    assert not bool((drawn % 2 == 1)[drawn >= 3].any())


def test_memory_session_rejects_bad_inputs(tiny):
    memory = torch.zeros(2, 5, 16)
    with pytest.raises(ValueError, match="one length"):
        greedy(tiny, EncodedInputs(memory, [[1], [1, 3]]), max_new_tokens=5)
    with pytest.raises(ValueError, match="batch size 2 but there are 1 prompts"):
        greedy(tiny, EncodedInputs(memory, [[1]]), max_new_tokens=5)
    with pytest.raises(ValueError, match="suppress must be a list of token ids"):
        greedy(tiny, EncodedInputs(memory, [[1], [1]], suppress=[99]), max_new_tokens=5)
    with pytest.raises(ValueError, match="max_len=24"):
        greedy(tiny, EncodedInputs(memory, [[1], [1]]), max_new_tokens=30)
    with pytest.raises(TypeError, match=r"encodes features, not token ids: pass .*EncodedInputs"):
        greedy(tiny, [[1, 2]], max_new_tokens=5)
    with pytest.raises(TypeError, match=r"memory must be a \(B, S, E\) tensor"):
        greedy(tiny, EncodedInputs(np.zeros((2, 5, 16)), [[1], [1]]), max_new_tokens=5)  # type: ignore[arg-type]
