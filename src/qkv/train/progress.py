"""What a training run shows and leaves behind: a progress bar, ``metrics.jsonl``, ``loss.png``.

* :class:`ProgressBar`: a rich progress bar with loss, learning rate and tokens/s when rich
  is installed and the output is a terminal; otherwise one plain line every ``log_every``
  steps (logs and CI stay readable).
* :class:`MetricsLog`: one JSON object per line appended to ``<run_dir>/metrics.jsonl``
  (``{"split": "train" | "valid", "step": ..., ...}``), flushed at once, so a crashed or
  resumed run keeps everything written so far.
* :func:`plot_loss_curve`: the training loss (and validation loss when measured) against the
  step, drawn on a bare matplotlib Figure (Agg) (``pip install 'qkv[plots]'``). With label
  smoothing the training objective sits well above the validation cross-entropy (a model
  that is right with certainty still pays ``eps * log V``-ish for the smoothed mass), so the
  plain cross-entropy of the same training logits is drawn beside it: that is the curve to
  compare with validation.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsLog", "ProgressBar", "loss_curves", "plot_loss_curve"]


class ProgressBar:
    """Training progress: a rich bar on a terminal, else plain lines.

    Args:
        total: the last step.
        initial: steps already done (a resumed run).
        enabled: False shows nothing.
        log_every: steps between plain lines.
        stream: where plain lines go (default ``sys.stdout``).
        rich: force rich on (True) or off (False); None = when installed and a terminal.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        enabled: bool = True,
        log_every: int = 10,
        stream: TextIO | None = None,
        rich: bool | None = None,
    ) -> None:
        self.total, self.enabled, self.log_every = total, enabled, log_every
        self.stream = stream if stream is not None else sys.stdout
        self._rich: Any = None
        if enabled and (rich is True or (rich is None and self.stream.isatty())):
            self._rich = _rich_progress(total, initial)

    def update(self, step: int, *, loss: float, lr: float, tokens_per_s: float,
               ce: float | None = None) -> None:  # fmt: skip
        """Show step ``step`` (1-based) with its loss, learning rate and throughput.

        ``ce``: the unsmoothed cross-entropy when ``loss`` is label-smoothed; both are shown
        (``smoothed loss 1.2345  ce 0.4321``), so neither is mistaken for the other.
        """
        if not self.enabled:
            return
        losses = f"loss {loss:.4f}" if ce is None else f"smoothed loss {loss:.4f}  ce {ce:.4f}"
        text = f"{losses}  lr {lr:.2e}  {tokens_per_s:,.0f} tok/s"
        if self._rich is not None:
            progress, task = self._rich
            progress.update(task, completed=step, stats=text)
        elif step % self.log_every == 0 or step == self.total:
            print(f"step {step}/{self.total}  {text}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """Print a line (evaluations, checkpoints, warnings) above the bar."""
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich[0].console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Finish the bar (idempotent)."""
        if self._rich is not None:
            self._rich[0].stop()
            self._rich = None


def _rich_progress(total: int, initial: int) -> Any:
    try:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )
    except ImportError:
        return None
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
    )  # fmt: skip
    task = progress.add_task("train", total=total, completed=initial, stats="")
    progress.start()
    return progress, task


class MetricsLog:
    """Append JSON records to ``<run_dir>/metrics.jsonl``; a no-op without a run folder.

    Args:
        run_dir: the folder (created if needed), or None.
    """

    def __init__(self, run_dir: Path | None) -> None:
        self.path = None if run_dir is None else Path(run_dir) / "metrics.jsonl"
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one JSON line (non-finite floats become null)."""
        if self.path is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")


def loss_curves(
    history: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]], *, smoothing: float = 0.0
) -> list[tuple[str, list[int], list[float], str]]:
    """The curves of :func:`plot_loss_curve`: ``(legend label, steps, values, line style)``.

    The training objective (``"train loss"``, or ``"train loss (label smoothing 0.1)"``);
    with smoothing, ``"train cross-entropy (unsmoothed)"`` from each step's ``ce`` (steps
    without one, from runs before it was recorded, are left out); and ``"valid
    cross-entropy"`` from the evaluations with a ``loss``.
    """
    smoothed = smoothing > 0
    label = f"train loss (label smoothing {smoothing:g})" if smoothed else "train loss"
    curves = [(label, [h["step"] for h in history], [h["loss"] for h in history], "-")]
    ce = [h for h in history if h.get("ce") is not None]
    if smoothed and ce:
        curves.append(("train cross-entropy (unsmoothed)", [h["step"] for h in ce],
                       [h["ce"] for h in ce], "-"))  # fmt: skip
    valid = [e for e in evals if e.get("loss") is not None]
    if valid:
        curves.append(("valid cross-entropy", [e["step"] for e in valid],
                       [e["loss"] for e in valid], "o-"))  # fmt: skip
    return curves


def plot_loss_curve(
    history: Sequence[dict[str, Any]],
    evals: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    title: str = "training loss",
    smoothing: float = 0.0,
) -> Path:
    """Draw loss against step: training (per step) and validation (per evaluation), with a
    legend.

    Args:
        history: ``[{"step": int, "loss": float, "ce": float}, ...]``: ``loss`` the
            objective, ``ce`` (optional) the unsmoothed cross-entropy of the same logits.
        evals: ``[{"step": int, "loss": float, ...}, ...]`` (entries without a loss skipped).
        path: the PNG to write.
        title: the figure title.
        smoothing: the run's label smoothing; above 0 ``loss`` is labelled as smoothed and
            ``ce`` drawn beside it (the curves: :func:`loss_curves`).

    Returns:
        ``path``.

    Raises:
        ImportError: matplotlib missing (the message names ``pip install 'qkv[plots]'``).
    """
    try:
        # A bare Figure renders with Agg and leaves pyplot's global backend alone.
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "the loss curve needs matplotlib: pip install 'qkv[plots]'"
        ) from None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for label, steps, values, style in loss_curves(history, evals, smoothing=smoothing):
        ax.plot(steps, values, style, lw=1 if style == "-" else 1.5, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out
