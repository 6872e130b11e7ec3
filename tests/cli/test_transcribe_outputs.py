"""``qkv transcribe``'s outputs: ``--format`` files under ``--out``, ``--json`` lines,
``--batch-size`` and ``--word-timestamps`` handed to the model, files in the order given.

The model is a fake :class:`~qkv.pretrained.whisper.model.SpeechBundle` (``qkv.pretrained.load`` is
replaced) whose ``transcripts`` and ``segments`` return fixed transcripts and record how they
were called; the audio files are empty (the command only checks that they are files).
"""

from __future__ import annotations

import json
from pathlib import Path

import pysrt
import pytest
from rich.console import Console
from typer.testing import CliRunner

import qkv.pretrained
from qkv.cli import transcribe_cmd
from qkv.cli.app import app
from qkv.pretrained.whisper.model import SpeechBundle
from qkv.pretrained.whisper.subtitles import to_text, to_vtt
from qkv.pretrained.whisper.transcript import Segment, Transcript, Word

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})


def transcript_of(audio, word_timestamps: bool = False) -> Transcript:
    """The fixed transcript of ``audio``: two segments that name its stem."""
    stem = Path(audio).stem
    words = (Word(" Second", 1.5, 2.0, 0.9), Word(" <line>.", 2.0, 3.25, 0.7))
    return Transcript(
        segments=(Segment(0.0, 1.5, f" Hello from {stem}."),
                  Segment(1.5, 3.25, " Second <line>.", words=words if word_timestamps else ())),
        duration=4.0, source=str(audio),
    )  # fmt: skip


class FakeSpeech(SpeechBundle):
    """A speech bundle without a model: fixed transcripts, and a record of its calls."""

    def __init__(self) -> None:  # no model, tokenizer or prompt
        self.calls: list[tuple[str, list[str], dict]] = []

    def transcripts(self, audios, **options):
        self.calls.append(("transcripts", [str(a) for a in audios], options))
        wt = options.get("word_timestamps", False)
        return (transcript_of(a, wt) for a in audios)

    def segments(self, audio, **options):
        self.calls.append(("segments", [str(audio)], options))
        return iter(transcript_of(audio, options.get("word_timestamps", False)).segments)


@pytest.fixture
def fake(monkeypatch) -> FakeSpeech:
    bundle = FakeSpeech()
    monkeypatch.setattr(qkv.pretrained, "load", lambda name, **options: bundle)
    return bundle


def audio(tmp_path: Path, *names: str) -> list[str]:
    """Empty files named ``names`` under ``tmp_path`` (folders created), as strings."""
    paths = [tmp_path / name for name in names]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    return [str(p) for p in paths]


def ok(args: list[str]):
    result = runner.invoke(app, ["transcribe", *args])
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
    return result


def fails(args: list[str], *words: str):
    """The command fails with one stderr line holding every word, and no traceback."""
    result = runner.invoke(app, ["transcribe", *args])
    assert result.exit_code == 2, f"exit {result.exit_code}: {result.output}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in result.output
    return result


def test_formats_write_four_files_per_input(tmp_path, fake):
    files = audio(tmp_path, "a.wav", "b.flac")
    out = tmp_path / "subs" / "deeper"  # created
    result = ok([*files, "--format", "srt,vtt,json,txt", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == [f"{s}.{x}" for s in "ab"
                                                     for x in ("json", "srt", "txt", "vtt")]
    for file in files:
        stem, expected = Path(file).stem, transcript_of(file)
        subs = pysrt.from_string((out / f"{stem}.srt").read_text(encoding="utf-8"))
        assert [(s.start.ordinal, s.end.ordinal, s.text) for s in subs] == [
            (0, 1500, f"Hello from {stem}."), (1500, 3250, "Second <line>.")]
        assert (out / f"{stem}.vtt").read_text(encoding="utf-8") == to_vtt(expected)
        assert (out / f"{stem}.txt").read_text(encoding="utf-8") == to_text(expected)
        back = json.loads((out / f"{stem}.json").read_text(encoding="utf-8"))
        assert back == json.loads(json.dumps(expected.to_dict()))
    written = [line for line in result.stderr.splitlines() if line.startswith("wrote ")]
    assert len(written) == 8 and written[0] == f"wrote {out / 'a.srt'}", result.stderr
    assert result.stdout.splitlines() == [f"{f}: {transcript_of(f).text}" for f in files]
    assert not list(out.glob(".*.tmp")), "a temporary file was left behind"


def test_all_formats_into_the_current_folder(tmp_path, fake, monkeypatch):
    monkeypatch.chdir(tmp_path)
    audio(tmp_path, "in/talk.wav")
    ok(["in/talk.wav", "-f", "all"])
    assert sorted(p.name for p in tmp_path.glob("talk.*")) == [
        "talk.json", "talk.srt", "talk.txt", "talk.vtt"]
    ok(["in/talk.wav", "--format", " VTT , all,srt", "--out", "."])  # names once each


@pytest.mark.parametrize("spec, words", [("ass", ["--format", "'ass'", "txt, srt, vtt, json"]),
                                         ("srt,docx", ["--format", "'docx'"]),
                                         (",", ["--format", "no format"])])  # fmt: skip
def test_bad_format_is_one_line(tmp_path, fake, spec, words):
    fails([*audio(tmp_path, "a.wav"), "--format", spec], *words)
    assert fake.calls == []


def test_one_stem_twice_is_refused_before_transcribing(tmp_path, fake):
    files = audio(tmp_path, "x/talk.wav", "y/talk.flac")
    fails([*files, "--format", "srt", "--out", str(tmp_path / "o")], "--format", *files)
    assert fake.calls == [] and not (tmp_path / "o").exists()
    ok([*files])  # without --format nothing is written, so one stem is fine


def test_bad_out_is_refused_before_transcribing(tmp_path, fake):
    files = audio(tmp_path, "a.wav")
    (tmp_path / "taken").write_text("a file")
    fails([*files, "-f", "srt", "--out", str(tmp_path / "taken")], "--out", "is a file")
    fails([*files, "-f", "srt", "-o", str(tmp_path / "taken" / "sub")], "--out",
          "cannot be created")  # fmt: skip
    fails([*files, "--out", str(tmp_path / "subs")], "--out", "--format")
    assert fake.calls == []


def test_options_reach_the_model(tmp_path, fake):
    files = audio(tmp_path, "a.wav", "b.wav", "c.wav")
    ok([*files, "--batch-size", "2", "--word-timestamps", "--beam-size", "3", "-n", "50"])
    assert fake.calls == [("transcripts", files, {"batch_size": 2, "word_timestamps": True,
                                                  "beam_size": 3, "max_new_tokens": 50})]
    fake.calls.clear()
    ok([files[0]])  # greedy: the default, not passed
    assert fake.calls == [("transcripts", files[:1], {"batch_size": 1, "word_timestamps": False,
                                                      "max_new_tokens": 224})]  # fmt: skip
    result = runner.invoke(app, ["transcribe", files[0], "--batch-size", "0"])
    assert result.exit_code == 2 and "--batch-size" in result.output


def test_json_lines_in_the_order_given(tmp_path, fake):
    files = audio(tmp_path, "c.wav", "a.wav", "b.wav")
    result = ok([*files, "--json", "--word-timestamps"])
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["file"] for r in records] == files
    for record, file in zip(records, files, strict=True):
        expected = json.loads(json.dumps(transcript_of(file, True).to_dict()))
        assert record == {"file": file, "text": expected["text"],
                          "segments": expected["segments"]}  # fmt: skip
    assert records[0]["segments"][1]["words"][1]["text"] == " <line>."
    plain = ok([files[0], "--json"])
    assert json.loads(plain.stdout)["segments"][1]["words"] == []


def test_text_in_the_order_given(tmp_path, fake):
    files = audio(tmp_path, "z.wav", "m.wav", "a.wav")
    result = ok(files)
    assert result.stdout.splitlines() == [f"{f}: Hello from {Path(f).stem}. Second <line>."
                                          for f in files]  # fmt: skip
    assert ok(files[:1]).stdout == "Hello from z. Second <line>.\n"


def test_a_terminal_shows_segments_as_they_come(tmp_path, fake, monkeypatch):
    def console(**kw):  # stdout is a terminal; stderr stays a pipe
        return Console(**kw, force_terminal=not kw.get("stderr", False))

    monkeypatch.setattr(transcribe_cmd, "Console", console)
    files = audio(tmp_path, "a.wav")
    result = ok([*files, "--word-timestamps"])
    assert result.stdout == "Hello from a. Second <line>.\n"
    assert [c[0] for c in fake.calls] == ["segments"]
    assert fake.calls[0][2] == {"word_timestamps": True, "max_new_tokens": 224}
    fake.calls.clear()
    ok([*files, "--format", "srt", "--out", str(tmp_path / "o")])  # files: whole transcripts
    assert [c[0] for c in fake.calls] == ["transcripts"]
