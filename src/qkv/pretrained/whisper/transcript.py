"""What a transcription returns: segments with times, and words with times.

A :class:`Transcript` is a file's (or an array's) :class:`Segment` s in time order; each
segment holds its text, its tokens and the decoder's confidence, and, when word timestamps
were asked for, its :class:`Word` s. Times are seconds from the start of the audio.
:mod:`qkv.pretrained.whisper.subtitles` writes them as text, SRT, WebVTT or JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Segment", "Transcript", "Word"]


@dataclass(frozen=True)
class Word:
    """One word: its text (with its leading space, as the tokenizer spells it), start and end
    in seconds, and the mean probability of its tokens."""

    text: str
    start: float
    end: float
    probability: float


@dataclass(frozen=True)
class Segment:
    """A stretch of speech the model closed with a timestamp pair.

    Attributes:
        start, end: seconds from the start of the audio (``start <= end``).
        text: the words, stripped of special and timestamp tokens (leading space kept).
        tokens: the token ids decoded for it (timestamp tokens included).
        avg_logprob: the mean log-probability of the window's decoded tokens.
        no_speech_prob: the probability of ``<|nocaptions|>`` at the window's first step.
        compression_ratio: the window's text, its bytes over its zlib-compressed bytes.
        temperature: the sampling temperature that produced the window (0: greedy).
        words: the words with times (empty unless word timestamps were asked for).
    """

    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    compression_ratio: float = 0.0
    temperature: float = 0.0
    words: tuple[Word, ...] = ()


@dataclass(frozen=True)
class Transcript:
    """Everything said in one audio input.

    Attributes:
        segments: in time order.
        duration: the audio's length in seconds.
        source: the file it came from ('' for an array).
        language: the language transcribed ("en" for English-only models).
    """

    segments: tuple[Segment, ...]
    duration: float
    source: str = ""
    language: str = "en"

    @property
    def text(self) -> str:
        """The segments' texts joined (each keeps its leading space), stripped."""
        return "".join(s.text for s in self.segments).strip()

    @property
    def words(self) -> tuple[Word, ...]:
        """Every segment's words in order (empty without word timestamps)."""
        return tuple(w for s in self.segments for w in s.words)

    def to_dict(self) -> dict:
        """Plain data for JSON: ``{"source", "language", "duration", "text", "segments"}``."""
        return {"source": self.source, "language": self.language, "duration": self.duration,
                "text": self.text, "segments": [asdict(s) for s in self.segments]}  # fmt: skip
