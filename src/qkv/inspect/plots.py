"""Pictures of captured attention, written as PNG files (matplotlib, headless).

* :func:`plot_head`: one head's ``(T, S)`` weights as a heatmap with token labels.
* :func:`plot_grid`: every captured layer × head as small heatmaps.
* :func:`plot_alignment`: an encoder-decoder's cross-attention (target × source), heads averaged.
* :func:`rollout` / :func:`plot_rollout`: attention rollout (Abnar & Zuidema, 2020),
  ``R = Π_l normalise(0.5·W̄_l + 0.5·I)`` with ``W̄_l`` the head-averaged weights of layer ``l``.

Figures are drawn on matplotlib's Agg canvas without ``pyplot``, so nothing global changes and
no display is needed. Every PNG is exactly ``figsize × dpi`` pixels. Long inputs are shrunk to
at most ``max_cells`` rows and columns by exact block means (:mod:`qkv.inspect.pool`) and at
most ``max_labels`` tick labels are written (fewer when they would overlap: the axis name then
says ``"40 of 200 labelled"``), so thousands of tokens give a readable picture. Token labels
are shown readable (:func:`qkv.inspect.labels.readable_tokens`: ``Ġthe`` -> ``·the``), and
every figure has a colour bar that says what its colours measure.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.inspect.capture import Captured
from qkv.inspect.files import atomic_write
from qkv.inspect.labels import readable_tokens
from qkv.inspect.pool import bin_edges, pool

__all__ = ["plot_alignment", "plot_grid", "plot_head", "plot_rollout", "rollout"]

CMAP = "viridis"


def new_figure(figsize: tuple[float, float], dpi: int):
    """A matplotlib Figure on an Agg canvas (no pyplot, no display)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - matplotlib is in the plots extra
        raise ImportError("plots need matplotlib: pip install 'qkv[plots]'") from e
    if dpi < 10 or min(figsize) <= 0:
        raise ValueError(f"figsize must be positive and dpi >= 10, got {figsize}, {dpi}")
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def save(fig, path: str | os.PathLike) -> Path:
    """Write ``fig`` as PNG at its own size, atomically; grown (never cropped) to the
    box of its texts where a label would run off an edge (a long colour-bar label on a
    one-row grid, negative tick labels), so sizes stay predictable and nothing is cut."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=fig.dpi, bbox_inches=saved_box(fig))
    return atomic_write(path, buffer.getvalue())


def saved_box(fig):
    """The area :func:`save` writes, in inches: the figure, grown to hold every text
    (None: the figure as it is)."""
    from matplotlib.transforms import Bbox

    w, h = fig.get_size_inches()
    full = Bbox.from_bounds(0, 0, w, h)
    tight = fig.get_tightbbox(fig.canvas.get_renderer())
    if tight is None or (tight.x0 >= 0 and tight.y0 >= 0 and tight.x1 <= w and tight.y1 <= h):
        return None
    return Bbox.union([full, tight])


def display_labels(labels: Sequence[str] | None) -> list[str] | None:
    """Token pieces as readable text (one space marker, see :mod:`qkv.inspect.labels`), each
    cut to 14 characters."""
    if labels is None:
        return None
    texts = readable_tokens([str(t) for t in labels])
    return [t if len(t) <= 14 else t[:13] + "…" for t in texts]


def label_budget(ax, axis: str, points_per_label: float = 8.0) -> int:
    """How many tick labels fit along ``axis`` (``"x"`` or ``"y"``) of ``ax`` at about
    ``points_per_label`` points each (a 6-9 pt font with a gap)."""
    box = ax.get_position()
    width, height = ax.figure.get_size_inches()
    inches = box.width * width if axis == "x" else box.height * height
    return max(2, int(inches * 72 / points_per_label))


def tick_labels(labels: Sequence[str] | None, n: int, cells: int, max_labels: int):
    """Tick positions and texts for ``n`` positions drawn as ``cells`` cells: at most
    ``max_labels``, evenly spaced; a pooled cell is labelled by its range of positions."""
    edges = bin_edges(n, cells)
    step = max(1, -(-cells // max_labels))
    ticks, texts = [], []
    for c in range(0, cells, step):
        a, b = edges[c], edges[c + 1]
        ticks.append(c)
        if b - a == 1:
            texts.append(labels[a] if labels is not None else str(a))
        else:
            texts.append(f"{a}-{b - 1}")
    return ticks, texts


def axis_note(n: int, cells: int, shown: int) -> str:
    """What the axis shows when it is shrunk or thinned, e.g. ``" (block means of 4;
    every 2nd labelled)"``."""
    notes = []
    if cells < n:
        notes.append(f"block means of ~{-(-n // cells)}")
    if shown < cells:
        notes.append(f"{shown} of {cells} labelled")
    return f" ({'; '.join(notes)})" if notes else ""


def draw_matrix(ax, matrix: Tensor, q_labels, k_labels, *, max_cells: int, max_labels: int,
                vmax: float | None = None, labels: bool = True, norm=None,
                names: tuple[str, str] = ("query", "key")):  # fmt: skip
    """Heatmap of ``matrix (T, S)`` on ``ax``, shrunk to ``max_cells``; returns the image.

    With ``labels``, tick labels are the readable tokens (thinned to what fits the axis and
    at most ``max_labels``), and the axis names say when cells are block means or labels
    are thinned. ``norm`` (a matplotlib Normalize) replaces the linear ``0 .. vmax`` scale.
    """
    T, S = matrix.shape
    small = pool(matrix.detach().double(), max_cells, max_cells)  # (R, C)
    scale = {"norm": norm} if norm is not None else {"vmin": 0.0, "vmax": vmax}
    image = ax.imshow(small.numpy(), cmap=CMAP, aspect="auto", interpolation="nearest",
                      **scale)  # fmt: skip
    if labels:
        q_text, k_text = display_labels(q_labels), display_labels(k_labels)
        yt, ytext = tick_labels(q_text, T, small.shape[0],
                                min(max_labels, label_budget(ax, "y")))  # fmt: skip
        xt, xtext = tick_labels(k_text, S, small.shape[1],
                                min(max_labels, label_budget(ax, "x")))  # fmt: skip
        ax.set_yticks(yt, ytext, fontsize=7 if len(yt) > 24 else 8)
        ax.set_xticks(xt, xtext, fontsize=7 if len(xt) > 24 else 8, rotation=90)
        ax.set_ylabel(names[0] + axis_note(T, small.shape[0], len(yt)))
        ax.set_xlabel(names[1] + axis_note(S, small.shape[1], len(xt)))
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    return image


def head_matrix(source: Any, layer: str | int = 0, head: int = 0, batch: int = 0) -> Tensor:
    """The ``(T, S)`` weights of one head from a :class:`Captured` (``layer`` by name or
    index, ``head`` by its number in the model), a ``(B, H, T, S)`` tensor or a ``(T, S)`` one.

    Raises:
        ValueError: a head that was not captured, a tensor of another rank.
        KeyError: a layer that was not captured.
    """
    if isinstance(source, Captured):
        w = source[layer]
        name = layer if isinstance(layer, str) else source.layers[layer]
        if head not in source.heads[name]:
            raise ValueError(f"head {head} of {name} was not captured ({source.heads[name]})")
        return w[batch, source.heads[name].index(head)]
    if isinstance(source, Tensor) and source.dim() == 4:
        return source[batch, head]
    if isinstance(source, Tensor) and source.dim() == 2:
        return source
    raise ValueError(
        f"expected a Captured, a (B, H, T, S) or a (T, S) tensor, got {source!r:.80}"
    )


def plot_head(
    source: Any,
    path: str | os.PathLike,
    *,
    layer: str | int = 0,
    head: int = 0,
    batch: int = 0,
    q_tokens: Sequence[str] | None = None,
    k_tokens: Sequence[str] | None = None,
    title: str | None = None,
    figsize: tuple[float, float] = (7.0, 6.0),
    dpi: int = 100,
    max_cells: int = 256,
    max_labels: int = 64,
    colorbar_label: str = "attention weight",
    norm: Any = None,
    axis_names: tuple[str, str] = ("query", "key"),
) -> Path:
    """Heatmap of one head's weights (queries down, keys across) with token labels.

    Args:
        source: a :class:`Captured`, or weights ``(B, H, T, S)`` / ``(T, S)``.
        path: the PNG to write.
        layer, head, batch: which matrix (see :func:`head_matrix`).
        q_tokens, k_tokens: labels of queries and keys (default: positions; keys default
            to the query labels).
        title: the figure title (default: layer and head).
        figsize, dpi: the image is ``figsize · dpi`` pixels.
        max_cells: rows/columns drawn at most (longer inputs are block-averaged).
        max_labels: tick labels per axis at most (fewer when they would not fit).
        colorbar_label: the colour bar's text.
        norm: a matplotlib ``Normalize`` for the colours (default: linear from 0 to the max).
        axis_names: names of the rows and the columns.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError, KeyError: see :func:`head_matrix`; bad ``figsize``/``dpi``.
    """
    m = head_matrix(source, layer, head, batch)
    fig = new_figure(figsize, dpi)
    ax = fig.add_axes((0.18, 0.18, 0.68, 0.74))
    image = draw_matrix(ax, m, q_tokens, k_tokens if k_tokens is not None else q_tokens,
                        max_cells=max_cells, max_labels=max_labels, norm=norm,
                        names=axis_names)  # fmt: skip
    values = m.detach().double()
    ends = ("min" if float(values.min()) < image.norm.vmin else "",
            "max" if float(values.max()) > image.norm.vmax * (1 + 1e-9) else "")
    extend = {("", ""): "neither", ("min", "max"): "both"}.get(ends, ends[0] or ends[1])
    bar = fig.colorbar(image, cax=fig.add_axes((0.88, 0.18, 0.03, 0.74)), extend=extend)
    bar.set_label(colorbar_label, fontsize=8)
    ax.set_title(title or f"layer {layer}, head {head}", fontsize=10)
    return save(fig, path)


def plot_grid(
    cap: Captured,
    path: str | os.PathLike,
    *,
    layers: Sequence[str] | None = None,
    batch: int = 0,
    cell: float = 1.25,
    dpi: int = 100,
    max_cells: int = 64,
) -> Path:
    """Layers × heads grid of small heatmaps (queries down, keys across), each head divided by
    its own maximum and drawn on a square-root scale so that every pattern shows; one colour
    bar says so.

    The figure is ``(heads · cell + 0.6, layers · cell)`` inches (0.6 for the colour bar),
    ``cell`` shrunk so neither side exceeds 24 inches.

    Raises:
        TypeError: ``cap`` is not a :class:`Captured`.
        ValueError: no captured layer.
    """
    if not isinstance(cap, Captured):
        raise TypeError(f"cap must be a Captured, got {type(cap).__name__}")
    names = list(layers) if layers is not None else cap.layers
    if not names:
        raise ValueError("nothing was captured: run the model inside `with capture(...)`")
    cols = max(len(cap.heads[n]) for n in names)
    cell = min(cell, 24.0 / cols, 24.0 / len(names))
    width, height = cols * cell + 0.6, len(names) * cell
    fig = new_figure((width, height), dpi)
    weights = cap.weights
    image = None
    for r, name in enumerate(names):
        for c, h in enumerate(cap.heads[name]):
            ax = fig.add_subplot(len(names), cols, r * cols + c + 1)
            w = weights[name][batch, c].detach().double()  # (T, S)
            peak = float(w.max())
            image = draw_matrix(ax, w / peak if peak > 0 else w, None, None,
                                max_cells=max_cells, max_labels=1, norm=_sqrt(),
                                labels=False)  # fmt: skip
            if c == 0:
                ax.set_ylabel(name.replace(".self_attn", "").replace("_attn", ""), fontsize=6)
            if r == 0:
                ax.set_title(f"head {h}", fontsize=7)
    right = 1 - 0.6 / width
    fig.subplots_adjust(left=0.08, right=right - 0.02, bottom=0.01, top=1 - 0.25 / height,
                        wspace=0.08, hspace=0.12)  # fmt: skip
    bar = fig.colorbar(image, cax=fig.add_axes((right + 0.1 / width, 0.1, 0.12 / width, 0.75)))
    bar.set_label("weight / head's max, square-root scale (queries down, keys across)",
                  fontsize=6)  # fmt: skip
    bar.ax.tick_params(labelsize=6)
    return save(fig, path)


def plot_alignment(
    cap: Captured,
    path: str | os.PathLike,
    *,
    layer: str | None = None,
    batch: int = 0,
    src_tokens: Sequence[str] | None = None,
    tgt_tokens: Sequence[str] | None = None,
    figsize: tuple[float, float] = (7.0, 6.0),
    dpi: int = 100,
    max_cells: int = 256,
    title: str | None = None,
) -> Path:
    """Encoder-decoder alignment: a cross-attention layer's weights averaged over heads.

    Args:
        layer: the cross-attention layer (default: the last captured one).
        title: the figure's title (default: the layer and how many heads are averaged).

    Raises:
        ValueError: no cross-attention layer was captured.
    """
    cross = [n for n in cap.layers if cap.kinds.get(n) == "cross"]
    if not cross:
        raise ValueError("no cross-attention layer was captured (an encoder-decoder is needed)")
    name = layer or cross[-1]
    if name not in cross:
        raise ValueError(f"{name!r} is not a captured cross-attention layer; those are {cross}")
    m = cap.weights[name][batch].mean(0)  # (T_tgt, S_src)
    heads = len(cap.heads[name])
    return plot_head(m, path, q_tokens=tgt_tokens, k_tokens=src_tokens, figsize=figsize,
                     dpi=dpi, max_cells=max_cells, axis_names=("target token", "source token"),
                     colorbar_label=f"cross-attention weight (mean of {heads} heads)",
                     title=title or f"alignment: {name}, mean of {heads} heads")  # fmt: skip


def rollout(cap: Captured, layers: Sequence[str] | None = None, batch: int = 0) -> Tensor:
    """Attention rollout ``(T, T)`` through self-attention layers (in order).

    Row ``i`` says how much position ``i``'s output draws on each input position, counting
    the residual path as half of every layer (Abnar & Zuidema, 2020).

    Raises:
        ValueError: no square self-attention layers, or layers of different lengths.
    """
    names = list(layers) if layers is not None else [
        n for n in cap.layers if cap.kinds.get(n) != "cross" and n.split(".")[0] == (
            cap.layers[0].split(".")[0])
    ]  # fmt: skip
    mats = [cap.weights[n][batch].double().mean(0) for n in names]  # each (T, S)
    if not mats or any(m.shape[0] != m.shape[1] or m.shape != mats[0].shape for m in mats):
        raise ValueError(
            "rollout needs square self-attention weights (all rows captured) of one length; "
            f"got {[tuple(m.shape) for m in mats]}"
        )
    eye = torch.eye(mats[0].shape[0], dtype=torch.float64, device=mats[0].device)
    result = eye
    for m in mats:
        a = 0.5 * m + 0.5 * eye
        a = a / a.sum(-1, keepdim=True)
        result = a @ result  # (T, T)
    return result


def plot_rollout(
    cap: Captured,
    path: str | os.PathLike,
    *,
    tokens: Sequence[str] | None = None,
    batch: int = 0,
    figsize: tuple[float, float] = (7.0, 6.0),
    dpi: int = 100,
    max_cells: int = 256,
) -> Path:
    """Heatmap of :func:`rollout` on a logarithmic colour scale that leaves out the first key.

    Rollout piles most of every row onto the first token (an attention sink: 99.9% of each
    row through SmolLM2's 30 layers), so on a linear scale one bright column hides everything
    else. The colours are the logarithm of the share, from the 5th percentile to the maximum
    of the shares outside the first column; the first column, above the scale, saturates and
    smaller shares (and the zeros above a causal diagonal) take the lowest colour. The colour
    bar's label gives the first key's mean share.

    Raises: as :func:`rollout`.
    """
    r = rollout(cap, batch=batch)
    rest = r[:, 1:][r[:, 1:] > 0]
    if rest.numel() == 0:  # one key, or everything on the first one
        rest = r[r > 0]
    high = float(rest.max())
    low = max(float(torch.quantile(rest.float(), 0.05)), high * 1e-8)
    label = f"share, log scale without key 0 (key 0: {float(r[:, 0].mean()):.2%} of a row)"
    return plot_head(r, path, q_tokens=tokens, figsize=figsize, dpi=dpi, max_cells=max_cells,
                     colorbar_label=label, norm=_log(min(low, high / 10), high),
                     title="attention rollout (residual counted as 0.5)",
                     axis_names=("output position", "input token"))  # fmt: skip


def _sqrt():
    """A square-root colour scale on ``[0, 1]``: weak weights stay visible beside strong ones."""
    from matplotlib.colors import PowerNorm

    return PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)


def _log(vmin: float, vmax: float):
    """A logarithmic colour scale; values below ``vmin`` (zeros too) take the lowest colour,
    values above ``vmax`` the highest."""
    from matplotlib.colors import LogNorm

    return LogNorm(vmin=vmin, vmax=vmax, clip=True)
