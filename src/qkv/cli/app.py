"""The typer application behind the ``qkv`` command, and the list of its commands.

Adding a command
----------------
1. Write ``src/qkv/cli/<name>.py`` with ``NAME = "<name>"`` and a function ``command(...)``
   whose parameters are typer options and whose docstring is the help text: a summary line,
   then a paragraph ``[bold]Example:[/bold] qkv <name> ...`` (rich markup; escape a literal
   ``[`` as ``\\[``). Keep the computation in plain functions the command calls, so tests can
   check numbers without parsing output.
2. Add its name, module and summary (its help's first paragraph) to :data:`COMMAND_TABLE`;
   order is the order of ``--help``. Commands load lazily: ``qkv --help`` imports none of
   them, ``qkv NAME`` only its own module.
3. Add a test that ``qkv <name> --help`` shows the example and that the command runs, and
   add its hostile arguments to ``tests/cli/test_hostile_cli.py``.

Failures are handled here, once for every command: each command runs under
:func:`qkv.cli.common.guard` (shared option checks, expected errors as one line ``error: ...``,
exit status 2), and :class:`QkvGroup` prints click's usage errors (an unknown option, a
value out of range, a missing argument) as one line too, instead of a framed box.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from types import ModuleType
from typing import Annotated, Any

import click
import typer
from typer.core import TyperCommand, TyperGroup

from qkv.cli.common import FLAG, fail, guard, usage_hint

__all__ = ["COMMANDS", "COMMAND_TABLE", "QkvGroup", "app", "load_command"]

# Every command: the word typed after ``qkv``, its module (``NAME`` and ``command``), and the
# first paragraph of its help, which ``qkv --help`` lists without importing the module (the
# modules import torch's training, distributed and compiler stacks: seconds; a test checks
# these lines against the docstrings). Order is the order of ``--help``.
COMMAND_TABLE: tuple[tuple[str, str, str], ...] = (
    ("demo", "qkv.cli.demo", "Train a transformer from scratch to normalise dates, use it, "
     "and draw its attention."),
    ("tour", "qkv.cli.tour", "Walk through attention and the transformer on live tensors, "
     "checking every step."),
    ("train", "qkv.cli.train_cmd", "Train a transformer from scratch (a synthetic task, a "
     "file of pairs, any text), or fine-tune a pretrained one (--from)."),
    ("translate", "qkv.cli.translate_cmd", "Translate texts with a trained encoder-decoder "
     "checkpoint, or a pretrained one with --model; one output per line."),
    ("eval", "qkv.cli.eval_cmd", "Evaluate a checkpoint: exact match, BLEU, chrF (or loss and "
     "perplexity for text)."),
    ("explain", "qkv.cli.explain_cmd", "Say which attention backend runs for a call of this "
     "shape, and why not the others."),
    ("inspect", "qkv.cli.inspect_cmd", "Draw a model's attention for one text: PNGs, the last "
     "token's journey, the viewer."),
    ("generate", "qkv.cli.generate_cmd", "Generate text from a checkpoint `qkv train` wrote, or "
     "from a pretrained model."),
    ("chat", "qkv.cli.chat_cmd", "Chat with a language model; replies stream as they are "
     "generated."),
    ("serve", "qkv.cli.serve_cmd", "Serve a language model over HTTP with OpenAI's API "
     "(completions and chat), requests batched together."),
    ("embed", "qkv.cli.embed_cmd", "Embed texts with a sentence encoder and print their "
     "cosine-similarity table."),
    ("transcribe", "qkv.cli.transcribe_cmd", "Transcribe speech to text, offline, with Whisper "
     "on qkv's attention."),
    ("bench", "qkv.cli.bench_cmd", "Time attention (qkv flash, auto, math and torch's kernel) "
     "side by side on this machine."),
)
_MODULES = {name: module for name, module, _ in COMMAND_TABLE}
COMMANDS: tuple[ModuleType, ...]  # every command module: imported by __getattr__ on first use
_SUMMARIES = {name: summary for name, _, summary in COMMAND_TABLE}


def __getattr__(name: str) -> Any:
    """``COMMANDS``: every command module, imported on first use (tests walk them)."""
    if name == "COMMANDS":
        return tuple(importlib.import_module(m) for m in _MODULES.values())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def summary(module: ModuleType) -> str:
    """The first paragraph of a command's help, on one line (what :data:`COMMAND_TABLE`
    holds)."""
    return " ".join(inspect.cleandoc(module.command.__doc__ or "").split("\n\n")[0].split())


@functools.cache
def load_command(name: str) -> click.Command:
    """The click command ``name``, its module imported now (``qkv NAME ...`` imports only
    that one command's module)."""
    module = importlib.import_module(_MODULES[name])
    one = typer.Typer(rich_markup_mode="rich", add_completion=False,
                      pretty_exceptions_enable=False,
                      context_settings={"help_option_names": ["-h", "--help"]})
    one.command(name=module.NAME, cls=QkvCommand)(guard(module.command))
    return typer.main.get_command(one)


def _flag_help(option: click.Option | None) -> click.Option | None:
    """``--help`` shown as the flag it is (typer would print a ``<bool>`` type beside it)."""
    if option is not None:
        option.metavar = FLAG
    return option


class QkvCommand(TyperCommand):
    """A command whose ``--help`` shows no type (it is a flag)."""

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        return _flag_help(super().get_help_option(ctx))


class QkvGroup(TyperGroup):
    """typer's command group, with click's usage errors printed as one line.

    ``Invalid value for '--top-k': -1 is not in the range x>=1.`` or ``No such option:
    --bogus`` becomes ``error: <that> (see: qkv generate --help)`` on stderr, exit status 2
    (click's status for usage errors). ``qkv`` alone still prints the help.
    """

    listing = False  # while the group's own help is formatted: no command module imported

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        return _flag_help(super().get_help_option(ctx))

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(_MODULES)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _MODULES:
            return None
        if self.listing:  # `qkv --help` lists each command's summary line, nothing more
            return click.Command(cmd_name, help=_SUMMARIES[cmd_name])
        return load_command(cmd_name)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.listing = False

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
            words = list(sys.argv[1:] if args is None else args)
            fail(err.format_message() + usage_hint(err, words) + hint)
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
        "--version", callback=_version, is_eager=True, metavar=FLAG,
        help="Print qkv's version and exit.",
    )] = False,
) -> None:
    """qkv: attention and the transformer, end to end, exact, fast and visible.

    [bold]Example:[/bold] qkv tour
    """

