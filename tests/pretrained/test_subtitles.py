"""Transcripts written as text, SRT, WebVTT and JSON (:mod:`qkv.pretrained.whisper.subtitles`), read
back by independent parsers: ``pysrt`` for SubRip, ``webvtt-py`` for WebVTT, ``json``."""

from __future__ import annotations

import html
import io
import json

import pysrt
import pytest
import webvtt

from qkv.pretrained.whisper.subtitles import FORMATS, render, to_json, to_srt, to_text, to_vtt
from qkv.pretrained.whisper.transcript import Segment, Transcript, Word

WORDS = (Word(" Hello", 0.0, 0.4, 0.9), Word(" world.", 0.4, 1.9996, 0.8))
TRANSCRIPT = Transcript(
    segments=(
        Segment(0.0, 1.9996, " Hello world.", tokens=(1, 2), avg_logprob=-0.2, words=WORDS),
        Segment(1.9996, 2.0004, " Ça va? 日本語 ✓"),
        Segment(2.5, 2.5, "   "),  # empty text: no line, no cue
        Segment(3.0005, 4.25, " a --> b <b>bold</b> & c"),
        Segment(3725.4567, 3726.0, " An hour, two minutes in."),
        Segment(3727.0, 3726.5, " Ends before it starts."),  # the cue ends at its start
    ),
    duration=3730.0, source="talk.wav",
)
# (start ms, end ms, text as read back) of each cue
CUES = [
    (0, 2000, "Hello world."),
    (2000, 2000, "Ça va? 日本語 ✓"),
    (3000, 4250, "a -> b <b>bold</b> & c"),  # 3000.4999... ms rounds down
    (3725457, 3726000, "An hour, two minutes in."),
    (3727000, 3727000, "Ends before it starts."),
]


def _ms(clock: str) -> int:
    """``HH:MM:SS.mmm`` (WebVTT's clock) in milliseconds."""
    hours, minutes, seconds = clock.split(":")
    return round((int(hours) * 3600 + int(minutes) * 60 + float(seconds)) * 1000)


def test_srt_reads_back_with_pysrt():
    text = to_srt(TRANSCRIPT)
    assert text.startswith("1\n00:00:00,000 --> 00:00:02,000\nHello world.\n\n2\n")
    assert "01:02:05,457 --> 01:02:06,000" in text
    subs = pysrt.from_string(text)
    assert [s.index for s in subs] == list(range(1, len(CUES) + 1))
    got = [(s.start.ordinal, s.end.ordinal, s.text) for s in subs]
    assert got == CUES


def test_vtt_reads_back_with_webvtt():
    text = to_vtt(TRANSCRIPT)
    assert text.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:02.000\nHello world.\n")
    assert "a -&gt; b &lt;b&gt;bold&lt;/b&gt; &amp; c" in text  # no markup, no cue break
    captions = webvtt.from_buffer(io.StringIO(text))
    got = [(_ms(c.start), _ms(c.end), html.unescape(c.text)) for c in captions]
    assert got == CUES


def test_cue_text_cannot_break_the_file():
    tricky = Transcript((Segment(1.0, 2.0, " one\n\n2\n00:00:09,000 --> 00:00:10,000\nx"),),
                        duration=3.0)  # fmt: skip
    subs = pysrt.from_string(to_srt(tricky))
    assert len(subs) == 1 and subs[0].text == "one\n2\n00:00:09,000 -> 00:00:10,000\nx"
    assert len(webvtt.from_buffer(io.StringIO(to_vtt(tricky)))) == 1


def test_json_round_trips():
    text = to_json(TRANSCRIPT)
    assert "日本語" in text and "\n  " in text  # unicode as is, indented
    back = json.loads(text)
    assert back == json.loads(json.dumps(TRANSCRIPT.to_dict()))  # tuples come back as lists
    assert back["segments"][0]["words"][1] == {"text": " world.", "start": 0.4, "end": 1.9996,
                                               "probability": 0.8}  # fmt: skip
    assert back["source"] == "talk.wav" and back["duration"] == 3730.0


def test_text_is_one_line_per_segment():
    assert to_text(TRANSCRIPT).splitlines() == [c[2].replace("->", "-->") for c in CUES]
    assert to_text(TRANSCRIPT).endswith("\n")


def test_empty_transcript():
    empty = Transcript((), duration=0.0)
    assert to_text(empty) == to_srt(empty) == ""
    assert to_vtt(empty) == "WEBVTT\n"
    assert len(webvtt.from_buffer(io.StringIO(to_vtt(empty)))) == 0
    assert json.loads(to_json(empty))["segments"] == []


@pytest.mark.parametrize("seconds, clock", [(0.0004, "00:00:00,000"), (0.0006, "00:00:00,001"),
                                            (1.9996, "00:00:02,000"), (59.9996, "00:01:00,000"),
                                            (3599.9996, "01:00:00,000"), (-0.5, "00:00:00,000"),
                                            (360000.0, "100:00:00,000")])  # fmt: skip
def test_times_round_to_the_millisecond(seconds, clock):
    srt = to_srt(Transcript((Segment(seconds, seconds, " x"),), duration=seconds))
    assert srt.splitlines()[1] == f"{clock} --> {clock}"


def test_render_dispatches_and_names_bad_formats():
    writers = {"txt": to_text, "srt": to_srt, "vtt": to_vtt, "json": to_json}
    assert set(FORMATS) == set(writers)
    for fmt, writer in writers.items():
        assert render(TRANSCRIPT, fmt) == writer(TRANSCRIPT)
    with pytest.raises(ValueError, match=r"'ass'.*txt, srt, vtt, json"):
        render(TRANSCRIPT, "ass")
