"""The options of a long-form transcription, in one checked record.

The defaults are openai-whisper's ``transcribe``: timestamps on, the previous text as the
prompt, temperature fallback 0.0 .. 1.0 on a compression ratio above 2.4 or a mean
log-probability below -1, windows with ``<|nocaptions|>`` above 0.6 (and a low mean
log-probability) skipped as silence, five samples per fallback temperature. transformers'
``generate`` defaults differ (no fallback, no previous text, no silence test):
``TranscribeOptions.transformers()`` gives those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from qkv.checks import is_int

__all__ = ["TranscribeOptions"]


def _number(name: str, value: object, low: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")


@dataclass(frozen=True)
class TranscribeOptions:
    """How a recording is transcribed (see the module docstring for the defaults' origin).

    Attributes:
        timestamps: decode timestamp tokens and cut segments at them; False: one segment per
            30 s window (``<|notimestamps|>``).
        word_timestamps: time every word from the cross-attention (dynamic time warping over
            the alignment heads).
        trim_word_silence: narrow each timed word to the loud frames inside it (the
            alignment gives a pause to the word before it); qkv's addition, off in upstream.
        condition_on_previous_text: the window's prompt holds the text decoded so far (the
            last 223 tokens); reset after a window decoded above temperature 0.5.
        temperatures: tried in order until a window passes the thresholds below.
        compression_ratio_threshold: above it, a window is a repetition loop (None: no test).
        logprob_threshold: below it (mean log-probability), a window failed (None: no test).
        no_speech_threshold: above it (``<|nocaptions|>`` probability), together with a mean
            log-probability under ``logprob_threshold``, a window is skipped as silence.
        beam_size: beams at temperature 0 (None: greedy), as openai-whisper's beam search.
        best_of: samples per window at a temperature above 0 (the likeliest is kept).
        max_initial_timestamp: the latest first timestamp of a window, in seconds.
        max_new_tokens: the most tokens decoded per window.
        batch_size: recordings whose windows are encoded and decoded together.
        seed: seeds the sampling at temperatures above 0.
    """

    timestamps: bool = True
    word_timestamps: bool = False
    trim_word_silence: bool = True
    condition_on_previous_text: bool = True
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    beam_size: int | None = None
    best_of: int = 5
    max_initial_timestamp: float | None = 1.0
    max_new_tokens: int = 224
    batch_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("timestamps", "word_timestamps", "trim_word_silence",
                     "condition_on_previous_text"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        temps = self.temperatures
        if not isinstance(temps, tuple) or not temps:
            raise ValueError(f"temperatures must be a non-empty tuple of numbers >= 0, got "
                             f"{temps!r}")  # fmt: skip
        for t in temps:
            _number("temperatures[...]", t, 0.0)
        for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold",
                     "max_initial_timestamp"):  # fmt: skip
            if getattr(self, name) is not None:
                _number(name, getattr(self, name))
        if self.max_initial_timestamp is not None and self.max_initial_timestamp < 0:
            raise ValueError(f"max_initial_timestamp must be >= 0 seconds, got "
                             f"{self.max_initial_timestamp}")  # fmt: skip
        for name in ("best_of", "max_new_tokens", "batch_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.beam_size is not None and (not is_int(self.beam_size) or self.beam_size < 1):
            raise ValueError(f"beam_size must be None (greedy) or an int >= 1, got "
                             f"{self.beam_size!r}")  # fmt: skip
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @classmethod
    def transformers(cls, **changes: object) -> TranscribeOptions:
        """transformers' ``generate(return_timestamps=True)`` defaults: greedy only, no
        previous text, no silence test; ``changes`` override fields."""
        base = cls(condition_on_previous_text=False, temperatures=(0.0,),
                   compression_ratio_threshold=None, logprob_threshold=None,
                   no_speech_threshold=None)  # fmt: skip
        return replace(base, **changes)  # type: ignore[arg-type]
