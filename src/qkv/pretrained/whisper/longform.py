"""Long-form transcription: a 30 s window slides over the recording, moved by what was said.

Each window is decoded with timestamps (:mod:`~qkv.pretrained.whisper.decode`); the tokens
are cut into segments at each pair of adjacent timestamps. When the window's output ends on a
lone timestamp, speech ended inside it and the next window starts after it; otherwise the
last segment may be cut mid-word, so it is dropped and the next window starts at the last
complete segment's end (Radford et al., 2022, section 4.5; openai-whisper's ``transcribe``,
transformers' long-form ``generate``). With ``condition_on_previous_text`` the text decoded
so far is the next window's prompt (after ``<|startofprev|>``).

Several recordings go through together (``batch_size``): their current windows are encoded
as one batch and decoded as one where their prompts have one length. Transcripts come out
in input order; each recording's features are read twice, block by block
(:class:`~qkv.pretrained.whisper.mel_frames.FeatureWindows`), so memory does not grow with length.

Shapes: ``B`` recordings in a batch, ``S`` encoder frames (1500), ``E`` width.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from qkv.pretrained.whisper import audio as audio_mod
from qkv.pretrained.whisper.decode import Vocab, WindowResult, decode_with_fallback
from qkv.pretrained.whisper.mel_frames import FeatureWindows
from qkv.pretrained.whisper.options import TranscribeOptions
from qkv.pretrained.whisper.transcript import Segment, Transcript
from qkv.pretrained.whisper.word_times import speech_frames, time_words

__all__ = ["Track", "split_segments", "stream_segments", "transcribe_all"]

TIME_STEP = 0.02  # seconds per timestamp token
FRAME_STEP = audio_mod.HOP_LENGTH / audio_mod.SAMPLE_RATE  # 0.01 s per feature frame
INPUT_STRIDE = 2  # feature frames per timestamp step


def _blocks(audio: object):
    """A function giving ``audio``'s 16 kHz samples block by block (read anew per call)."""
    if isinstance(audio, (str, os.PathLike)):
        return lambda: audio_mod.audio_windows(audio)
    samples = audio_mod.waveform(audio)
    return lambda: iter(audio_mod.split_windows(samples))


class Track:
    """One recording on its way through: where the window is, what was said."""

    def __init__(self, audio: object, n_mels: int) -> None:
        self.source = str(audio) if isinstance(audio, (str, os.PathLike)) else ""
        self.windows = FeatureWindows(_blocks(audio), n_mels)
        self.seek = 0  # feature frame where the current window starts
        self.tokens: list[int] = []  # every kept segment's tokens, for the prompt
        self.reset_since = 0  # the prompt uses self.tokens[reset_since:]
        self.segments: list[Segment] = []
        self.last_speech = 0.0  # where the speech before the window ended (word timing)

    @property
    def done(self) -> bool:
        return self.seek >= self.windows.frames

    def prompt(self, start: list[int], vocab: Vocab, o: TranscribeOptions, room: int) -> list[int]:
        """``start`` (the start-of-transcript tokens), after the previous text if any."""
        previous = self.tokens[self.reset_since :] if o.condition_on_previous_text else []
        if not previous:
            return list(start)
        return [vocab.sot_prev, *previous[-(room // 2 - 1) :], *start]

    def transcript(self) -> Transcript:
        duration = self.windows.samples / audio_mod.SAMPLE_RATE
        return Transcript(tuple(self.segments), duration, self.source)


def split_segments(tokens: Sequence[int], offset: float, frames: int, tb: int
                   ) -> tuple[list[tuple[float, float, list[int]]], int]:  # fmt: skip
    """Cut a window's ``tokens`` at adjacent timestamp pairs.

    Args:
        tokens: sampled tokens (EOT left out).
        offset: the window's start in seconds.
        frames: the window's feature frames holding audio (<= 3000).
        tb: the first timestamp token id.

    Returns:
        ``([(start, end, tokens)], frames to move the window by)``.
    """
    is_ts = [t >= tb for t in tokens]
    single_end = is_ts[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
    if not cuts:  # one segment: the window, or up to its last timestamp
        stamps = [t for t in tokens if t >= tb]
        end = frames * FRAME_STEP
        if stamps and stamps[-1] != tb:
            end = (stamps[-1] - tb) * TIME_STEP
        return [(offset, offset + end, list(tokens))], frames
    if single_end:
        cuts.append(len(tokens))
    out, last = [], 0
    for cut in cuts:
        part = list(tokens[last:cut])
        out.append((offset + (part[0] - tb) * TIME_STEP, offset + (part[-1] - tb) * TIME_STEP,
                    part))  # fmt: skip
        last = cut
    move = frames if single_end else (tokens[last - 1] - tb) * INPUT_STRIDE
    return out, move


def _advance(bundle, track: Track, r: WindowResult, memory: Tensor, features: Tensor,
             o: TranscribeOptions) -> None:  # fmt: skip
    """Turn a window's decode (``memory (S, E)``: its encoder output; ``features (n_mels,
    3000)``) into segments and move the track's window."""
    text_of, vocab = bundle.decode_text, bundle.vocab
    frames = min(audio_mod.WINDOW_FRAMES, track.windows.frames - track.seek)
    offset = track.seek * FRAME_STEP
    if o.no_speech_threshold is not None and r.no_speech_prob > o.no_speech_threshold and not (
        o.logprob_threshold is not None and r.avg_logprob > o.logprob_threshold
    ):  # silence: skip the window
        track.seek += frames
        return
    if o.timestamps:
        parts, move = split_segments(r.tokens, offset, frames, vocab.timestamp_begin)
    else:
        parts, move = [(offset, offset + frames * FRAME_STEP, list(r.tokens))], frames
    segments = []
    for start, end, tokens in parts:
        text = text_of(tokens)
        if start == end or not text.strip():  # instantaneous or empty: kept as nothing
            text, tokens = "", []
        segments.append(Segment(start, end, text, tuple(tokens), r.avg_logprob,
                                r.no_speech_prob, r.compression_ratio, r.temperature))  # fmt: skip
    if o.word_timestamps:
        speech = speech_frames(features, frames) if o.trim_word_silence else None
        segments, track.last_speech = time_words(bundle, segments, memory, offset, frames,
                                                 track.last_speech, speech)  # fmt: skip
    track.segments += [s for s in segments if s.text]
    track.tokens += [t for s in segments for t in s.tokens]
    if not o.condition_on_previous_text or r.temperature > 0.5:
        track.reset_since = len(track.tokens)
    track.seek += move


def _step(bundle, tracks: list[Track], o: TranscribeOptions, generator: torch.Generator
          ) -> None:  # fmt: skip
    """Encode the tracks' current windows as one batch, decode them, move each track on."""
    model = bundle.model
    start = list(bundle.prompt[:-1] if o.timestamps else bundle.prompt)
    feats = torch.stack([t.windows.window(t.seek) for t in tracks])  # (B, n_mels, F)
    with torch.no_grad():
        memory = model.encode(feats.to(model.conv1.weight))  # (B, S, E)
    prompts = [t.prompt(start, bundle.vocab, o, model.config.max_len) for t in tracks]
    results = decode_with_fallback(model, memory, prompts, bundle.vocab, o, bundle.decode_text,
                                   generator)  # fmt: skip
    for t, r, mem, f in zip(tracks, results, memory, feats, strict=True):
        _advance(bundle, t, r, mem, f, o)


def stream_segments(bundle, audio: object, o: TranscribeOptions) -> Iterator[Segment]:
    """One recording's segments, each yielded once its window is decoded."""
    track, generator = Track(audio, bundle.config.n_mels), torch.Generator().manual_seed(o.seed)
    while not track.done:
        shown = len(track.segments)
        _step(bundle, [track], o, generator)
        yield from track.segments[shown:]


def transcribe_all(bundle, audios: Sequence[object], o: TranscribeOptions
                   ) -> Iterator[Transcript]:  # fmt: skip
    """Transcripts of ``audios`` in input order, ``o.batch_size`` recordings at a time."""
    generator = torch.Generator().manual_seed(o.seed)
    pending, active = deque(enumerate(audios)), []
    ready: dict[int, Transcript] = {}
    next_out = 0
    while pending or active:
        while pending and len(active) < o.batch_size:
            i, audio = pending.popleft()
            active.append((i, Track(audio, bundle.config.n_mels)))
        running = [t for _, t in active if not t.done]
        if running:
            _step(bundle, running, o, generator)
        for i, t in [(i, t) for i, t in active if t.done]:
            ready[i] = t.transcript()
            active.remove((i, t))
        while next_out in ready:
            yield ready.pop(next_out)
            next_out += 1
