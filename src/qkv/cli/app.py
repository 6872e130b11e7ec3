"""The typer application behind the ``qkv`` command, and the list of its commands.

Adding a command
----------------
1. Write ``src/qkv/cli/<name>.py`` with ``NAME = "<name>"`` and a function ``command(...)``
   whose parameters are typer options and whose docstring is the help text: a summary line,
   then a paragraph ``[bold]Example:[/bold] qkv <name> ...`` (rich markup; escape a literal
   ``[`` as ``\\[``). Keep the computation in plain functions the command calls, so tests can
   check numbers without parsing output.
2. Import the module below and add it to :data:`COMMANDS`. Order is the order of ``--help``.
3. Add a test that ``qkv <name> --help`` shows the example and that the command runs.
"""

from __future__ import annotations

from types import ModuleType

import typer

from qkv.cli import (
    bench_cmd,
    chat_cmd,
    demo,
    embed_cmd,
    eval_cmd,
    explain_cmd,
    generate_cmd,
    inspect_cmd,
    tour,
    train_cmd,
    translate_cmd,
)

__all__ = ["COMMANDS", "app"]

# Every command module: ``NAME`` (the word typed after ``qkv``) and ``command`` (the function).
COMMANDS: tuple[ModuleType, ...] = (
    demo,
    tour,
    train_cmd,
    translate_cmd,
    eval_cmd,
    explain_cmd,
    inspect_cmd,
    generate_cmd,
    chat_cmd,
    embed_cmd,
    bench_cmd,
)

app = typer.Typer(
    name="qkv",
    help=(
        "qkv: attention and the transformer, end to end, exact, fast and visible.\n\n"
        "[bold]Example:[/bold] qkv tour"
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _module in COMMANDS:
    app.command(name=_module.NAME)(_module.command)
