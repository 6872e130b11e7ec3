"""The typer application behind the ``qkv`` command, and the list of its commands.

Adding a command
----------------
1. Write ``src/qkv/cli/<name>.py`` with ``NAME = "<name>"`` and a function ``command(...)``
   whose parameters are typer options and whose docstring is the help text: a summary line,
   then a paragraph ``[bold]Example:[/bold] qkv <name> ...`` (rich markup; escape a literal
   ``[`` as ``\\[``). Keep the computation in plain functions the command calls, so tests can
   check numbers without parsing output.
2. Import the module below and add it to :data:`COMMANDS`. Order is the order of ``--help``.
3. Add a test that ``qkv <name> --help`` shows the example and that the command runs, and
   add its hostile arguments to ``tests/cli/test_hostile_cli.py``.

Failures are handled here, once for every command: each command runs under
:func:`qkv.cli.common.guard` (shared option checks, expected errors as one line ``error: ...``,
exit status 2), and :class:`QkvGroup` prints click's usage errors (an unknown option, a
value out of range, a missing argument) as one line too, instead of a framed box.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

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
    transcribe_cmd,
    translate_cmd,
)
from qkv.cli.common import fail, guard

__all__ = ["COMMANDS", "QkvGroup", "app"]

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
    transcribe_cmd,
    bench_cmd,
)



class QkvGroup(TyperGroup):
    """typer's command group, with click's usage errors printed as one line.

    ``Invalid value for '--top-k': -1 is not in the range x>=1.`` or ``No such option:
    --bogus`` becomes ``error: <that> (see: qkv generate --help)`` on stderr, exit status 2
    (click's status for usage errors). ``qkv`` alone still prints the help.
    """

    def main(self, args: Any = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:  # fmt: skip
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except typer.TyperException as err:  # click's errors (typer vendors click)
            if type(err).__name__ == "NoArgsIsHelpError":  # `qkv` alone: the help, as typer
                from typer import rich_utils

                rich_utils.rich_format_error(err)
                sys.exit(err.exit_code)
            ctx = getattr(err, "ctx", None)
            hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            fail(err.format_message() + hint)
            sys.exit(err.exit_code)
        except typer.Abort:
            fail("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="qkv",
    cls=QkvGroup,
    no_args_is_help=True,
    rich_markup_mode="rich",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"qkv {version('qkv')}")
        except PackageNotFoundError:  # run from a source tree that is not installed
            print("qkv (not installed: no version metadata)")
        raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print qkv's version and exit.",
    )] = False,
) -> None:
    """qkv: attention and the transformer, end to end, exact, fast and visible.

    [bold]Example:[/bold] qkv tour
    """


for _module in COMMANDS:
    app.command(name=_module.NAME)(guard(_module.command))
