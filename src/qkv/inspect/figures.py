"""Pictures of the parts that do not depend on a model's weights: positions and masks.

* :func:`plot_positions`: the sinusoidal position matrix of Vaswani et al. (2017), positions
  down, dimensions across (:func:`qkv.nn.sinusoidal_table`).
* :func:`plot_masks`: the causal mask, the padding mask of a batch of lengths and their
  combination, as the keep masks qkv passes to attention (:mod:`qkv.masks`; white = may attend).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from qkv.attention import masks
from qkv.inspect.plots import new_figure, save
from qkv.inspect.pool import pool
from qkv.nn.positions import sinusoidal_table

__all__ = ["plot_masks", "plot_positions"]


def plot_positions(
    path: str | os.PathLike,
    *,
    max_len: int = 128,
    d_model: int = 128,
    figsize: tuple[float, float] = (8.0, 5.0),
    dpi: int = 100,
    max_cells: int = 512,
) -> Path:
    """The sinusoidal position matrix ``(max_len, d_model)`` as a heatmap in ``[-1, 1]``.

    Raises:
        ValueError: ``max_len`` or ``d_model`` below 1, bad ``figsize``/``dpi``.
    """
    for name, v in (("max_len", max_len), ("d_model", d_model)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    table = pool(sinusoidal_table(max_len, d_model, dtype=torch.float64), max_cells, max_cells)
    fig = new_figure(figsize, dpi)
    ax = fig.add_axes((0.1, 0.12, 0.76, 0.78))
    image = ax.imshow(table.numpy(), cmap="RdBu", vmin=-1, vmax=1, aspect="auto",
                      interpolation="nearest")  # fmt: skip
    bar = fig.colorbar(image, cax=fig.add_axes((0.88, 0.12, 0.03, 0.78)))
    bar.set_label("value: sin (even dimensions), cos (odd)", fontsize=8)
    ax.set_title(f"sinusoidal positions: {max_len} positions × {d_model} dimensions", fontsize=10)
    ax.set_xlabel("dimension" + (" (block means)" if d_model > max_cells else ""))
    ax.set_ylabel("position" + (" (block means)" if max_len > max_cells else ""))
    return save(fig, path)


def plot_masks(
    path: str | os.PathLike,
    *,
    length: int = 12,
    lengths: Sequence[int] = (12, 7),
    figsize: tuple[float, float] | None = None,
    dpi: int = 100,
    max_cells: int = 256,
) -> Path:
    """Causal, padding and combined keep masks, one panel each (one padding and one combined
    panel per sequence of the batch); a legend says white = may attend, black = masked.

    Args:
        length: the padded length ``T`` (queries and keys).
        lengths: real tokens of each sequence (right padding), each ``<= length``.
        figsize: default ``(2.4 · panels, 2.8)`` inches.

    Raises:
        ValueError: bad lengths (see :func:`qkv.masks.padding`).
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    causal = masks.causal(length)  # (T, T)
    pad = masks.padding(list(lengths), length)  # (B, 1, 1, T)
    panels = [("causal", causal)]
    for b, n in enumerate(lengths):
        keep = pad[b, 0].expand(length, length)  # (T, T)
        panels.append((f"padding, row {b} (len {n})", keep))
        panels.append((f"causal & padding, row {b}", keep & causal))
    fig = new_figure(figsize or (2.4 * len(panels), 2.8), dpi)
    for i, (title, m) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ax.imshow(pool(m.double(), max_cells, max_cells).numpy(), cmap="gray", vmin=0, vmax=1,
                  interpolation="nearest")  # fmt: skip
        ax.set_title(title, fontsize=7)
        ticks = _position_ticks(length, max_cells)
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=5)
        ax.set_yticks(ticks, [str(t) for t in ticks], fontsize=5)
        ax.set_xlabel("key position", fontsize=6)
        if i == 0:
            ax.set_ylabel("query position", fontsize=6)
    from matplotlib.patches import Patch

    keys = [Patch(facecolor="white", edgecolor="black", label="may attend (True)"),
            Patch(facecolor="black", edgecolor="black", label="masked (False)")]  # fmt: skip
    fig.legend(handles=keys, loc="lower center", ncol=2, fontsize=6, frameon=False)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.2, top=0.88, wspace=0.25)
    return save(fig, path)


def _position_ticks(length: int, max_cells: int) -> list[int]:
    """A few cell positions to label on a mask panel (ends included)."""
    cells = min(length, max_cells)
    step = max(1, -(-cells // 4))
    return sorted({*range(0, cells, step), cells - 1})
