"""Where each output token looked in the audio: a speech model's cross-attention against time.

A speech encoder-decoder's cross-attention maps every decoder token to encoder frames, and
each encoder frame is a fixed stretch of audio (Whisper: 20 ms, a stride-2 convolution over
10 ms spectrogram frames), so the weights are an alignment of tokens against seconds. A few
heads follow the audio closely (Whisper's ``alignment_heads``); their average is the picture.

* :func:`cross_attention_alignment`: teacher-force the tokens, capture the cross-attention
  (:func:`qkv.inspect.capture`), average the chosen ``(layer, head)`` pairs -> ``(T, S)``.
* :func:`plot_time_alignment`: the ``(T, S)`` matrix as a heatmap, tokens down, audio time in
  seconds across (cut at the audio's end), written atomically as PNG.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.inspect.capture import capture
from qkv.inspect.plots import axis_note, display_labels, label_budget, new_figure, save

__all__ = ["cross_attention_alignment", "plot_time_alignment"]


@torch.no_grad()
def cross_attention_alignment(
    model: nn.Module, features: Tensor, tokens: Sequence[int],
    heads: Sequence[tuple[int, int]] | None = None,
) -> Tensor:  # fmt: skip
    """Cross-attention weights of ``tokens`` over the encoder frames, averaged over ``heads``.

    Args:
        model: an encoder-decoder ``model(features, tokens (1, T)) -> logits`` whose decoder
            blocks have qkv cross-attention modules (e.g.
            :class:`~qkv.models.speech.SpeechSeq2Seq`).
        features: ``(1, ...)`` the encoder's input (one example).
        tokens: the ``T`` decoder input ids (prompt then the output).
        heads: ``(layer, head)`` pairs of cross-attention to average (layer = decoder block
            index); None = every head of the second half of the layers.

    Returns:
        ``(T, S)``: row ``t`` is where the decoder looked while reading token ``t`` (and
        choosing token ``t + 1``); each row sums to 1.

    Raises:
        ValueError: a layer or head out of range, an empty ``tokens``.
    """
    if len(tokens) == 0:
        raise ValueError("tokens must hold at least one id")
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=features.device)  # (1, T)
    with capture(model, layers="*cross_attn") as cap:
        model(features, ids)
    layers = cap.layers  # decoder order
    weights = [cap.weights[name][0] for name in layers]  # each (H, T, S)
    num_heads = weights[0].shape[0]
    if heads is None:
        heads = [(lay, h) for lay in range(len(layers) // 2, len(layers)) for h in range(num_heads)]
    for lay, h in heads:
        if not (0 <= lay < len(layers) and 0 <= h < num_heads):
            raise ValueError(f"heads has ({lay}, {h}); the model has {len(layers)} "
                             f"cross-attention layers of {num_heads} heads")  # fmt: skip
    return torch.stack([weights[lay][h] for lay, h in heads]).mean(0).float()  # (T, S)


def plot_time_alignment(
    matrix: Tensor,
    path: str | os.PathLike,
    *,
    tokens: Sequence[str],
    seconds_per_frame: float,
    duration: float | None = None,
    title: str = "cross-attention alignment",
    words: Sequence[tuple[str, float, float]] = (),
    figsize: tuple[float, float] = (10.0, 6.0),
    dpi: int = 100,
) -> Path:
    """Draw tokens against audio time: ``matrix (T, S)`` with frame ``s`` at
    ``s · seconds_per_frame`` seconds.

    Args:
        matrix: ``(T, S)`` weights (rows: tokens; columns: encoder frames).
        path: the PNG to write (atomically).
        tokens: ``T`` row labels.
        seconds_per_frame: audio per encoder frame (0.02 for Whisper).
        duration: the audio's length in seconds; frames after it (padding) are cut off.
        title: the figure's title.
        words: ``(text, start, end)`` seconds of timed words (e.g. a transcript's
            :class:`~qkv.pretrained.whisper.transcript.Word` s), marked as bands with their text
            along the top axis.

    Returns:
        the path written.

    Raises:
        ValueError: ``matrix`` not 2-D, labels of another count, a non-positive frame time,
            a word that ends before it starts.
    """
    if not isinstance(matrix, Tensor) or matrix.dim() != 2:
        raise ValueError(f"matrix must be a (T, S) tensor, got {getattr(matrix, 'shape', matrix)}")
    T, S = matrix.shape
    if len(tokens) != T:
        raise ValueError(f"tokens has {len(tokens)} labels for {T} rows of matrix")
    if not seconds_per_frame > 0:
        raise ValueError(f"seconds_per_frame must be > 0, got {seconds_per_frame!r}")
    frames = S if duration is None else max(1, min(S, round(duration / seconds_per_frame)))
    shown = matrix[:, :frames].detach().cpu().float()  # (T, frames)
    fig = new_figure(figsize, dpi)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(shown.numpy(), aspect="auto", cmap="viridis", interpolation="nearest",
                      extent=(0.0, frames * seconds_per_frame, T - 0.5, -0.5))  # fmt: skip
    fig.subplots_adjust(left=0.2, right=0.86, bottom=0.09, top=0.94)
    texts = display_labels(tokens)
    step = max(1, -(-T // label_budget(ax, "y")))
    ax.set_yticks(list(range(0, T, step)))
    ax.set_yticklabels([texts[i] for i in range(0, T, step)], fontsize=7)
    ax.set_xlabel("audio time (s)")
    ax.set_ylabel("token" + axis_note(T, T, len(range(0, T, step))))
    ax.set_title(title, fontsize=9)
    bar = fig.colorbar(image, cax=fig.add_axes((0.88, 0.09, 0.025, 0.85)))
    bar.set_label("cross-attention weight", fontsize=8)
    if words:
        _mark_words(ax, words, frames * seconds_per_frame)
    return save(fig, path)


def _mark_words(ax, words: Sequence[tuple[str, float, float]], end: float) -> None:
    """Each word's span as a light band (every other one), its text on a top axis."""
    for i, (text, a, b) in enumerate(words):
        if not a <= b:
            raise ValueError(f"words[{i}] {text!r} ends at {b} before it starts at {a}")
        ax.axvline(a, color="white", linewidth=0.6, alpha=0.7)
        if i % 2 == 0:
            ax.axvspan(a, b, color="white", alpha=0.12, linewidth=0)
    top = ax.secondary_xaxis("top")
    shown = [(t.strip(), (a + b) / 2) for t, a, b in words if (a + b) / 2 <= end]
    step = max(1, -(-len(shown) // label_budget(ax, "x")))
    top.set_xticks([c for _, c in shown[::step]])
    top.set_xticklabels([t for t, _ in shown[::step]], fontsize=7, rotation=60, ha="left")
