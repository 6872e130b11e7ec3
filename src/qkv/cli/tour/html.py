"""The tour as one self-contained HTML page: inline CSS, pictures as inline base64 PNGs.

The page shows the same :class:`~qkv.cli.tour.page.Section` records the terminal prints, with
each picture drawn by matplotlib (on an Agg canvas, no ``pyplot``: nothing global changes).
Nothing on the page refers outside it: no scripts, fonts, stylesheets or links, only anchors
to its own stops.
"""

from __future__ import annotations

import base64
import html
import io

import numpy as np

from qkv.cli.tour.page import Check, Grid, Heatmaps, Image, Lines, Pre, Section, Text

__all__ = ["render_page"]

DPI = 80

CSS = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto;
       padding: 0 1rem; color: #1d2330; line-height: 1.45; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 2px solid #d6dbe6; padding-bottom: 0.2rem;
       margin-top: 2.5rem; } .name { color: #7a8499; font-size: 0.8em; font-weight: normal; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.88rem; }
caption { font-weight: bold; text-align: left; padding-bottom: 0.3rem; }
th, td { border: 1px solid #d6dbe6; padding: 0.15rem 0.5rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
pre { background: #f4f6fa; padding: 0.6rem; overflow-x: auto; font-size: 0.85rem; }
ul.checks { list-style: none; padding-left: 0; }
ul.checks li { font-family: ui-monospace, monospace; font-size: 0.85rem; margin: 0.15rem 0; }
li.pass { color: #17692f; } li.fail { color: #b3261e; font-weight: bold; }
figure { margin: 1rem 0; } figcaption { font-size: 0.85rem; color: #4a5366; }
img { max-width: 100%; } nav ol { columns: 2; }
"""


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _ticks(ax, labels: tuple[str, ...] | None, n: int, axis: str) -> None:
    if labels is None and n > 12:
        return
    texts = labels if labels is not None else tuple(str(i) for i in range(n))
    if axis == "x":
        ax.set_xticks(range(n), texts, rotation=90 if max(map(len, texts)) > 3 else 0,
                      fontsize=7)  # fmt: skip
    else:
        ax.set_yticks(range(n), texts, fontsize=7)


def _heatmaps(pic: Heatmaps):
    from qkv.inspect.plots import CMAP, new_figure

    n = len(pic.panels)
    width = 3.4 * n + 0.9  # inches: n panels with their colorbars, and room for row labels
    fig = new_figure((width, 3.2), DPI)
    for i, (title, a) in enumerate(pic.panels):
        ax = fig.add_subplot(1, n, i + 1)
        shown = ax.imshow(a, cmap=CMAP, aspect="auto")
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=7)
        fits = pic.rows is not None and len(pic.rows) == a.shape[0]
        _ticks(ax, pic.rows if fits else None, a.shape[0], "y")
        fits = pic.cols is not None and len(pic.cols) == a.shape[1]
        _ticks(ax, pic.cols if fits else None, a.shape[1], "x")
        fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)
    # Fixed margins: tight_layout would draw every figure twice.
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.5 / width, bottom=0.2, top=0.88,
                        wspace=0.5)  # fmt: skip
    return fig


def _lines(pic: Lines):
    from qkv.inspect.plots import new_figure

    fig = new_figure((6.5, 3.6), DPI)
    ax = fig.add_subplot(1, 1, 1)
    for name, ys in pic.series:
        ax.plot(pic.x, ys, marker="o", markersize=3, label=name)
    if pic.log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
    ax.set_xlabel(pic.xlabel)
    ax.set_ylabel(pic.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.15, top=0.95)
    return fig


def _image(pic: Image):
    from qkv.inspect.plots import new_figure

    fig = new_figure((3.2, 3.2), DPI)
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(np.clip(pic.pixels, 0.0, 1.0), interpolation="nearest")
    h, w = pic.pixels.shape[:2]
    for c in range(pic.grid, w, pic.grid):
        ax.axvline(c - 0.5, color="white", linewidth=2)
    for r in range(pic.grid, h, pic.grid):
        ax.axhline(r - 0.5, color="white", linewidth=2)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.subplots_adjust(left=0.05, right=0.95, bottom=0.05, top=0.95)
    return fig


DRAW = {Heatmaps: _heatmaps, Lines: _lines, Image: _image}


def _table(grid: Grid) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in grid.headers)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
                   for row in grid.rows)  # fmt: skip
    caption = f"<caption>{e(grid.title)}</caption>" if grid.title else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _section(section: Section) -> str:
    e = html.escape
    out = [f'<section id="stop-{e(section.name)}"><h2>{section.number}. {e(section.title)} '
           f'<span class="name">({e(section.name)})</span></h2>']  # fmt: skip
    checks: list[str] = []

    def flush() -> None:
        if checks:
            out.append('<ul class="checks">' + "".join(checks) + "</ul>")
            checks.clear()

    for item in section.items:
        if isinstance(item, Check):
            cls, mark = ("pass", "✓") if item.passed else ("fail", "✗")
            checks.append(f'<li class="{cls}">{mark} {e(str(item))}</li>')
            continue
        flush()
        if isinstance(item, Text):
            out.append(f"<p>{e(item.text)}</p>")
        elif isinstance(item, Pre):
            out.append(f"<pre>{e(item.text)}</pre>")
        elif isinstance(item, Grid):
            out.append(_table(item))
        else:
            png = _png(DRAW[type(item)](item))
            out.append(f'<figure><img alt="{e(item.title)}" src="data:image/png;base64,{png}">'
                       f"<figcaption>{e(item.title)}</figcaption></figure>")  # fmt: skip
    flush()
    out.append("</section>")
    return "\n".join(out)


def render_page(sections: list[Section], *, seed: int, dtype: str) -> str:
    """The whole page for ``sections`` (each under its tour number), as one HTML string."""
    e = html.escape
    total = sum(len(s.checks) for s in sections)
    passed = sum(c.passed for s in sections for c in s.checks)
    toc = "".join(f'<li><a href="#stop-{e(s.name)}">{e(s.title)}</a></li>' for s in sections)
    body = "\n".join(_section(s) for s in sections)
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>qkv tour</title><style>{CSS}</style></head><body>"
        "<h1>qkv tour</h1>"
        f"<p>Attention and the transformer, stop by stop, on live tensors (seed {seed}, "
        f"{e(dtype)}). Every stop shows what it computes and checks it: {passed} of {total} "
        "checks passed.</p>"
        f"<nav><ol>{toc}</ol></nav>\n{body}\n</body></html>\n"
    )
