"""A :class:`~qkv.pretrained.whisper.transcript.Transcript` written out: text, SRT, WebVTT, JSON.

Pure functions from a transcript to a string (the file's whole text, ending in a newline):

* :func:`to_text`: one line per segment, its text stripped.
* :func:`to_srt`: SubRip: cues numbered from 1, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, the text,
  a blank line between cues.
* :func:`to_vtt`: WebVTT: a ``WEBVTT`` header, then cues timed ``HH:MM:SS.mmm``.
* :func:`to_json`: :meth:`Transcript.to_dict` as indented JSON (words included when the
  transcript has them).
* :func:`render`: one of the above by name (:data:`FORMATS`).

One cue per segment (as openai-whisper writes by default), in the segments' order; a segment
whose text is empty (or only whitespace) gives no line and no cue. Times are rounded to the
nearest millisecond (1.9996 s is ``00:00:02,000``), negative times clamp to 0, and a cue never
ends before it starts. A cue's text cannot break its file: ``-->`` becomes ``->``, blank lines
are dropped, and WebVTT's ``&``, ``<``, ``>`` are written as ``&amp;``, ``&lt;``, ``&gt;``.
"""

from __future__ import annotations

import json

from qkv.pretrained.whisper.transcript import Segment, Transcript

__all__ = ["FORMATS", "render", "to_json", "to_srt", "to_text", "to_vtt"]

# The names render() knows, which are also the files' extensions.
FORMATS = ("txt", "srt", "vtt", "json")


def _milliseconds(seconds: float) -> int:
    """``seconds`` as whole milliseconds, rounded to the nearest (never below 0)."""
    return max(0, round(seconds * 1000))


def _clock(ms: int, decimal: str) -> str:
    """``ms`` milliseconds as ``HH:MM:SS<decimal>mmm`` (hours grow past two digits)."""
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    seconds, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{decimal}{ms:03d}"


def _timing(segment: Segment, decimal: str) -> str:
    """``start --> end`` of ``segment``, the end no earlier than the start."""
    start = _milliseconds(segment.start)
    end = max(start, _milliseconds(segment.end))
    return f"{_clock(start, decimal)} --> {_clock(end, decimal)}"


def _cue_text(text: str) -> str:
    """``text`` safe inside a cue: stripped, no blank line, no ``-->`` ('' when empty)."""
    lines = (line.strip() for line in text.replace("-->", "->").splitlines())
    return "\n".join(line for line in lines if line)


def _vtt_escape(text: str) -> str:
    """WebVTT cue text: ``&``, ``<``, ``>`` as character references (``&`` first)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cues(transcript: Transcript) -> list[tuple[Segment, str]]:
    """``(segment, cue text)`` for every segment whose text is not empty, in order."""
    pairs = ((s, _cue_text(s.text)) for s in transcript.segments)
    return [(s, text) for s, text in pairs if text]


def _lines(blocks: list[str]) -> str:
    """``blocks`` joined by newlines, ending in one ('' for none)."""
    return "".join(block + "\n" for block in blocks)


def to_text(transcript: Transcript) -> str:
    """Plain text: each non-empty segment's text, stripped, on a line of its own.

    Args:
        transcript: any :class:`~qkv.pretrained.whisper.transcript.Transcript`.

    Returns:
        ``"first segment\\nsecond segment\\n"`` ('' when nothing was said).
    """
    return _lines([s.text.strip() for s in transcript.segments if s.text.strip()])


def to_srt(transcript: Transcript) -> str:
    """SubRip subtitles: one numbered cue per non-empty segment.

    Returns:
        ``"1\\n00:00:00,000 --> 00:00:02,500\\nHello.\\n\\n2\\n..."`` ('' for no cue).
    """
    cues = [f"{n}\n{_timing(s, ',')}\n{text}\n"
            for n, (s, text) in enumerate(_cues(transcript), 1)]  # fmt: skip
    return "\n".join(cues)


def to_vtt(transcript: Transcript) -> str:
    """WebVTT subtitles: the ``WEBVTT`` header, then one cue per non-empty segment.

    Returns:
        ``"WEBVTT\\n\\n00:00:00.000 --> 00:00:02.500\\nHello.\\n\\n..."``.
    """
    cues = [f"{_timing(s, '.')}\n{_vtt_escape(text)}\n" for s, text in _cues(transcript)]
    return "\n".join(["WEBVTT\n", *cues])


def to_json(transcript: Transcript) -> str:
    """``transcript.to_dict()`` as JSON, indented by 2, text as is (not ``\\u`` escaped).

    Returns:
        ``{"source", "language", "duration", "text", "segments": [...]}`` and a newline;
        ``json.loads`` of it equals ``transcript.to_dict()`` (tuples read back as lists).
    """
    return json.dumps(transcript.to_dict(), ensure_ascii=False, indent=2) + "\n"


_WRITERS = {"txt": to_text, "srt": to_srt, "vtt": to_vtt, "json": to_json}


def render(transcript: Transcript, fmt: str) -> str:
    """``transcript`` written in the format named ``fmt`` (one of :data:`FORMATS`).

    Raises:
        ValueError: an unknown ``fmt``, naming it and the formats known.
    """
    writer = _WRITERS.get(fmt) if isinstance(fmt, str) else None
    if writer is None:
        raise ValueError(f"unknown subtitle format {fmt!r}; expected one of "
                         f"{', '.join(FORMATS)}")  # fmt: skip
    return writer(transcript)
