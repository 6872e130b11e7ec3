"""``qkv inspect`` on a speech model (Whisper): the audio's transcription, drawn against time.

The text argument is an audio file. The first 30 s window is transcribed greedily, then the
prompt and the tokens are fed back under capture (teacher forcing) and the viewer shows the
decoder's cross-attention with the audio frames as a time axis (0.02 s per encoder frame), next
to the alignment PNG of :mod:`qkv.inspect.alignment`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

__all__ = ["inspect_speech"]


def inspect_speech(bundle: Any, audio: Path, out: Path, *, title: str,
                   stages: Any = None) -> tuple[dict[str, Path], str]:  # fmt: skip
    """Write ``out/alignment.png`` and ``out/viewer.html`` for ``audio`` (its first 30 s
    window) with a speech bundle; ``stages`` (a :class:`~qkv.cli.progress.Stages`) shows
    the work.

    Returns:
        ``({"alignment (tokens × seconds)": png, "viewer": html}, the window's transcript)``.

    Raises:
        FileNotFoundError: ``audio`` does not exist; ValueError: it cannot be decoded (the
            message names it).
    """
    from qkv.inspect.alignment import cross_attention_alignment, plot_time_alignment
    from qkv.inspect.viewer import view
    from qkv.pretrained.whisper import audio as audio_mod

    if not audio.is_file():
        what = "is a folder" if audio.is_dir() else "does not exist"
        raise FileNotFoundError(f"TEXT {audio} {what}: a speech model takes an audio file")
    stage = stages.stage if stages is not None else (lambda text: contextlib.nullcontext())
    with stage("transcribing the first 30 s"):
        samples = next(audio_mod.audio_windows(audio))  # the first 30 s, read alone
        weight = next(bundle.model.parameters())  # features go to the model's device, dtype
        features = bundle.features(samples).to(weight)  # (1, n_mels, 3000)
        output = bundle.tokens(features)[0]
    tokens = [*bundle.prompt, *output]
    labels = [bundle.tokenizer.decode([t]) for t in tokens]
    seconds = min(samples.shape[0] / audio_mod.SAMPLE_RATE, audio_mod.WINDOW_SECONDS)
    heads = bundle.alignment_heads or None
    out.mkdir(parents=True, exist_ok=True)
    with stage("drawing the alignment"):
        matrix = cross_attention_alignment(bundle.model, features, tokens, heads)  # (T, S)
        png = plot_time_alignment(
            matrix, out / "alignment.png", tokens=labels, duration=seconds,
            seconds_per_frame=audio_mod.FRAME_SECONDS,
            title=f"{audio.name}: cross-attention, {len(heads or [])} alignment heads averaged",
        )
    with stage("writing the viewer"):
        target = torch.tensor([tokens], device=features.device)  # (1, T)
        page = view(bundle.model, None, out / "viewer.html", input_ids=features,
                    target=target, target_tokens=labels, key_axis="time",
                    frame_seconds=audio_mod.FRAME_SECONDS, time_bin=TIME_BIN,
                    title=title)  # fmt: skip
    return ({"alignment (tokens × seconds)": png, "viewer": Path(page.path)},
            bundle.text(output))


# Seconds per row of the viewer's time axis: a 30 s window is 60 rows on one screen.
TIME_BIN = 0.5
