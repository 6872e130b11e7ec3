"""Heatmaps of the analysis results: patching sweeps, the logit lens, logit attribution, scores.

* :func:`plot_heatmap`: any ``(rows, cols)`` tensor with axis labels, tick labels and a colour
  bar; sequential colours (viridis) or, with ``center``, diverging ones (blue below, red above,
  symmetric limits) for signed results.
* :func:`plot_patching`: a :func:`~qkv.inspect.patching.patch_residual` grid ``(L, T)`` or a
  :func:`~qkv.inspect.patching.patch_heads` grid ``(L, H)``.
* :func:`plot_logit_lens`: each layer's probability of its top token (or of a target token) at
  every position, top tokens written in the cells.
* :func:`plot_head_attribution`: :class:`~qkv.inspect.lens.Attribution` per head ``(L, H)``,
  or any ``(L, H)`` score such as :func:`~qkv.inspect.induction.prefix_matching_scores`.

Figures are drawn on matplotlib's Agg canvas (no ``pyplot``) and written atomically as PNG
(:func:`qkv.inspect.files.atomic_write`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from qkv.inspect.lens import Attribution, LogitLens
from qkv.inspect.plots import axis_note, display_labels, label_budget, new_figure, save

__all__ = ["plot_head_attribution", "plot_heatmap", "plot_logit_lens", "plot_patching"]


def _matrix(values: object, name: str) -> Tensor:
    if not isinstance(values, Tensor) or values.dim() != 2 or values.numel() == 0:
        shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(f"{name} must be a non-empty 2-D tensor, got {shape}")
    m = values.detach().double().cpu()
    if not torch.isfinite(m).all():
        raise ValueError(f"{name} has {int((~torch.isfinite(m)).sum())} NaN or infinite entries")
    return m


def _ticks(labels: Sequence[str] | None, n: int, name: str, max_labels: int = 48):
    """At most ``max_labels`` evenly spaced ticks, labelled by ``labels`` (cut to 14
    characters) or by their indices."""
    if labels is not None and len(labels) != n:
        raise ValueError(f"{name} must have {n} labels, got {len(labels)}")
    step = max(1, -(-n // max_labels))
    positions = list(range(0, n, step))
    texts = [str(labels[i]) if labels is not None else str(i) for i in positions]
    return positions, [t if len(t) <= 14 else t[:13] + "…" for t in texts]


def plot_heatmap(
    values: Tensor,
    path: str | os.PathLike,
    *,
    row_label: str = "layer",
    col_label: str = "",
    row_ticks: Sequence[str] | None = None,
    col_ticks: Sequence[str] | None = None,
    title: str = "",
    center: float | None = None,
    colorbar_label: str = "value",
    annotations: Sequence[Sequence[str]] | None = None,
    limits: tuple[float, float] | None = None,
    figsize: tuple[float, float] | None = None,
    dpi: int = 100,
) -> Path:
    """Draw ``values (R, C)`` as a heatmap with a colour bar and write it as a PNG.

    Args:
        values: the matrix, rows down (``row_label``), columns across (``col_label``).
        path: the PNG to write (folders are created).
        row_ticks, col_ticks: a label per row / column (default: indices).
        title, colorbar_label: texts (say what the colour measures).
        center: None for viridis from min to max; a number for diverging colours
            symmetric around it (e.g. 0 for signed attributions).
        annotations: ``R × C`` strings written in the cells (e.g. top tokens).
        limits: ``(low, high)`` of the colour scale (default: the data's range).
        figsize: inches (default: grows with the matrix); dpi: pixels per inch.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: not a non-empty finite 2-D tensor, tick or annotation counts that do not
            match, bad ``figsize``/``dpi``.
    """
    m = _matrix(values, "values")
    R, C = m.shape
    if annotations is not None and (len(annotations) != R or any(len(r) != C for r in annotations)):
        raise ValueError(f"annotations must be {R} rows of {C} strings")
    size = figsize or (max(5.0, min(16.0, 2.5 + 0.45 * C)), max(3.0, min(12.0, 1.8 + 0.45 * R)))
    fig = new_figure(size, dpi)
    ax = fig.add_axes((0.15, 0.18, 0.6, 0.7))
    if limits is not None:
        kw = {"cmap": "viridis" if center is None else "RdBu_r", "vmin": limits[0],
              "vmax": limits[1]}  # fmt: skip
    elif center is None:
        kw = {"cmap": "viridis", "vmin": float(m.min()), "vmax": float(m.max())}
    else:
        reach = float((m - center).abs().max()) or 1.0
        kw = {"cmap": "RdBu_r", "vmin": center - reach, "vmax": center + reach}
    image = ax.imshow(m.numpy(), aspect="auto", interpolation="nearest", **kw)
    yt, ytext = _ticks(row_ticks, R, "row_ticks", label_budget(ax, "y"))
    xt, xtext = _ticks(col_ticks, C, "col_ticks", label_budget(ax, "x"))
    ax.set_yticks(yt, ytext, fontsize=7 if len(yt) > 24 else 8)
    ax.set_xticks(xt, xtext, fontsize=7 if len(xt) > 24 else 8,
                  rotation=90 if col_ticks is not None or C > 12 else 0)  # fmt: skip
    ax.set_xlabel(col_label + axis_note(C, C, len(xt)))
    ax.set_ylabel(row_label + axis_note(R, R, len(yt)))
    ax.set_title(title, fontsize=10)
    if annotations is not None:
        for r in range(R):
            for c in range(C):
                light = center is not None or float(image.norm(m[r, c])) > 0.6
                ax.text(c, r, annotations[r][c], ha="center", va="center", fontsize=6,
                        color="black" if light else "white")  # fmt: skip
    bar = fig.colorbar(image, cax=fig.add_axes((0.78, 0.18, 0.03, 0.7)))
    bar.set_label(colorbar_label)
    return save(fig, path)


def plot_patching(grid: Tensor, path: str | os.PathLike, *, tokens: Sequence[str] | None = None,
                  kind: str = "position", title: str = "activation patching",
                  center: float | None = None, metric_label: str = "metric",
                  dpi: int = 100) -> Path:  # fmt: skip
    """Heatmap of a patching sweep: ``grid (L, T)`` with ``kind="position"`` (columns are
    positions, labelled by ``tokens``) or ``(L, H)`` with ``kind="head"``.

    Raises:
        ValueError: bad ``kind``; as :func:`plot_heatmap`.
    """
    if kind not in ("position", "head"):
        raise ValueError(f"kind must be 'position' or 'head', got {kind!r}")
    cols = display_labels(tokens) if kind == "position" else None
    return plot_heatmap(grid, path, col_label=kind, col_ticks=cols, title=title, center=center,
                        colorbar_label=metric_label, dpi=dpi)  # fmt: skip


def plot_logit_lens(lens: LogitLens, path: str | os.PathLike, *, batch: int = 0,
                    tokens: Sequence[str] | None = None, targets: Tensor | None = None,
                    token_names: Callable[[int], str] | None = None,
                    dpi: int = 100) -> Path:  # fmt: skip
    """Each layer's prediction at every position of sequence ``batch``.

    Args:
        lens: a :class:`~qkv.inspect.lens.LogitLens`.
        tokens: labels of the input positions.
        targets: ``(T,)`` token ids: colour is each layer's probability of them (e.g. the
            next tokens); None: the probability of each layer's top token.
        token_names: ``id -> text`` for the top tokens written in the cells (default: ids).

    Raises:
        TypeError: ``lens`` is not a :class:`~qkv.inspect.lens.LogitLens`.
        ValueError: ``batch`` out of range, ``targets`` of another length; as
            :func:`plot_heatmap`.
    """
    if not isinstance(lens, LogitLens):
        raise TypeError(f"lens must be a LogitLens, got {type(lens).__name__}")
    L1, B, T, _ = lens.logits.shape
    if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch < B:
        raise ValueError(f"batch must be an int in [0, {B}), got {batch!r}")
    probs, top = lens.top(1)  # (L+1, B, T, 1) each
    if targets is None:
        colour, label = probs[:, batch, :, 0], "p(top token)"
    else:
        if not isinstance(targets, Tensor) or tuple(targets.shape) != (T,):
            raise ValueError(f"targets must be a ({T},) tensor of token ids, got {targets!r:.60}")
        index = targets.long()[None, :, None].expand(L1, T, 1)  # (L+1, T, 1)
        colour = lens.probs()[:, batch].gather(-1, index)[..., 0]  # (L+1, T)
        label = "p(target)"
    name = token_names or str
    cells = None
    if T <= 40:  # wider inputs leave no room to write the top tokens in the cells
        cells = [[t[:6] for t in display_labels([name(int(t)) for t in row])]
                 for row in top[:, batch, :, 0]]  # fmt: skip
    rows = [f"block {i} in" for i in range(L1 - 1)] + ["output"]
    return plot_heatmap(colour, path, row_label="stream read", col_label="position", row_ticks=rows,
                        col_ticks=display_labels(tokens), title="logit lens", colorbar_label=label,
                        annotations=cells, limits=(0.0, 1.0), dpi=dpi)  # fmt: skip


def plot_head_attribution(values: Attribution | Tensor, path: str | os.PathLike, *,
                          batch: int | None = None, title: str = "direct logit attribution",
                          center: float | None = 0.0, dpi: int = 100) -> Path:  # fmt: skip
    """Layer × head heatmap of an :class:`~qkv.inspect.lens.Attribution` (its ``heads()``,
    averaged over the batch or sequence ``batch``) or of any ``(L, H)`` tensor (a
    :func:`~qkv.inspect.patching.patch_heads` grid, prefix-matching scores with
    ``center=None``).

    Raises:
        ValueError: as :func:`plot_heatmap`.
    """
    if isinstance(values, Attribution):
        heads = values.heads()  # (L, H, B)
        values = heads.mean(-1) if batch is None else heads[..., batch]
    return plot_heatmap(values, path, col_label="head", title=title, center=center,
                        colorbar_label="logit contribution" if center == 0.0 else "score",
                        dpi=dpi)  # fmt: skip
