"""What one stop of ``qkv tour`` shows and checks, independent of how it is displayed.

A stop is a function ``(Context) -> None`` that fills a :class:`Section` in order: text,
tables, pictures and :class:`Check` records (``section.close(...)``, ``section.at_most(...)``,
``section.holds(...)``). :mod:`qkv.cli.tour.console` prints a section with rich and
:mod:`qkv.cli.tour.html` draws the same section as HTML with its pictures, so the terminal and
the page never disagree. A failed check does not stop the section: it is recorded
(``Check.passed`` False) and :func:`qkv.cli.tour.stops.run_stops` turns it into the command's
failure after the stop has been shown.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "Check",
    "Context",
    "Grid",
    "Heatmaps",
    "Image",
    "Lines",
    "Pre",
    "Section",
    "Text",
    "shape_text",
]


def shape_text(shape: tuple[int, ...] | torch.Size) -> str:
    """``(2, 4, 3, 16)``."""
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _array(t: Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, Tensor):
        return t.detach().to(torch.float64).cpu().numpy()
    return np.asarray(t, dtype=np.float64)


@dataclass(frozen=True)
class Text:
    """One paragraph of plain text (no markup)."""

    text: str


@dataclass(frozen=True)
class Pre:
    """Preformatted text (a library report such as ``qkv.explain``), shown as is."""

    text: str


@dataclass(frozen=True)
class Grid:
    """A table: a title, column headers and rows of strings (first column is the row label)."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Heatmaps:
    """One or more matrices drawn side by side (a picture).

    Attributes:
        title: the picture's caption.
        panels: ``(panel title, (R, C) array)`` pairs.
        rows, cols: tick labels shared by the panels (None: indices).
    """

    title: str
    panels: tuple[tuple[str, np.ndarray], ...]
    rows: tuple[str, ...] | None = None
    cols: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Lines:
    """Curves over a shared x axis (a picture); ``log`` draws both axes logarithmic."""

    title: str
    x: tuple[float, ...]
    series: tuple[tuple[str, tuple[float, ...]], ...]
    xlabel: str
    ylabel: str
    log: bool = True


@dataclass(frozen=True)
class Image:
    """An RGB image ``(H, W, 3)`` in ``[0, 1]`` with a grid every ``grid`` pixels (a picture)."""

    title: str
    pixels: np.ndarray
    grid: int


@dataclass(frozen=True)
class Check:
    """One assertion of a stop: ``value`` compared with ``limit`` (or a plain yes/no).

    Attributes:
        label: what is checked, e.g. ``"every row sums to 1: max |row sum - 1|"``.
        passed: whether it holds.
        detail: the measured number against its limit, e.g. ``"= 2.4e-08 <= 1e-06"``.
    """

    label: str
    passed: bool
    detail: str

    def __str__(self) -> str:
        return f"{self.label} {self.detail}".strip()


PICTURES = (Heatmaps, Lines, Image)
Item = Text | Pre | Grid | Heatmaps | Lines | Image | Check


@dataclass
class Section:
    """The record one stop fills: its items in display order; ``number`` is its place in the
    whole tour (1-based), the same in the terminal and on the page."""

    name: str
    title: str
    number: int = 0
    items: list[Item] = field(default_factory=list)

    @property
    def checks(self) -> list[Check]:
        return [item for item in self.items if isinstance(item, Check)]

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    @property
    def pictures(self) -> list[Heatmaps | Lines | Image]:
        return [item for item in self.items if isinstance(item, PICTURES)]

    def text(self, text: str) -> None:
        self.items.append(Text(text))

    def pre(self, text: str) -> None:
        self.items.append(Pre(text))

    def grid(self, title: str, headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
        self.items.append(Grid(title, tuple(headers), tuple(tuple(r) for r in rows)))

    def matrix(
        self,
        title: str,
        m: Tensor,
        rows: tuple[str, ...] | None = None,
        cols: tuple[str, ...] | None = None,
        fmt: str = ".4f",
        extra: tuple[str, Tensor] | None = None,
    ) -> None:
        """A 2-D tensor as a table, row ``i`` labelled ``rows[i]`` (default ``q0, q1, ...``)."""
        a = _array(m)
        rows = rows or tuple(f"q{i}" for i in range(a.shape[0]))
        cols = cols or tuple(f"k{j}" for j in range(a.shape[1]))
        headers = ("", *cols) + ((extra[0],) if extra is not None else ())
        body = []
        for i in range(a.shape[0]):
            cells = [format(int(x) if fmt == "d" else x, fmt) for x in a[i]]
            if extra is not None:
                cells.append(f"{float(extra[1][i]):.6f}")
            body.append((rows[i], *cells))
        self.grid(title, headers, body)

    def heatmaps(
        self,
        title: str,
        panels: list[tuple[str, Tensor | np.ndarray]],
        rows: tuple[str, ...] | None = None,
        cols: tuple[str, ...] | None = None,
    ) -> None:
        self.items.append(Heatmaps(title, tuple((n, _array(m)) for n, m in panels), rows, cols))

    def lines(self, title: str, x, series, xlabel: str, ylabel: str, log: bool = True) -> None:
        self.items.append(Lines(
            title, tuple(float(v) for v in x),
            tuple((n, tuple(float(v) for v in ys)) for n, ys in series), xlabel, ylabel, log,
        ))  # fmt: skip

    def image(self, title: str, pixels: Tensor | np.ndarray, grid: int) -> None:
        self.items.append(Image(title, _array(pixels), grid))

    # ---- checks: each records one Check and returns whether it passed

    def at_most(self, label: str, value: float, limit: float) -> bool:
        """``value <= limit`` (a NaN never passes)."""
        value = float(value)
        ok = math.isfinite(value) and value <= limit
        self.items.append(Check(label, ok, f"= {value:.3g} {'<=' if ok else '>'} {limit:.3g}"))
        return ok

    def close(self, label: str, got: Tensor, want: Tensor, tol: float) -> bool:
        """``max |got - want| <= tol`` (shapes must match)."""
        if tuple(got.shape) != tuple(want.shape):
            return self.holds(label, False, f"(shapes differ: {shape_text(got.shape)} vs "
                              f"{shape_text(want.shape)})")  # fmt: skip
        diff = (got.detach().double() - want.detach().double()).abs()
        return self.at_most(f"{label}: max |difference|", float(diff.max()) if diff.numel()
                            else 0.0, tol)  # fmt: skip

    def holds(self, label: str, ok: bool, detail: str = "") -> bool:
        self.items.append(Check(label, bool(ok), detail))
        return bool(ok)


@dataclass(frozen=True)
class Context:
    """What every stop receives: the seed, the dtype asked for, and derived settings.

    Attributes:
        seed: seeds every random tensor and module of the tour.
        dtype: ``--dtype``; the attention-function stops and the memory table use it.
        work_dtype: the dtype of the module stops (float64 when asked for, else float32, so
            bfloat16 runs them in float32).
        tol: the tolerance of module-level equalities in ``work_dtype`` (1e-5 in float32).
    """

    seed: int = 0
    dtype: torch.dtype = torch.float32

    @property
    def work_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def tol(self) -> float:
        return 1e-10 if self.work_dtype == torch.float64 else 1e-5

    def generator(self, stream: int = 0) -> torch.Generator:
        """A fresh generator for one stop (``stream`` keeps stops independent of each other)."""
        return torch.Generator().manual_seed(self.seed * 1000 + stream)

    def randn(self, *shape: int, gen: torch.Generator) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(self.work_dtype)

    def seeded(self, stream: int) -> None:
        """Seed torch's global generator (module initialisation) for one stop."""
        torch.manual_seed(self.seed * 1000 + stream)

    @functools.cached_property
    def basics(self):
        """The attention-function numbers of :func:`qkv.cli.tour.basics.compute_tour`."""
        from qkv.cli.tour.basics import compute_tour

        return compute_tour(seed=self.seed, dtype=self.dtype)
