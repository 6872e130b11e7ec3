"""Whisper's log-mel features of a whole recording, computed block by block.

Long-form transcription slides a 30 s window over the recording's features at any frame
offset (``seek``), so they are computed for the whole signal at once, as transformers'
``WhisperFeatureExtractor`` does for audio longer than 30 s: one centred STFT over every
sample (reflection-padded at both ends), ``N // 160`` frames, and the floor at the
*recording's* maximum log-mel minus 8. A window that runs past the last frame is padded with
zero features (transformers' convention).

Hours of audio do not fit in memory as features (8 hours: 0.9 GB), so a file is read twice,
block by block: a first pass finds the maximum, a second one hands out frames as the window
moves forward and forgets those behind it. Frames computed block by block equal the
whole-signal STFT's (each frame sees the same 400 samples).

Shapes: ``N`` samples, ``F`` frames, ``n_mels`` bins, ``W`` = 3000 frames per window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from qkv.pretrained.whisper.audio import (
    HOP_LENGTH,
    N_FFT,
    WINDOW_FRAMES,
    WINDOW_SAMPLES,
    mel_filters,
)

__all__ = ["FeatureWindows", "log10_mel_blocks"]

_PAD = N_FFT // 2  # centring: 200 samples reflected at each end


def _log10_mel(padded: np.ndarray, first: int, count: int, n_mels: int) -> Tensor:
    """Frames ``first .. first + count - 1`` of an already padded signal whose sample 0 is
    frame 0's first sample: ``(n_mels, count)`` log10 mel power (not yet floored)."""
    span = torch.from_numpy(np.ascontiguousarray(
        padded[first * HOP_LENGTH : (first + count - 1) * HOP_LENGTH + N_FFT]))  # fmt: skip
    stft = torch.stft(span, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), center=False,
                      return_complex=True)  # (K, count)  # fmt: skip
    mel = mel_filters(n_mels) @ stft.abs() ** 2  # (n_mels, count)
    return mel.clamp(min=1e-10).log10()


def log10_mel_blocks(blocks: Iterable[np.ndarray], n_mels: int = 80) -> Iterator[Tensor]:
    """The log10 mel frames of the signal made of ``blocks`` (consecutive 16 kHz samples), as
    consecutive ``(n_mels, f)`` tensors; ``N // 160`` frames in all, each equal to the
    whole-signal centred STFT's frame."""
    held = np.zeros(0, dtype=np.float32)  # padded samples from frame `done`'s first on
    total, done, started = 0, 0, False
    for block in blocks:
        total += block.shape[0]
        held = np.concatenate([held, np.asarray(block, dtype=np.float32)])
        if not started:
            if held.shape[0] <= _PAD:  # the front reflection needs 201 samples
                continue
            held, started = np.concatenate([held[1 : _PAD + 1][::-1], held]), True
        ready = (held.shape[0] - N_FFT) // HOP_LENGTH + 1  # frames whose samples are all here
        if ready > 0:
            yield _log10_mel(held, 0, ready, n_mels)
            held, done = held[ready * HOP_LENGTH :], done + ready
    last = total // HOP_LENGTH - done
    if last <= 0:
        return
    if not started:  # fewer than 201 samples: reflect what there is (torch's rule needs more)
        held = np.pad(held, (_PAD, 0), mode="reflect" if held.shape[0] > 1 else "constant")
    raw = held[-(_PAD + 1) : -1][::-1] if held.shape[0] > _PAD else np.zeros(_PAD, np.float32)
    yield _log10_mel(np.concatenate([held, raw]), 0, last, n_mels)


class FeatureWindows:
    """30 s windows of a recording's normalised features at increasing frame offsets.

    A recording of at most 30 s is padded with silence to 30 s before its features are
    computed (as transformers' extractor does for short audio), so its one window equals
    :func:`~qkv.pretrained.whisper.audio.log_mel`'s.

    Args:
        blocks: called with no arguments, gives the recording's samples block by block (it is
            called twice: once for the length and the maximum, once for the frames).
        n_mels: mel bins.

    Attributes:
        samples: ``N``, the recording's length in samples.
        frames: ``N // 160``, the feature frames holding audio (where transcription stops).
    """

    def __init__(self, blocks: Callable[[], Iterable[np.ndarray]], n_mels: int = 80) -> None:
        self.samples, self.n_mels = 0, n_mels

        def counted() -> Iterator[np.ndarray]:
            for block in blocks():
                self.samples += block.shape[0]
                yield block

        peak = max((float(c.max()) for c in log10_mel_blocks(counted(), n_mels)),
                   default=-10.0)  # fmt: skip
        self.frames = self.samples // HOP_LENGTH
        self._blocks = blocks
        if self.samples <= WINDOW_SAMPLES:  # padded to 30 s: the maximum over the padded
            peak = max(float(c.max()) for c in log10_mel_blocks(self._padded(), n_mels))
        self.floor = peak - 8.0
        self._chunks = log10_mel_blocks(self._padded(), n_mels)
        self._held = torch.zeros(n_mels, 0)  # frames from `_start` on
        self._start = 0

    def _padded(self) -> Iterator[np.ndarray]:
        yield from self._blocks()
        if self.samples < WINDOW_SAMPLES:
            yield np.zeros(WINDOW_SAMPLES - self.samples, dtype=np.float32)

    def window(self, seek: int) -> Tensor:
        """Frames ``seek .. seek + 2999`` normalised as Whisper's, ``(n_mels, 3000)``, zero
        past the end. ``seek`` never decreases between calls.

        Raises:
            ValueError: a ``seek`` before an earlier one.
        """
        if seek < self._start:
            raise ValueError(f"seek {seek} is before frame {self._start}, already dropped")
        want = seek + WINDOW_FRAMES
        while self._start + self._held.shape[1] < want:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._held = torch.cat([self._held, chunk], dim=1)
        self._held = self._held[:, seek - self._start :]  # forget what is behind
        self._start = seek
        out = torch.zeros(self.n_mels, WINDOW_FRAMES)
        part = self._held[:, :WINDOW_FRAMES]
        out[:, : part.shape[1]] = (torch.maximum(part, torch.tensor(self.floor)) + 4.0) / 4.0
        return out
