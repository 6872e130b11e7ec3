"""Long-form transcription with timestamps (issue 28): features of a whole recording, the
seek loop, temperature fallback, beams, batches, and word timestamps.

References: transformers' ``WhisperFeatureExtractor`` (long audio, no truncation) and
``WhisperForConditionalGeneration.generate(..., return_timestamps=True)`` on the same weights,
greedy, with and without the previous text and the thresholds; word times against espeak-ng
words placed at known times.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from whisper_refs import SENTENCES, espeak, hf_features, hf_whisper, whisper

import qkv.pretrained
from qkv.pretrained.whisper import audio
from qkv.pretrained.whisper.mel_frames import FeatureWindows, log10_mel_blocks
from qkv.pretrained.whisper.options import TranscribeOptions
from qkv.pretrained.whisper.word_times import dtw, median_filter

TIME_STEP = 0.02  # one timestamp token
WORD_BOUND = 0.2  # seconds, the bound on each word's start and end


@pytest.fixture(scope="module")
def bundle():
    return whisper()


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory) -> np.ndarray:
    """About 62 s (three windows): the five sentences two and a half times over, with 0.5-2.5 s
    pauses."""
    folder = tmp_path_factory.mktemp("long")
    rng = np.random.default_rng(0)
    said = [audio.load_audio(espeak(s, folder, f"s{i}")) for i, s in enumerate(SENTENCES)]
    parts = []
    for i in range(12):
        parts += [said[i % 5], np.zeros(int(16000 * rng.uniform(0.5, 2.5)), np.float32)]
    return np.concatenate(parts)


def _hf_generation_config():
    transformers = pytest.importorskip("transformers")
    folder = qkv.pretrained.locate("whisper-tiny.en")
    cfg = json.loads((folder / "config.json").read_text())
    return transformers.GenerationConfig(
        decoder_start_token_id=50257, eos_token_id=50256, pad_token_id=50256,
        no_timestamps_token_id=50362, max_initial_timestamp_index=50,
        suppress_tokens=cfg["suppress_ids"], begin_suppress_tokens=cfg["suppress_ids_begin"],
        is_multilingual=False, return_timestamps=True, prev_sot_token_id=50360, max_length=448,
    )  # fmt: skip


def _hf_segments(samples: np.ndarray, **kwargs) -> list[tuple[float, float, str]]:
    model = hf_whisper()
    model.generation_config = _hf_generation_config()
    feats = hf_features()(samples, sampling_rate=16000, return_tensors="pt", truncation=False,
                          padding="longest", return_attention_mask=True)  # fmt: skip
    with torch.no_grad():
        out = model.generate(feats.input_features, attention_mask=feats.attention_mask,
                             return_timestamps=True, return_segments=True, **kwargs)  # fmt: skip
    text = whisper().decode_text
    return [(float(s["start"]), float(s["end"]), text(s["tokens"].tolist()).strip())
            for s in out["segments"][0]]  # fmt: skip


def _ours(transcript) -> list[tuple[float, float, str]]:
    return [(s.start, s.end, s.text.strip()) for s in transcript.segments]


def _compare(ours, theirs) -> None:
    assert [t for *_, t in ours] == [t for *_, t in theirs], (ours, theirs)
    worst = max(max(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in zip(ours, theirs, strict=True))
    assert worst <= TIME_STEP + 1e-9, f"timestamps differ by {worst:.3f} s"


# --- features -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [150, 201, 16000 * 3 + 7, 480000 + 333, 1234567])
@pytest.mark.parametrize("block", [7, 1000, 480000])
def test_block_by_block_frames_equal_one_stft(n, block):
    x = (np.random.default_rng(n).standard_normal(n) * 0.1).astype(np.float32)
    chunks = list(log10_mel_blocks(x[i : i + block] for i in range(0, n, block)))
    got = torch.cat(chunks, 1) if chunks else torch.zeros(80, 0)
    assert got.shape[1] == n // 160
    if n > 200:  # torch's reflection needs more samples than the pad
        stft = torch.stft(torch.from_numpy(x), 400, 160, window=torch.hann_window(400),
                          return_complex=True)[:, : n // 160]  # fmt: skip
        ref = (audio.mel_filters(80) @ stft.abs() ** 2).clamp(min=1e-10).log10()
        err = float((got - ref).abs().max())
        assert err <= 1e-5, f"max error {err:.3g}"


def test_windows_equal_transformers_long_features(long_clip):
    ref = hf_features()(long_clip, sampling_rate=16000, return_tensors="pt", truncation=False,
                        padding="longest").input_features[0]  # (80, F)  # fmt: skip
    fw = FeatureWindows(lambda: iter(audio.split_windows(long_clip)))
    assert fw.frames == ref.shape[1] == long_clip.shape[0] // 160
    for seek in (0, 1234, 3500, fw.frames - 100):
        w, r = fw.window(seek), ref[:, seek : seek + 3000]
        err = float((w[:, : r.shape[1]] - r).abs().max())
        assert err <= 1e-4, f"seek {seek}: max error {err:.3g}"
        assert not w[:, r.shape[1] :].any()  # zero past the end, as transformers pads
    with pytest.raises(ValueError, match="before frame"):
        fw.window(10)


def test_a_short_recording_has_log_mel_features():
    x = (np.random.default_rng(0).standard_normal(16000 * 7) * 0.1).astype(np.float32)
    fw = FeatureWindows(lambda: iter([x]))
    err = float((fw.window(0) - audio.log_mel(x)[0]).abs().max())
    assert err <= 1e-5 and fw.frames == 700, err


# --- segments against transformers ----------------------------------------------------------


def test_segments_equal_transformers_greedy(long_clip, bundle):
    """transformers' defaults: greedy, no previous text, no silence test."""
    ours = _ours(bundle.transcript(long_clip, TranscribeOptions.transformers()))
    _compare(ours, _hf_segments(long_clip))
    assert ours[-1][1] > 45 and len(ours) >= 8, ours


def test_segments_equal_transformers_with_previous_text_and_thresholds(long_clip, bundle):
    """openai-whisper's defaults (previous text, thresholds, silence skipped), greedy: the
    fallback temperatures are the same, and on these clips no window needs one."""
    transcript = bundle.transcript(long_clip)
    _compare(_ours(transcript), _hf_segments(
        long_clip, condition_on_prev_tokens=True, temperature=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
        compression_ratio_threshold=2.4, logprob_threshold=-1.0, no_speech_threshold=0.6))
    assert all(s.temperature == 0.0 for s in transcript.segments)


@pytest.mark.self_check
def test_batches_and_one_beam_equal_one_at_a_time(long_clip, bundle):
    o = TranscribeOptions.transformers()
    clips = [long_clip[: 16000 * 40], long_clip[: 16000 * 12], long_clip[16000 * 5 : 16000 * 50]]
    alone = [_ours(bundle.transcript(c, o)) for c in clips]
    assert [_ours(t) for t in bundle.transcripts(clips, o, batch_size=3)] == alone
    assert _ours(bundle.transcript(clips[1], o, beam_size=1)) == alone[1]
    beams = bundle.transcript(clips[1], o, beam_size=4)
    assert beams.segments and all(s.start <= s.end for s in beams.segments), _ours(beams)


@pytest.mark.self_check
def test_batches_with_previous_text_equal_one_at_a_time(long_clip, bundle):
    """openai-whisper's defaults: after the first window each recording's prompt has its own
    length; the rows decode left-padded in one batch, each as it would alone."""
    clips = [long_clip[: 16000 * 65], long_clip[16000 * 8 : 16000 * 50]]
    alone = [_ours(bundle.transcript(c)) for c in clips]
    assert [_ours(t) for t in bundle.transcripts(clips, batch_size=2)] == alone


@torch.no_grad()
def test_ragged_rows_decode_as_each_row_alone(bundle):
    """``SpeechSeq2Seq.decode(keep=, positions=)``: left-padded prompts of 1, 4 and 7 tokens
    and three cached steps give each row the logits it has alone."""
    from qkv.pretrained.whisper.decode import _ragged

    model, torch_gen = bundle.model, torch.Generator().manual_seed(0)
    memory = model.encode(torch.randn(3, 80, 3000, generator=torch_gen))
    prompts = [[50257], [50360, 383, 2068, 50257], [50360, 40, 588, 257, 1332, 13, 50257]]
    ids, keep, positions = _ragged(prompts, 50256, memory.device)
    cache = model.new_cache()
    got = [model.decode(ids, memory, cache=cache, keep=keep, positions=positions)[:, -1]]
    for step in range(3):
        keep = torch.cat([keep, keep.new_ones((3, 1))], dim=1)
        positions = positions[:, -1:] + 1
        token = torch.full((3, 1), 300 + step)
        got.append(model.decode(token, memory, cache=cache, keep=keep, positions=positions)[:, -1])
    for b, prompt in enumerate(prompts):
        row = torch.tensor([[*prompt, 300, 301, 302]])
        want = model.decode(row, memory[b : b + 1])[0, len(prompt) - 1 :]  # (4, V)
        err = float((torch.stack([g[b] for g in got]) - want).abs().max())
        assert err <= 1e-4, f"row {b}: max error {err:.3g}"
    with pytest.raises(ValueError, match="keep must be a bool"):
        model.decode(ids, memory, keep=keep[:, :2], positions=_ragged(prompts, 0, "cpu")[2])


@pytest.mark.self_check
def test_fallback_samples_reproducibly(bundle, tmp_path):
    """A threshold no decode can pass forces every temperature: the last one's samples are
    kept, from the seed."""
    x = audio.waveform(espeak(SENTENCES[0], tmp_path, "fb"))
    o = TranscribeOptions(logprob_threshold=0.0, no_speech_threshold=None,
                          temperatures=(0.0, 0.5, 1.0), best_of=2, seed=3)  # fmt: skip
    first, again = bundle.transcript(x, o), bundle.transcript(x, o)
    assert {s.temperature for s in first.segments} == {1.0}
    assert _ours(first) == _ours(again)


def test_silence_is_flagged_and_skipped_without_the_logprob_rule(bundle):
    """Whisper says " you" to digital silence with a mean log-probability above -1, so
    upstream's rule (skip only when both tests agree) keeps it; every such segment carries a
    ``no_speech_prob`` above the threshold, and without the log-probability test none is kept."""
    quiet = np.zeros(16000 * 45, dtype=np.float32)  # two windows
    kept = bundle.transcript(quiet).segments
    assert all(s.no_speech_prob > 0.6 for s in kept), kept
    assert bundle.transcript(quiet, logprob_threshold=None).segments == ()


def test_a_long_file_is_held_a_window_or_two_at_a_time(tmp_path):
    """20 minutes of FLAC: the samples pass block by block (under 40 MB traced) and the
    feature frames held never exceed two windows' worth."""
    import tracemalloc

    sf = pytest.importorskip("soundfile")
    path = tmp_path / "long.flac"
    rng = np.random.default_rng(0)
    with sf.SoundFile(str(path), "w", 16000, 1, subtype="PCM_16") as f:
        for _ in range(20):
            f.write((rng.standard_normal(16000 * 60) * 0.01).astype(np.float32))
    tracemalloc.start()
    fw = FeatureWindows(lambda: audio.audio_windows(path))
    held = 0
    for seek in range(0, fw.frames, 2345):
        assert fw.window(seek).shape == (80, 3000)
        held = max(held, fw._held.shape[1])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert fw.frames == 16000 * 1200 // 160
    assert held <= 2 * 3000 and peak < 40e6, (held, peak)


@pytest.mark.parametrize("field,value,match", [
    ("temperatures", (), "temperatures"), ("best_of", 0, "best_of"),
    ("beam_size", 0, "beam_size"), ("max_initial_timestamp", -1.0, "max_initial_timestamp"),
    ("logprob_threshold", float("nan"), "logprob_threshold"), ("word_timestamps", 1, "True"),
])  # fmt: skip
def test_bad_options_are_refused_by_name(field, value, match):
    with pytest.raises(ValueError, match=match):
        TranscribeOptions(**{field: value})


# --- word timestamps ------------------------------------------------------------------------


def test_dtw_equals_a_plain_recursion():
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (3, 9), (7, 5), (12, 40)]:
        cost = rng.random(shape)
        T, S = shape
        acc = np.full((T + 1, S + 1), np.inf)
        acc[0, 0] = 0
        for i in range(1, T + 1):
            for j in range(1, S + 1):
                acc[i, j] = cost[i - 1, j - 1] + min(acc[i - 1, j - 1], acc[i - 1, j],
                                                     acc[i, j - 1])  # fmt: skip
        rows, cols = dtw(cost)
        assert rows[0] == cols[0] == 0 and rows[-1] == T - 1 and cols[-1] == S - 1
        assert np.all(np.diff(rows) >= 0) and np.all(np.diff(cols) >= 0)
        assert np.isclose(cost[rows, cols].sum(), acc[T, S]), (cost[rows, cols].sum(), acc[T, S])


def test_median_filter_equals_scipy():
    ndimage = pytest.importorskip("scipy.ndimage")
    x = torch.randn(2, 3, 50)
    ref = ndimage.median_filter(x.numpy(), size=(1, 1, 7), mode="mirror")
    err = float((median_filter(x) - torch.from_numpy(ref)).abs().max())
    assert err == 0.0, err


@pytest.fixture(scope="module")
def spoken_words(tmp_path_factory):
    """Words spoken one at a time by espeak-ng, trimmed to where they sound, joined with
    0.15-0.6 s pauses: ``(samples, [(word, start, end)])``."""
    folder = tmp_path_factory.mktemp("words")
    words = "the quick brown fox jumps over the lazy dog while seven small birds sing".split(" ")  # noqa: SIM905
    rng = np.random.default_rng(1)
    parts, at, truth = [np.zeros(8000, np.float32)], 8000, []
    for i, word in enumerate(words):
        x = audio.load_audio(espeak(word, folder, f"w{i}"))
        loud = np.nonzero(np.abs(x) > 0.02)[0]
        x = x[loud[0] : loud[-1] + 1]
        truth.append((word, at / 16000, (at + len(x)) / 16000))
        gap = int(16000 * rng.uniform(0.15, 0.6))
        parts += [x, np.zeros(gap, np.float32)]
        at += len(x) + gap
    return np.concatenate(parts), truth


def test_word_times_are_within_bound_of_the_truth(spoken_words, bundle):
    samples, truth = spoken_words
    transcript = bundle.transcript(samples, word_timestamps=True)
    words = transcript.words
    assert len(words) == len(truth), [w.text for w in words]
    errors = [(w.text, round(w.start - a, 2), round(w.end - b, 2))
              for w, (_, a, b) in zip(words, truth, strict=True)]  # fmt: skip
    worst = max(max(abs(s), abs(e)) for _, s, e in errors)
    assert worst <= WORD_BOUND, f"worst {worst:.2f} s: {errors}"
    assert all(0 < w.probability <= 1 for w in words)
    segment = transcript.segments[0]
    assert segment.start <= words[0].start and segment.end >= words[-1].end - 1e-9


@pytest.mark.self_check
def test_word_timestamps_leave_segments_text_alone(long_clip, bundle):
    x = long_clip[: 16000 * 45]
    plain = bundle.transcript(x)
    timed = bundle.transcript(x, word_timestamps=True)
    assert [s.text for s in timed.segments] == [s.text for s in plain.segments]
    for s in timed.segments:
        assert "".join(w.text for w in s.words) == s.text, (s.text, s.words)
        assert all(a.start <= a.end <= b.start + 1e-9 for a, b in itertools.pairwise(s.words))


# --- the command ----------------------------------------------------------------------------


@pytest.mark.self_check
def test_transcribe_command_writes_subtitles_parsers_read(tmp_path, long_clip):
    """``qkv transcribe`` on a real 40 s recording: SRT and WebVTT that pysrt and webvtt-py
    read back with the transcript's cues, JSON with timed words, and the alignment figure."""
    import pysrt
    import webvtt
    from typer.testing import CliRunner

    from qkv.cli.app import app

    sf = pytest.importorskip("soundfile")
    wav = tmp_path / "talk.wav"
    sf.write(str(wav), long_clip[: 16000 * 40], 16000)
    subs, png = tmp_path / "subs", tmp_path / "talk.png"
    result = CliRunner().invoke(app, ["transcribe", str(wav), "--format", "srt,vtt,json",
                                      "--out", str(subs), "--word-timestamps",
                                      "--align", str(png)])  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads((subs / "talk.json").read_text())
    segments = [s for s in data["segments"] if s["text"].strip()]
    assert len(segments) >= 2 and all(s["words"] for s in segments), data
    cues = pysrt.open(str(subs / "talk.srt"))
    assert [c.text for c in cues] == [s["text"].strip() for s in segments]
    assert [c.start.ordinal for c in cues] == [round(s["start"] * 1000) for s in segments]
    vtt = list(webvtt.read(str(subs / "talk.vtt")))
    assert [c.text for c in vtt] == [c.text for c in cues]
    assert png.stat().st_size > 10_000


def test_a_bad_file_stops_the_command_with_nothing_half_written(tmp_path):
    """Two files, the second not audio: the first file's subtitles are complete, the second
    has none, no temporary file is left, and the error is one line naming the file."""
    from typer.testing import CliRunner

    from qkv.cli.app import app

    good = espeak(SENTENCES[0], tmp_path, "good")
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really audio")
    subs = tmp_path / "subs"
    result = CliRunner().invoke(app, ["transcribe", str(good), str(bad), "--format", "srt",
                                      "--out", str(subs)])  # fmt: skip
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if "bad.wav" in line]
    assert lines and "cannot decode audio" in lines[-1], result.stderr
    assert sorted(p.name for p in subs.iterdir()) == ["good.srt"]
    assert "fox" in (subs / "good.srt").read_text().lower()
