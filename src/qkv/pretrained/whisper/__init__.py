"""Whisper: speech to text on qkv's encoder-decoder, from CTranslate2 folders.

Module map:

* :mod:`~qkv.pretrained.whisper.model`: :class:`SpeechBundle` and the loaders (a CTranslate2
  folder read by :mod:`~qkv.pretrained.whisper.ct2_reader`, never executing code);
* audio in: :mod:`~qkv.pretrained.whisper.audio` (files or arrays to 16 kHz mono log-mel
  windows), :mod:`~qkv.pretrained.whisper.mel_frames` (a whole recording's features, block by
  block);
* decoding: :mod:`~qkv.pretrained.whisper.decode` (one 30 s window: timestamp rules, the
  temperature fallback, beams), :mod:`~qkv.pretrained.whisper.longform` (the seek loop over a
  recording, batches), :mod:`~qkv.pretrained.whisper.word_times` (word times by DTW over the
  alignment heads), :mod:`~qkv.pretrained.whisper.options` (a transcription's options, checked);
* out: :mod:`~qkv.pretrained.whisper.transcript` (segments and words with times),
  :mod:`~qkv.pretrained.whisper.subtitles` (plain text, SRT, WebVTT, JSON).

Shapes: ``M`` mel bins (80), ``F`` feature frames (3000 per 30 s window), ``T`` tokens.
"""

from qkv.pretrained.whisper.model import (
    SpeechBundle,
    load_whisper_bundle,
    load_whisper_ct2,
    whisper_entries,
)

__all__ = ["SpeechBundle", "load_whisper_bundle", "load_whisper_ct2", "whisper_entries"]
