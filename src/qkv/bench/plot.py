"""Log-log plot of the suite's time and peak memory against length (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot"]

COLORS = {"flash": "tab:blue", "auto": "tab:green", "math": "tab:red", "torch": "tab:gray"}


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


def plot(records: list[dict], path: Path) -> Path | None:
    """Write the figure to ``path``; None when there is nothing to plot.

    Top row: min time per call; bottom row: peak extra memory (fresh subprocess). Solid
    lines are full attention, dashed causal; skipped configurations leave gaps.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(records)
    if not panels:
        return None
    fig, axes = plt.subplots(2, len(panels), figsize=(4 * len(panels), 7), squeeze=False)
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
        axes[1][col].set_xlabel("S" if decode else "T = S")
        for row, ylabel in ((0, "seconds per call (min)"), (1, "peak extra MiB")):
            ax = axes[row][col]
            if ax.lines:
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel(ylabel)
        axes[0][col].legend(fontsize=7)
    fig.suptitle("qkv bench: attention time and peak memory against length (log-log)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
