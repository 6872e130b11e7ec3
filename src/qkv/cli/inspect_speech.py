"""``qkv inspect`` on a speech model (Whisper): the audio's transcription, drawn against time.

The text argument is an audio file. The first 30 s window is transcribed greedily, then the
prompt and the tokens are fed back under capture (teacher forcing) and the viewer shows the
decoder's cross-attention with the audio frames as a time axis (0.02 s per encoder frame), next
to the alignment PNG of :mod:`qkv.inspect.alignment`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["inspect_speech"]


def inspect_speech(bundle: Any, audio: Path, out: Path, *, title: str) -> dict[str, Path]:
    """Write ``out/alignment.png`` and ``out/viewer.html`` for ``audio`` with a speech bundle.

    Returns:
        ``{"alignment (tokens × seconds)": png, "viewer": html}``.

    Raises:
        FileNotFoundError: ``audio`` does not exist; ValueError: it cannot be decoded (the
            message names it).
    """
    from qkv.inspect.alignment import cross_attention_alignment, plot_time_alignment
    from qkv.inspect.viewer import view
    from qkv.pretrained import audio as audio_mod

    if not audio.is_file():
        what = "is a folder" if audio.is_dir() else "does not exist"
        raise FileNotFoundError(f"TEXT {audio} {what}: a speech model takes an audio file")
    samples = next(audio_mod.audio_windows(audio))  # the first 30 s, read alone
    features = bundle.features(samples)  # (1, n_mels, 3000)
    tokens = [*bundle.prompt, *bundle.tokens(features)[0]]
    labels = [bundle.tokenizer.decode([t]) for t in tokens]
    seconds = min(samples.shape[0] / audio_mod.SAMPLE_RATE, audio_mod.WINDOW_SECONDS)
    heads = bundle.alignment_heads or None
    matrix = cross_attention_alignment(bundle.model, features, tokens, heads)  # (T, S)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_time_alignment(
        matrix, out / "alignment.png", tokens=labels, duration=seconds,
        seconds_per_frame=audio_mod.FRAME_SECONDS,
        title=f"{audio.name}: cross-attention, {len(heads or [])} alignment heads averaged",
    )
    target = torch.tensor([tokens])  # (1, T)
    page = view(bundle.model, None, out / "viewer.html", input_ids=features, target=target,
                target_tokens=labels, key_axis="time", frame_seconds=audio_mod.FRAME_SECONDS,
                title=title)  # fmt: skip
    return {"alignment (tokens × seconds)": png, "viewer": Path(page.path)}
