"""``qkv tour``: attention and the transformer walked through on live tensors, checked.

The stops (:data:`qkv.cli.tour.stops.STOPS`, in order) follow the tutorials qkv was built
from: the attention function and its weights, its four steps, NumPy vs torch, the
self-attention module, multi-head attention (= torch's), masks, positions, the transformer
block, a token's journey, the encoder-decoder, Bahdanau's additive attention, ViT patches and
the O(T·S) memory with what flash attention changes. Every stop prints what it shows and
checks it (rows sum to one, equals torch, equals the formula); a failed check makes the
command fail with one ``error:`` line naming the stop and the check, so the tour is a test.

:func:`compute_tour` (the attention-function numbers as plain data) and
:data:`COST_LENGTHS` are re-exported from :mod:`qkv.cli.tour.basics`.

Module map: this module is the command; :mod:`~qkv.cli.tour.stops` (the stops in order, how
each runs and is checked), the stops by subject (:mod:`~qkv.cli.tour.attention`,
:mod:`~qkv.cli.tour.modules`, :mod:`~qkv.cli.tour.masks`, :mod:`~qkv.cli.tour.positions`,
:mod:`~qkv.cli.tour.layers`, :mod:`~qkv.cli.tour.models`, :mod:`~qkv.cli.tour.memory`),
:mod:`~qkv.cli.tour.basics` (the attention-function numbers as plain data),
:mod:`~qkv.cli.tour.page` (what a stop shows and checks), and its two displays,
:mod:`~qkv.cli.tour.console` (the terminal) and :mod:`~qkv.cli.tour.html` (one
self-contained page).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.markup import escape

from qkv.checks import is_int
from qkv.cli.common import FLAG, DTypeName
from qkv.cli.tour.basics import COST_LENGTHS, Tour, compute_tour
from qkv.cli.tour.console import print_list, print_section
from qkv.cli.tour.page import Context, Section
from qkv.cli.tour.stops import check_sections, run_stop, select

__all__ = ["COST_LENGTHS", "Tour", "command", "compute_tour", "run_tour"]

NAME = "tour"
SEED_LIMIT = 2**31  # seeds are 0 .. 2**31 - 1 (each stop seeds torch with 1000·seed + stop)


def _html_path(path: Path) -> Path:
    """``path`` as a page to write: not a folder, and not below a file."""
    path = path.expanduser()
    if path.is_dir():
        raise ValueError(f"--html {path} is a folder; expected a file path such as tour.html")
    for above in path.parents:
        if above.exists() and not above.is_dir():
            raise ValueError(f"--html {path} cannot be written: {above} is a file, not a folder")
    return path


def run_tour(
    names: list[str] | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    console: Console | None = None,
) -> list[Section]:
    """Run the named stops (all for None) in tour order, printing each as it finishes.

    Args:
        names: stop names (see ``qkv tour --list``), or None for the whole tour.
        seed: seeds every random tensor and module, an int in ``[0, 2**31)``.
        dtype: the ``torch.dtype`` of the attention-function stops (default float32).
        console: where to print (None: print nothing).

    Returns:
        the filled sections, in order.

    Raises:
        ValueError: an unknown stop name (listing the known ones), a seed out of range.
        TourCheckError: a check failed (a ValueError naming every failed stop and check),
            raised after every selected stop has run and been printed.
    """
    if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
    stops = select(names)
    ctx = Context(seed=seed, dtype=torch.float32 if dtype is None else dtype)
    sections = []
    for stop in stops:
        section = run_stop(stop, ctx)
        if console is not None:
            print_section(console, section)
        sections.append(section)
    check_sections(sections)
    return sections


def command(
    seed: Annotated[
        int, typer.Option("--seed", min=0, max=SEED_LIMIT - 1, help="Seed of every random input.")
    ] = 0,
    dtype: Annotated[
        DTypeName, typer.Option("--dtype", help="Dtype of the attention stops and memory table.")
    ] = DTypeName.float32,
    stop: Annotated[
        list[str] | None,
        typer.Option("--stop", help="Run only this stop (repeatable); see --list."),
    ] = None,
    list_stops: Annotated[bool, typer.Option(
        "--list", metavar=FLAG, help="List the stops and exit.",
    )] = False,
    html: Annotated[
        Path | None,
        typer.Option("--html", help="Also write the tour as one self-contained HTML page."),
    ] = None,
) -> None:
    """Walk through attention and the transformer on live tensors, checking every step.

    Thirteen stops, from softmax(Q·Kᵀ/√D)·V to multi-head attention, masks, positions, the
    block, a token's journey, the encoder-decoder, additive attention, ViT patches and the
    O(T·S) memory. Each stop checks what it shows (rows sum to one, equals torch, equals the
    formula); a failed check fails the command.

    [bold]Example:[/bold] qkv tour --stop multi-head --html tour.html
    """
    console = Console()
    if list_stops:
        print_list(console, select(stop))
        return
    path = _html_path(html) if html is not None else None
    sections = run_tour(stop, seed=seed, dtype=dtype.to_torch(), console=console)
    checks = sum(len(s.checks) for s in sections)
    stops = f"{len(sections)} stop{'s' if len(sections) != 1 else ''}"
    console.print(f"[green]all {checks} checks of {stops} passed[/green]")
    if path is not None:
        from qkv.cli.tour.html import render_page
        from qkv.inspect.files import atomic_write

        page = render_page(sections, seed=seed, dtype=dtype.value)
        atomic_write(path, page)
        console.print(f"wrote {escape(str(path))} ({len(page) / 1024:.0f} KiB)")
