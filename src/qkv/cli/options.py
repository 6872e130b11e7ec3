"""Typer options shared by the decoding commands (``qkv generate``, ``qkv chat``)."""

from __future__ import annotations

from typing import Annotated

import typer

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
