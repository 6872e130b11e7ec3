"""Print a tour :class:`~qkv.cli.tour.page.Section` in the terminal with rich.

Formatting only: every number comes from the section. Checks print as ``✓ label = value <=
limit`` (green) or ``✗ ...`` (red); pictures are named with a pointer to ``--html``, where
they are drawn.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text as RichText

from qkv.cli.tour.page import PICTURES, Check, Grid, Pre, Section, Text

__all__ = ["print_list", "print_section"]


def _table(grid: Grid) -> Table:
    table = Table(title=escape(grid.title) or None, header_style="bold")
    for j, header in enumerate(grid.headers):
        table.add_column(escape(header), justify="left" if j == 0 else "right")
    for row in grid.rows:
        table.add_row(*(escape(cell) for cell in row))
    return table


def print_section(console: Console, section: Section) -> None:
    """Print one stop: a rule with its number and title, then its items in order."""
    title = f"{section.number}. {escape(section.title)}"
    console.rule(f"[bold]{title}[/bold]  [dim]({escape(section.name)})[/dim]")
    for item in section.items:
        if isinstance(item, Text | Pre):
            console.print(item.text, markup=False, highlight=False)
        elif isinstance(item, Grid):
            console.print(_table(item))
        elif isinstance(item, Check):
            mark, style = ("✓", "green") if item.passed else ("✗", "bold red")
            console.print(RichText.assemble((mark, style), " ", (str(item), style)),
                          highlight=False)  # fmt: skip
        elif isinstance(item, PICTURES):
            console.print(f"[dim]picture: {escape(item.title)} (drawn by qkv tour --html)[/dim]")


def print_list(console: Console, stops) -> None:
    """The stops in order: number, name (what ``--stop`` takes) and title."""
    table = Table("#", "stop", "what it shows", header_style="bold", title="qkv tour stops")
    for i, stop in enumerate(stops, 1):
        table.add_row(str(i), stop.name, escape(stop.title))
    console.print(table)
