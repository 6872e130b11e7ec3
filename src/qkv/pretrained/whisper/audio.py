"""Audio in: files or arrays -> 16 kHz mono -> 80-bin log-mel spectrograms of 30 s windows.

Reading goes through ``soundfile`` (libsndfile: WAV, FLAC, OGG/Vorbis, ...) at whatever rate
the file has; channels are averaged and the signal is resampled to 16 kHz with ``soxr`` (the
SoX resampler, high quality). The features are Whisper's (Radford et al., 2022), computed as
transformers' ``WhisperFeatureExtractor`` computes them:

    1. pad with zeros (or cut) to 30 s = 480 000 samples
    2. STFT: 400-sample periodic Hann window (25 ms), hop 160 (10 ms), centred with reflection
       padding -> 3001 frames, the last dropped -> 3000 frames of 201 bins, power |X|²
    3. an 80-filter mel bank (Slaney's mel scale and area normalisation, 0-8 kHz)
    4. log10(max(mel, 1e-10)), floored at (window's maximum - 8), then (x + 4) / 4

Audio longer than 30 s is split into consecutive 30 s windows (:func:`split_windows`), each
padded and normalised on its own, as Whisper does when it decodes without timestamps.

Shapes: ``N`` samples, ``B`` windows, ``F`` spectrogram frames (3000), ``n_mels`` bins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from qkv.data.files import BadFileError, MissingFileError
from qkv.pretrained.errors import require

__all__ = [
    "FRAME_SECONDS",
    "HOP_LENGTH",
    "N_FFT",
    "SAMPLE_RATE",
    "WINDOW_SAMPLES",
    "audio_windows",
    "load_audio",
    "log_mel",
    "mel_filters",
    "split_windows",
    "waveform",
]

SAMPLE_RATE = 16000  # Hz, what the model was trained on
N_FFT = 400  # 25 ms analysis window
HOP_LENGTH = 160  # 10 ms between spectrogram frames
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE  # 480 000 samples per window
WINDOW_FRAMES = WINDOW_SAMPLES // HOP_LENGTH  # 3000 spectrogram frames per window
FRAME_SECONDS = 2 * HOP_LENGTH / SAMPLE_RATE  # 0.02 s per encoder frame (stride-2 conv)


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[log_region] - 15.0))
    return freq


def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> Tensor:
    """Triangular mel filters ``(n_mels, n_fft // 2 + 1)`` over 0 .. sample_rate/2, Slaney
    scale, each scaled by ``2 / bandwidth`` (equal area; librosa's ``norm="slaney"``).

    Raises:
        ValueError: ``n_mels`` not a positive int.
    """
    if isinstance(n_mels, bool) or not isinstance(n_mels, int) or n_mels < 1:
        raise ValueError(f"n_mels must be a positive int, got {n_mels!r}")
    fft_freqs = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)  # (K,)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array([0.0]))[0],
                                   _hz_to_mel(np.array([sample_rate / 2]))[0], n_mels + 2))
    widths = np.diff(edges)  # (n_mels + 1,)
    slopes = edges[None, :] - fft_freqs[:, None]  # (K, n_mels + 2)
    down = -slopes[:, :-2] / widths[:-1]  # (K, n_mels) rising edge
    up = slopes[:, 2:] / widths[1:]  # (K, n_mels) falling edge
    bank = np.maximum(0.0, np.minimum(down, up))  # (K, n_mels)
    bank *= 2.0 / (edges[2 : n_mels + 2] - edges[:n_mels])[None, :]
    return torch.from_numpy(bank.T.astype(np.float32))  # (n_mels, K)


def load_audio(path: str | os.PathLike) -> np.ndarray:
    """Read an audio file as 16 kHz mono float32 samples ``(N,)`` (all of it: for long files
    iterate :func:`audio_windows` instead).

    Raises:
        MissingFileError: no file at ``path``.
        BadFileError: a file libsndfile cannot decode, an empty one, a sample rate outside
            1 kHz .. 384 kHz, non-finite samples or samples far outside [-1, 1].
        ImportError: ``soundfile`` or ``soxr`` missing (the message says how to install).
    """
    return np.concatenate(list(_file_windows(Path(path))))


def audio_windows(audio: object) -> Iterator[np.ndarray]:
    """``audio``'s consecutive 30 s windows of 16 kHz mono float32 samples ``(<= 480000,)``
    (the last one shorter; one window at least). A file is read, checked and resampled block
    by block, so memory stays that of a window or two whatever its length (8 hours of FLAC
    included); the samples equal :func:`load_audio`'s.

    Raises:
        as :func:`waveform`, for a file as soon as the bad block is read.
    """
    if isinstance(audio, (str, os.PathLike)):
        yield from _file_windows(Path(audio))
    else:
        yield from split_windows(waveform(audio))


def _file_windows(path: Path) -> Iterator[np.ndarray]:
    if not path.is_file():
        raise MissingFileError(f"no audio file at {path}", path=path)
    sf = require("soundfile", "soundfile")
    try:
        f = sf.SoundFile(str(path))
    except Exception as err:  # libsndfile's errors have no documented type
        raise BadFileError(f"{path}: cannot decode audio ({err}); expected WAV, FLAC or OGG",
                           path=path) from None  # fmt: skip
    with f:
        rate = int(f.samplerate)
        _check_rate(rate, str(path))
        resampler = None
        if rate != SAMPLE_RATE:
            resampler = require("soxr", "soxr").ResampleStream(rate, SAMPLE_RATE, 1,
                                                               dtype="float32")
        pending, read, windows = np.zeros(0, dtype=np.float32), 0, 0
        while True:
            try:
                block = f.read(rate * WINDOW_SECONDS, dtype="float32", always_2d=True)
            except Exception as err:
                raise BadFileError(f"{path}: cannot decode audio after sample {read} ({err})",
                                   path=path) from None  # fmt: skip
            last = block.shape[0] == 0
            mono = _checked(block.mean(axis=1), read, str(path))
            read += mono.shape[0]
            if resampler is not None:
                mono = resampler.resample_chunk(mono, last=last)
            pending = np.concatenate([pending, mono.astype(np.float32, copy=False)])
            while pending.shape[0] >= WINDOW_SAMPLES:
                yield pending[:WINDOW_SAMPLES]
                pending, windows = pending[WINDOW_SAMPLES:], windows + 1
            if last:
                break
    if read == 0:
        raise BadFileError(f"{path}: the audio has no samples", path=path)
    if pending.shape[0] or windows == 0:
        yield pending


# Sample rates a file may declare (telephone 8 kHz is far above the low end; 384 kHz is the
# highest rate audio interfaces record), and the largest |sample| of float audio, whose range
# is [-1, 1] (a little over it is clipping; 1e30 is not audio and overflows the features).
RATES = (1_000, 384_000)
MAX_AMPLITUDE = 1e3


def _check_rate(rate: int, what: str) -> None:
    if not RATES[0] <= rate <= RATES[1]:
        raise BadFileError(f"{what}: a sample rate of {rate} Hz; expected {RATES[0]:,} to "
                           f"{RATES[1]:,} Hz (resampling {rate} Hz to {SAMPLE_RATE} would "
                           "invent the audio)", path=what)


def _checked(samples: np.ndarray, offset: int, what: str) -> np.ndarray:
    """``samples`` (starting at sample ``offset`` of the file), refused when not finite or
    far outside [-1, 1], naming the first bad sample."""
    if not np.isfinite(samples).all():
        bad = offset + int(np.argmin(np.isfinite(samples)))
        raise BadFileError(f"{what}: audio holds NaN or infinite samples (sample {bad})",
                           path=what)
    if samples.size:
        peak = int(np.argmax(np.abs(samples)))
        if abs(float(samples[peak])) > MAX_AMPLITUDE:
            raise BadFileError(f"{what}: sample {offset + peak} is {float(samples[peak]):.3g}; "
                               f"audio samples lie in [-1, 1] (at most {MAX_AMPLITUDE:g} "
                               "accepted)", path=what)
    return samples


def waveform(audio: object) -> np.ndarray:
    """``audio`` as 16 kHz mono float32 samples ``(N,)``: a path (see :func:`load_audio`) or a
    1-D float array / tensor already at 16 kHz.

    Raises:
        TypeError: neither a path nor a float array.
        ValueError: an array that is not 1-D, is empty, or is not finite.
        BadFileError, MissingFileError: as :func:`load_audio`.
    """
    if isinstance(audio, (str, os.PathLike)):
        return load_audio(audio)
    if isinstance(audio, Tensor):
        audio = audio.detach().cpu().numpy()
    if not isinstance(audio, np.ndarray) or not np.issubdtype(audio.dtype, np.floating):
        raise TypeError(
            "audio must be a file path or a 1-D float array of 16 kHz samples, got "
            + (f"an array of dtype {audio.dtype}" if isinstance(audio, np.ndarray)
               else type(audio).__name__)
        )
    if audio.ndim != 1 or audio.size == 0:
        raise ValueError(f"audio must be a non-empty 1-D array of 16 kHz samples (N,), got "
                         f"shape {audio.shape}")  # fmt: skip
    if not np.isfinite(audio).all():
        raise ValueError("audio holds NaN or infinite samples")
    return np.ascontiguousarray(audio, dtype=np.float32)


def split_windows(samples: np.ndarray) -> list[np.ndarray]:
    """Consecutive windows of at most 30 s (the last one shorter)."""
    count = max(1, math.ceil(samples.shape[0] / WINDOW_SAMPLES))
    return [samples[i * WINDOW_SAMPLES : (i + 1) * WINDOW_SAMPLES] for i in range(count)]


def log_mel(windows: np.ndarray | list[np.ndarray] | Tensor, n_mels: int = 80) -> Tensor:
    """Whisper's log-mel features of one or more windows of 16 kHz audio.

    Args:
        windows: one window ``(N,)`` or several (a list, or ``(B, N)``), each at most 30 s;
            each is padded with zeros to 30 s.
        n_mels: mel bins.

    Returns:
        ``(B, n_mels, 3000)`` float32 (``B = 1`` for one window).

    Raises:
        ValueError: a window longer than 30 s, or not 1-D.
    """
    rows = [windows] if isinstance(windows, (np.ndarray, Tensor)) and windows.ndim == 1 \
        else list(windows)
    batch = torch.zeros(len(rows), WINDOW_SAMPLES)  # (B, 480000) zero padding
    for b, row in enumerate(rows):
        row = torch.as_tensor(np.asarray(row, dtype=np.float32))
        if row.dim() != 1 or row.shape[0] > WINDOW_SAMPLES:
            raise ValueError(f"windows[{b}] must be 1-D with at most {WINDOW_SAMPLES} samples "
                             f"(30 s at 16 kHz), got shape {tuple(row.shape)}")  # fmt: skip
        batch[b, : row.shape[0]] = row
    hann = torch.hann_window(N_FFT)  # periodic, as the extractor's
    stft = torch.stft(batch, N_FFT, HOP_LENGTH, window=hann, return_complex=True)  # (B, K, F+1)
    power = stft[..., :-1].abs() ** 2  # (B, K, F)
    mel = mel_filters(n_mels) @ power  # (B, n_mels, F)
    logs = mel.clamp(min=1e-10).log10()  # (B, n_mels, F)
    floor = logs.amax(dim=(1, 2), keepdim=True) - 8.0  # (B, 1, 1) per window
    return (torch.maximum(logs, floor) + 4.0) / 4.0  # (B, n_mels, F)
