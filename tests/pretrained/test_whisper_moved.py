"""Whisper's transcription with its model moved to another device by hand (``model.to``), as
a user with a GPU does: every path (timestamps, word timestamps, temperature fallback,
beams, batches of recordings, short-form text, streaming) gives what it gives on the CPU.

The device is CUDA under ``QKV_TEST_DEVICE=cuda`` and torch's lazy-tensor device elsewhere
(``tests/second_device.py``): either refuses a CPU tensor in an op and ``.numpy()`` of its
own, the mistakes these paths made before (a beam's tokens, a seeded CPU generator, the word
alignment's scores). A tiny random model in float64 with a word-level tokenizer of
Whisper's special and timestamp tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from qkv.models.speech import SpeechSeq2Seq, SpeechSeq2SeqConfig
from qkv.pretrained.whisper.model import SpeechBundle
from qkv.pretrained.whisper.options import TranscribeOptions
from second_device import assert_same_run

WORDS = [f"▁w{i}" for i in range(40)] + [".", ","]
SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|startofprev|>", "<|nocaptions|>",
           "<|notimestamps|>"]
STAMPS = [f"<|{k * 0.02:.2f}|>" for k in range(1501)]


def _bundle() -> SpeechBundle:
    vocab = {t: i for i, t in enumerate(WORDS + SPECIAL + STAMPS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="."))
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    tokenizer.add_special_tokens(SPECIAL + STAMPS)
    eot, sot, prev, nocaptions, notimestamps = (vocab[t] for t in SPECIAL)
    torch.manual_seed(0)
    config = SpeechSeq2SeqConfig(
        vocab_size=len(vocab), n_mels=80, d_model=16, num_heads=2, num_encoder_layers=1,
        num_decoder_layers=2, d_ff=32, max_source_len=1500, max_len=64, pad_id=eot,
        bos_id=sot, eos_id=eot)
    model = SpeechSeq2Seq(config).double().eval()
    return SpeechBundle(model, tokenizer, "tiny", (sot, notimestamps),
                        suppress=(sot, prev, nocaptions), suppress_first=(eot,),
                        alignment_heads=((1, 0), (1, 1)))


@pytest.fixture(scope="module")
def recordings() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal(16000 * n) * 0.1).astype(np.float32) for n in (35, 12)]


def _on_both(moved, run):
    """``run(bundle)`` with the model on the CPU, then moved: both results."""
    bundle = _bundle()
    on_cpu = run(bundle)
    bundle.model.to(moved)
    return on_cpu, run(bundle)


OPTIONS = {
    # greedy with timestamps; the windows' repetitive text fails the compression-ratio
    # check, so the seeded sampling of the temperature fallback runs too
    "words and fallback": dict(word_timestamps=True, max_new_tokens=12, temperatures=(0.0, 0.4),
                               logprob_threshold=None, no_speech_threshold=None),
    "beams": dict(beam_size=2, max_new_tokens=8, temperatures=(0.0,),
                  logprob_threshold=None, no_speech_threshold=None),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_transcripts_equal_the_cpu_run(moved, recordings, name):
    o = TranscribeOptions(**OPTIONS[name], batch_size=2)
    on_cpu, on_device = _on_both(moved, lambda b: list(b.transcripts(recordings, o)))
    assert_same_run(on_cpu, on_device)
    segments = [s for t in on_cpu for s in t.segments]
    assert segments, "no segment: the comparison covered nothing"
    if name == "words and fallback":
        assert any(s.words for s in segments), "no word was timed"
        assert any(s.temperature > 0 for s in segments), "the fallback never sampled"


def test_short_form_text_and_streaming_equal_the_cpu_run(moved, recordings):
    def run(b):
        return (b.transcribe(recordings[1], max_new_tokens=6),
                list(b.stream(recordings[1], max_new_tokens=6)))

    on_cpu, on_device = _on_both(moved, run)
    assert_same_run(on_cpu, on_device)
    assert on_cpu[0] and on_cpu[1], "no text: the comparison covered nothing"


def test_alignment_equals_the_cpu_run(moved, recordings):
    from qkv.inspect.alignment import cross_attention_alignment

    def run(b):
        features = b.features(recordings[1]).double()  # (1, n_mels, 3000)
        device = next(b.model.parameters()).device
        tokens = [*b.prompt, *b.tokens(features.to(device), max_new_tokens=6)[0]]
        matrix = cross_attention_alignment(b.model, features.to(device), tokens,
                                           b.alignment_heads)  # (T, S)
        return tokens, matrix.cpu()

    (tokens, matrix), (tokens_moved, matrix_moved) = _on_both(moved, run)
    assert tokens == tokens_moved
    assert_same_run(matrix.tolist(), matrix_moved.tolist(), "alignment")


def test_the_commands_alignment_figure_and_speech_viewer_run_moved(moved, recordings, tmp_path,
                                                                  monkeypatch):
    import functools

    import soundfile

    from qkv.cli.inspect_speech import inspect_speech
    from qkv.cli.transcribe_cmd import _align

    wav = tmp_path / "clip.wav"
    soundfile.write(wav, recordings[1], 16000)
    bundle = _bundle()
    bundle.model.to(moved)
    for method in ("tokens", "transcript"):  # few tokens: the tiny model's 64 positions
        monkeypatch.setattr(bundle, method,
                            functools.partial(getattr(bundle, method), max_new_tokens=6))
    png = _align(bundle, wav, tmp_path / "a.png")  # qkv transcribe --align
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    files, _ = inspect_speech(bundle, wav, tmp_path / "inspect", title="moved")  # qkv inspect
    # the viewer's time axis: 30 s of frames in rows of 0.5 s (its time bins on the device)
    page = files["viewer"].read_text()
    assert files["viewer"].stat().st_size > 10_000 and '"S": 60' in page.replace('"S":60', '"S": 60')
