"""Log-log plot of the suite's time and peak memory against length (matplotlib's Agg canvas,
no ``pyplot``: nothing global changes). :func:`plot_png` returns the PNG's bytes; the caller
decides where (and whether) they are written."""

from __future__ import annotations

import io

__all__ = ["figure", "plot_png"]

COLORS = {"flash": "tab:blue", "auto": "tab:green", "math": "tab:red",
          "qkv-torch": "tab:orange", "torch": "tab:gray"}


def _panels(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """One column per (dtype, mode) of the attention runs, then one for decoding."""
    panels: dict[str, list[dict]] = {}
    for r in records:
        if r["kind"] == "attention":
            mode = "forward" if r["mode"] == "fwd" else "forward+backward"
            panels.setdefault(f"{r['dtype']} {mode}", []).append(r)
        elif r["kind"] == "decode":
            panels.setdefault("decode (T = 1), x = S", []).append(r)
    return list(panels.items())


def plot_png(records: list[dict]) -> bytes | None:
    """:func:`figure` as PNG bytes; None when there is nothing to plot."""
    fig = figure(records)
    if fig is None:
        return None
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def figure(records: list[dict]):
    """The matplotlib Figure of the suite's records; None when there is nothing to plot.

    Top row: min time per call; bottom row: peak extra memory (fresh subprocess). Solid
    lines are full attention, dashed causal; skipped configurations leave gaps. Every panel
    with lines has a legend (backend, causal, dtype) and named axes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = _panels(records)
    if not panels:
        return None
    fig = Figure(figsize=(4 * len(panels), 7))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(panels), squeeze=False)
    for col, (title, rows) in enumerate(panels):
        decode = title.startswith("decode")
        for backend, color in COLORS.items():
            for causal, style in ((False, "-"), (True, "--")):
                for dtype in sorted({r["dtype"] for r in rows}):
                    pts = sorted(
                        (r["S"] if decode else r["T"], r) for r in rows
                        if r["backend"] == backend and r["causal"] == causal
                        and r["dtype"] == dtype and r.get("time")
                    )
                    if not pts:
                        continue
                    xs = [x for x, _ in pts]
                    label = f"{backend}{' causal' if causal else ''}"
                    line = style
                    if decode:  # no causal runs: the line style tells the dtypes apart
                        label += f" {dtype}"
                        line = "-" if dtype == "float32" else ":"
                    axes[0][col].plot(xs, [r["time"]["min_s"] for _, r in pts], line,
                                      color=color, marker="o", ms=3, label=label)
                    mem = [(x, r["memory"]["peak_extra_bytes"] / 2**20) for x, r in pts
                           if r.get("memory") and r["memory"]["peak_extra_bytes"] > 0]
                    if mem:
                        axes[1][col].plot(*zip(*mem, strict=True), line, color=color,
                                          marker="o", ms=3, label=label)
        axes[0][col].set_title(title, fontsize=10)
        for row, ylabel in ((0, "seconds per call (min)"), (1, "peak extra MiB")):
            ax = axes[row][col]
            ax.set_xlabel("S (keys)" if decode else "T = S (tokens)")
            ax.set_ylabel(ylabel)
            if ax.lines:
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "not measured" if row else "no timings", ha="center",
                        va="center", transform=ax.transAxes, fontsize=8)  # fmt: skip
                ax.set_xticks([])
                ax.set_yticks([])
            ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("qkv bench: attention time and peak memory against length (log-log)")
    fig.tight_layout()
    return fig
