"""What a training run shows and leaves behind: a progress bar, ``metrics.jsonl``, ``loss.png``.

* :class:`ProgressBar`: a rich progress bar with loss, learning rate and tokens/s when rich
  is installed and the output is a terminal; otherwise one plain line every ``log_every``
  steps (logs and CI stay readable).
* :class:`MetricsLog`: one JSON object per line appended to ``<run_dir>/metrics.jsonl``
  (``{"split": "train" | "valid", "step": ..., ...}``), flushed at once, so a crashed or
  resumed run keeps everything written so far.
* :func:`plot_loss_curve`: the training loss (and validation loss when measured) against the
  step, drawn on a bare matplotlib Figure (Agg) (``pip install 'qkv[plots]'``).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsLog", "ProgressBar", "plot_loss_curve"]


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

    def update(self, step: int, *, loss: float, lr: float, tokens_per_s: float) -> None:
        """Show step ``step`` (1-based) with its loss, learning rate and throughput."""
        if not self.enabled:
            return
        text = f"loss {loss:.4f}  lr {lr:.2e}  {tokens_per_s:,.0f} tok/s"
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


def plot_loss_curve(
    history: Sequence[dict[str, Any]],
    evals: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    title: str = "training loss",
) -> Path:
    """Draw loss against step: training (per step) and validation (per evaluation).

    Args:
        history: ``[{"step": int, "loss": float}, ...]``.
        evals: ``[{"step": int, "loss": float, ...}, ...]`` (entries without a loss skipped).
        path: the PNG to write.
        title: the figure title.

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
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1, label="train")
    valid = [e for e in evals if e.get("loss") is not None]
    if valid:
        ax.plot([e["step"] for e in valid], [e["loss"] for e in valid], "o-", label="valid")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out
