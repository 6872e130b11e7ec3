"""What the ``qkv`` commands share, defined once: the error line, option types, formatting.

Every command module imports its shared helpers from here and from the library, never from
another command module.

* :func:`fail`: an expected failure as one line ``error: <message>`` on stderr, exit status 2.
* :class:`DTypeName`: the ``--dtype`` choices.
* ``Temperature``, ``TopK``, ``TopP``, ``Seed``: the decoding options of ``qkv generate`` and
  ``qkv chat``.
* :func:`human_bytes`, :func:`metrics_line`: how sizes and metrics are printed.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

__all__ = [
    "DTypeName",
    "Seed",
    "Temperature",
    "TopK",
    "TopP",
    "fail",
    "human_bytes",
    "metrics_line",
]


def fail(err: BaseException | str | object) -> typer.Exit:
    """Print ``error: <message>`` as one line on stderr; return the exit (status 2) to raise.

    Whitespace in the message (a newline from a library error) is collapsed to single spaces,
    so the failure is always one line; an empty message prints the exception's type.
    """
    message = " ".join(str(err).split()) or type(err).__name__
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[red]error:[/red] {escape(message)}", markup=True
    )
    return typer.Exit(2)


class DTypeName(str, Enum):
    """Floating dtypes a command accepts as ``--dtype``; shared by every command."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float64 = "float64"

    def to_torch(self):
        """The matching ``torch.dtype`` (torch imported here, not at package import)."""
        import torch

        return getattr(torch, self.value)


Temperature = Annotated[float, typer.Option(
    "--temperature", "-t", min=0.0, help="0 = greedy; > 0 samples.",
)]
TopK = Annotated[int | None, typer.Option(
    "--top-k", min=1, help="Sample among the k most probable tokens only.",
)]
TopP = Annotated[float | None, typer.Option(
    "--top-p", min=0.0, max=1.0, help="Sample within the nucleus of probability mass p.",
)]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed of the sampling.")]


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``1 MiB``, ``4 GiB``, ``512 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def metrics_line(metrics: dict[str, float]) -> str:
    """``exact match 99.2%  BLEU 98.1  chrF 99.0`` or ``loss 1.234  perplexity 3.43``."""
    parts = []
    for key, value in metrics.items():
        if key == "exact_match":
            parts.append(f"exact match {value:.1%}")
        elif key == "token_accuracy":
            parts.append(f"token accuracy {value:.1%}")
        elif key in ("bleu", "chrf"):
            parts.append(f"{'BLEU' if key == 'bleu' else 'chrF'} {value:.1f}")
        else:
            parts.append(f"{key} {value:.4g}")
    return "  ".join(parts)
