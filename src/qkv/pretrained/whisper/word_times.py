"""Word timestamps from cross-attention: where in the audio each word's tokens look.

A few of Whisper's cross-attention heads (its "alignment heads", listed with each checkpoint)
follow the audio monotonically as the text advances. To time a window's words (openai-whisper's
``word_timestamps``):

1. teacher-force ``<|startoftranscript|><|notimestamps|>`` + the window's text tokens + EOT
   and read those heads' attention logits ``(heads, T, S)`` (a hook on each layer's
   ``hook_inputs``, the queries and keys the layer attends with);
2. softmax over the frames that hold audio, standardise each frame across tokens, median
   filter (width 7) along time, average the heads -> a ``(tokens, frames)`` score;
3. the cheapest monotonic path through ``-score`` (dynamic time warping): where the path
   moves to a new token is when that token starts (20 ms per frame);
4. tokens grouped into words (a word starts at a space or a punctuation mark),
   punctuation merged into its neighbours, and words that last too long trimmed
   (at most twice the median word, 0.7 s at most, next to a sentence end or a pause);
5. (qkv's addition, ``TranscribeOptions.trim_word_silence``) the path gives every frame to
   some token, so a pause after a word counts as the word's: each word is narrowed to the
   frames in it that are louder than the window's quiet frames (:func:`speech_frames`),
   never widened. On espeak-ng words with pauses this moved ends from up to 0.6 s late to
   within 0.1 s (``tests/pretrained/test_word_times.py``).

Shapes: ``T`` tokens, ``S`` encoder frames (1500 per window), ``K`` heads.
"""

from __future__ import annotations

import itertools
import string
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from qkv.pretrained.whisper.transcript import Segment, Word

__all__ = ["dtw", "median_filter", "speech_frames", "time_words"]

FRAMES_PER_SECOND = 50  # encoder frames (stride-2 convolution over 10 ms feature frames)
MEDIAN_WIDTH = 7
PREPEND = "\"'“¿([{-"
APPEND = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END = ".。!！?？"


def speech_frames(features: Tensor, frames: int) -> Tensor:
    """Which of a window's feature frames are louder than its quiet ones: ``(frames,)``
    bool from ``features (n_mels, 3000)`` (normalised log-mel, 100 frames a second).

    A frame's loudness is its loudest mel bin; quiet is the 5th percentile over the window,
    loud its maximum; a frame is speech above 30% of the way from quiet to loud.
    """
    loud = features[:, :frames].amax(dim=0)  # (frames,)
    if loud.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    quiet = torch.quantile(loud.float(), 0.05)
    return loud > quiet + 0.3 * (loud.max() - quiet)


GAP_FRAMES = 10  # quieter stretches shorter than 0.1 s are inside a word (a stop's closure)


def _narrow(a: float, b: float, speech: Tensor) -> tuple[float, float]:
    """``[a, b]`` (seconds in the window) shrunk to its longest run of speech frames (runs
    closer than :data:`GAP_FRAMES` joined): the alignment may hand a word the onset of the
    next one or the tail of the one before."""
    lo, hi = round(a * 100), round(b * 100)
    inside = torch.nonzero(speech[lo:hi]).flatten().tolist()
    if not inside:
        return a, b
    runs, first = [], inside[0]
    for prev, cur in itertools.pairwise(inside):
        if cur - prev > GAP_FRAMES:
            runs.append((first, prev))
            first = cur
    runs.append((first, inside[-1]))
    start, end = max(runs, key=lambda r: r[1] - r[0])
    return (lo + start) / 100, (lo + end + 1) / 100


def median_filter(x: Tensor, width: int = MEDIAN_WIDTH) -> Tensor:
    """Median over a sliding ``width`` (odd) along the last axis, edges reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    rows = x.reshape(-1, 1, x.shape[-1])  # (N, 1, L): reflection pads the last axis
    padded = torch.nn.functional.pad(rows, (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad].reshape(x.shape)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path from ``(0, 0)`` to ``(T-1, S-1)`` through ``cost (T, S)``
    (steps: diagonal, down, right; ties go right, as openai-whisper's): ``(rows, cols)``."""
    T, S = cost.shape
    acc = np.full((T + 1, S + 1), np.inf)
    acc[0, 0] = 0.0
    step = np.zeros((T + 1, S + 1), dtype=np.int8)
    for d in range(2, T + S + 1):  # anti-diagonals: each cell needs the two before
        i = np.arange(max(1, d - S), min(T, d - 1) + 1)
        j = d - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        pick = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        acc[i, j] = cost[i - 1, j - 1] + np.choose(pick, [c0, c1, c2])
        step[i, j] = pick
    step[0, :], step[:, 0] = 2, 1
    i, j, path = T, S, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        move = step[i, j]
        i, j = (i - 1, j - 1) if move == 0 else (i - 1, j) if move == 1 else (i, j - 1)
    rows, cols = np.array(path[::-1]).T
    return rows, cols


def _scores(model, memory: Tensor, tokens: list[int], heads, frames: int) -> tuple[Tensor, Tensor]:
    """Teacher-force ``tokens``: ``(logits (T, V), alignment score (T, frames // 2))``."""
    kept: dict[int, Tensor] = {}
    layers = sorted({layer for layer, _ in heads})

    def hook(layer: int):
        def read(inputs, _point):
            q, k = inputs.query[0], inputs.key[0]  # (H, T, D), (H, S, D)
            scale = inputs.scale if inputs.scale is not None else q.shape[-1] ** -0.5
            kept[layer] = (q @ k.transpose(-1, -2)).float() * scale  # (H, T, S)
        return read

    handles = [model.decoder_blocks[layer].cross_attn.hook_inputs.add_hook(hook(layer))
               for layer in layers]  # fmt: skip
    try:
        with torch.no_grad():
            ids = torch.tensor([tokens], device=memory.device)
            logits = model.decode(ids, memory[None])[0].float()  # (T, V)
    finally:
        for h in handles:
            h.remove()
    w = torch.stack([kept[layer][head] for layer, head in heads])  # (K, T, S)
    w = w[:, :, : frames // 2].softmax(dim=-1)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    w = median_filter((w - mean) / std)
    return logits, w.mean(dim=0)  # (T, V), (T, frames // 2)


def _words(bundle, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """``tokens`` grouped into words: a new word at a leading space, punctuation or a
    special token; tokens that end inside a UTF-8 character join the next."""
    out: list[tuple[str, list[int]]] = []
    held: list[int] = []
    for token in tokens:
        held.append(token)
        piece = bundle.decode_text(held) if token < bundle.vocab.eot else "<|endoftext|>"
        if "\ufffd" in piece:
            continue
        new = (token >= bundle.vocab.eot or piece.startswith(" ")
               or piece.strip() in string.punctuation or not out)  # fmt: skip
        if new:
            out.append((piece, held))
        else:
            out[-1] = (out[-1][0] + piece, out[-1][1] + held)
        held = []
    return out


def _merge_punctuation(words: list[list]) -> None:
    """Join leading marks to the next word and trailing marks to the previous (in place;
    each item ``[text, tokens, start, end, prob]``)."""
    for i in range(len(words) - 2, -1, -1):
        prev, nxt = words[i], words[i + 1]
        if prev[0].startswith(" ") and prev[0].strip() in PREPEND and prev[0]:
            nxt[0], nxt[1], prev[0], prev[1] = prev[0] + nxt[0], prev[1] + nxt[1], "", []
    i = 0
    for j in range(1, len(words)):
        prev, nxt = words[i], words[j]
        if not prev[0].endswith(" ") and nxt[0] and nxt[0] in APPEND:
            prev[0], prev[1], nxt[0], nxt[1] = prev[0] + nxt[0], prev[1] + nxt[1], "", []
        else:
            i = j


def _align(bundle, memory: Tensor, text: list[int], frames: int) -> list[list]:
    """Each word of ``text`` as ``[text, tokens, start, end, probability]``, seconds from the
    window's start."""
    vocab, start = bundle.vocab, [vocab_id for vocab_id in bundle.prompt]
    tokens = [*start, *text, vocab.eot]
    logits, score = _scores(bundle.model, memory, tokens, bundle.alignment_heads, frames)
    probs = logits[len(start) - 1 : -2, : vocab.eot].softmax(dim=-1).cpu()  # (n, eot)
    token_probs = probs[torch.arange(len(text)), torch.tensor(text)].numpy()
    rows, cols = dtw(-score[len(start) - 1 : -1].double().cpu().numpy())  # NumPy: on the CPU
    grouped = _words(bundle, [*text, vocab.eot])
    bounds = np.pad(np.cumsum([len(t) for _, t in grouped[:-1]]), (1, 0))
    jumps = np.pad(np.diff(rows), (1, 0), constant_values=1).astype(bool)
    times = cols[jumps] / FRAMES_PER_SECOND
    return [[w, t, float(times[a]), float(times[b]), float(token_probs[a:b].mean())]
            for (w, t), a, b in zip(grouped[:-1], bounds[:-1], bounds[1:], strict=True)]


def _trim_long(words: list[list]) -> float:
    """Cut words longer than twice the median (<= 0.7 s) next to a sentence end; returns
    the median duration."""
    durations = np.array([w[3] - w[2] for w in words])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = 2 * median
    if len(durations):
        for i in range(1, len(words)):
            if words[i][3] - words[i][2] > longest:
                if words[i][0] in SENTENCE_END:
                    words[i][3] = words[i][2] + longest
                elif words[i - 1][0] in SENTENCE_END:
                    words[i][2] = words[i][3] - longest
    return median


def time_words(bundle, segments: list[Segment], memory: Tensor, offset: float, frames: int,
               last_speech: float, speech: Tensor | None = None
               ) -> tuple[list[Segment], float]:  # fmt: skip
    """``segments`` (one window's, starting at ``offset`` s) with their words timed.

    Args:
        memory: the window's encoder output ``(S, E)``.
        frames: the window's feature frames holding audio.
        last_speech: the end of the speech before this window (seconds).
        speech: ``(frames,)`` which feature frames are speech (:func:`speech_frames`), to
            narrow each word to; None keeps the alignment's times.

    Returns:
        the segments with ``words`` (and start/end moved to the words' where they agree),
        and the new end of speech.
    """
    eot = bundle.vocab.eot
    texts = [[t for t in s.tokens if t < eot] for s in segments]
    flat = [t for ts in texts for t in ts]
    if not flat:
        return segments, last_speech
    words = _align(bundle, memory, flat, frames)
    if speech is not None:
        for w in words:
            w[2], w[3] = _narrow(w[2], w[3], speech)
    median = _trim_long(words)
    _merge_punctuation(words)
    out, w = [], 0
    for seg, toks in zip(segments, texts, strict=True):
        timed, used = [], 0
        while w < len(words) and used < len(toks):
            text, tk, a, b, p = words[w]
            if text:
                timed.append(Word(text, round(offset + a, 2), round(offset + b, 2), p))
            used, w = used + len(tk), w + 1
        seg, last_speech = _fit(seg, timed, median, last_speech)
        out.append(seg)
    return out, last_speech


def _fit(seg: Segment, words: list[Word], median: float, last_speech: float
         ) -> tuple[Segment, float]:  # fmt: skip
    """Reconcile a segment's bounds with its words' (openai-whisper's rules)."""
    if not words:
        return replace(seg, words=()), last_speech
    longest = 2 * median
    first, ws = words[0], list(words)
    if first.end - last_speech > 4 * median and (first.end - first.start > longest or (
            len(ws) > 1 and ws[1].end - first.start > 2 * longest)):  # fmt: skip
        if len(ws) > 1 and ws[1].end - ws[1].start > longest:
            cut = max(ws[1].end / 2, ws[1].end - longest)
            ws[0], ws[1] = replace(ws[0], end=cut), replace(ws[1], start=cut)
        ws[0] = replace(ws[0], start=max(0.0, ws[0].end - longest))
    start, end = seg.start, seg.end
    if start < ws[0].end and start - 0.5 > ws[0].start:
        ws[0] = replace(ws[0], start=max(0.0, min(ws[0].end - median, start)))
    else:
        start = ws[0].start
    if end > ws[-1].start and end + 0.5 < ws[-1].end:
        ws[-1] = replace(ws[-1], end=max(ws[-1].start + median, end))
    else:
        end = ws[-1].end
    return replace(seg, start=start, end=end, words=tuple(ws)), end
