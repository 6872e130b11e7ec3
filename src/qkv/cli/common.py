"""What the ``qkv`` commands share, defined once: failures, shared checks, option types, formatting.

Every command module imports its shared helpers from here and from the library, never from
another command module.

* :func:`guard`: wraps every command (:mod:`qkv.cli.app` applies it), so that an expected
  failure, from qkv or from the user's input (:func:`expected_errors`), is one line
  ``error: <message>`` on stderr and exit status 2, never a traceback. Before the command
  runs it checks the options several commands share, by parameter name (:data:`SHARED_CHECKS`):
  ``device`` (:func:`check_device`) and ``out`` (:func:`check_out_folder`).
* :func:`fail`: that one line, for a command to raise itself.
* :func:`status`: a spinner whose text may echo user input (rich markup escaped).
* :class:`DTypeName`: the ``--dtype`` choices.
* ``Temperature``, ``TopK``, ``TopP``, ``Seed``: the decoding options of ``qkv generate`` and
  ``qkv chat``; ``BeamSize`` and its hidden alias ``BeamAlias`` (``--beam``), merged by
  :func:`beam_of`, on every command that decodes (``eval``, ``generate``, ``translate``,
  ``transcribe``).
* ``FLAG``: the metavar of every yes/no option (``metavar=FLAG``): no ``<bool>`` type column
  in ``--help``; a yes/no option is a plain flag (``--json``) or a pair (``--causal/--no-causal``).
* The default output lengths, one per kind of task (``--max-new-tokens``):
  :data:`LM_NEW_TOKENS`, :data:`TRANSLATION_NEW_TOKENS`, :data:`SPEECH_NEW_TOKENS`.
* :func:`warn`: one line ``warning: ...`` (or a hint) on stderr; :func:`blank_output_hint`.
* :func:`human_bytes`, :func:`metrics_line`: how sizes and metrics are printed.

Every message that echoes user input (a model name, a path, a prompt) is printed with its
rich markup escaped (or with ``markup=False``), so ``no[/such]model`` prints as typed.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable, Collection, Sequence
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.errors import MarkupError
from rich.markup import escape

__all__ = [
    "FLAG",
    "LM_NEW_TOKENS",
    "SHARED_CHECKS",
    "SPEECH_NEW_TOKENS",
    "TRANSLATION_NEW_TOKENS",
    "BeamAlias",
    "BeamSize",
    "DTypeName",
    "Seed",
    "Temperature",
    "TopK",
    "TopP",
    "beam_of",
    "blank_output_hint",
    "check_device",
    "check_out_folder",
    "expected_errors",
    "fail",
    "guard",
    "human_bytes",
    "metrics_line",
    "status",
    "usage_hint",
    "warn",
]

# The metavar of a yes/no option: typer would show "<bool>" in --help, which reads as if the
# option took a value (``--causal true``); a flag takes none.
FLAG = ""

# The default of --max-new-tokens, one per kind of task (docs/cli.md, "Output lengths"):
# language-model generation (generate, chat): at most this many new tokens, fewer when the
# prompt leaves less room within the model's max_len; EOS stops earlier.
LM_NEW_TOKENS = 256
# translation (translate, generate with an encoder-decoder, eval, demo): relative to the
# source, 2 x its tokens + 10 (the longest source of a batch), within the model's max_len;
# the library's own default (qkv.generate.translate, Seq2SeqBundle.translate).
TRANSLATION_NEW_TOKENS = "2 x the source's tokens + 10"
# speech (transcribe): Whisper's 224 tokens per 30 s window (half its 448 positions).
SPEECH_NEW_TOKENS = 224


def fail(err: BaseException | str | object) -> typer.Exit:
    """Print ``error: <message>`` as one line on stderr; return the exit (status 2) to raise.

    Whitespace in the message (a newline from a library error) is collapsed to single spaces,
    so the failure is always one line; an empty message prints the exception's type. The
    message is printed as text: rich markup in it (``[/such]``) is shown, not interpreted.
    """
    _stderr_line("[red]error:[/red] ", " ".join(str(err).split()) or type(err).__name__)
    return typer.Exit(2)


def warn(message: str, *, prefix: str = "warning: ") -> None:
    """Print ``<prefix><message>`` as one line on stderr (the message printed as text)."""
    _stderr_line(f"[yellow]{escape(prefix)}[/yellow]" if prefix else "", message)


def _stderr_line(label: str, message: str) -> None:
    """``label`` (rich markup) then ``message`` as text, whitespace collapsed: one line."""
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        label + escape(" ".join(message.split())), markup=True
    )


def blank_output_hint(texts: Sequence[str], *, skip: Collection[int] = (),
                      sampling: bool = False, trained_here: bool = True) -> str | None:
    """The one-line hint for generated or translated ``texts`` that are empty or only
    whitespace (greedy decoding of an undertrained model often gives spaces), or None.

    Args:
        texts: the outputs.
        skip: indices left out (an empty input gives an empty output on purpose).
        sampling: the outputs were sampled (the hint then does not suggest sampling).
        trained_here: a checkpoint ``qkv train`` wrote (the hint suggests more --steps), or
            False for a pretrained model.
    """
    blank = [i for i, t in enumerate(texts) if i not in skip and not t.strip()]
    if not blank:
        return None
    which = ("the output is" if len(texts) == 1
             else f"{len(blank)} of {len(texts)} outputs are")  # fmt: skip
    if trained_here:
        tries = "more --steps" + ("" if sampling else " or sampling (--temperature 0.8)")
        return f"({which} blank: the model may be undertrained; try {tries})"
    tries = "another --seed" if sampling else "sampling (--temperature 0.8)"
    return f"({which} blank; try another prompt or {tries})"


# Words a user may type after a flag as if it took a value (``--causal true``).
_FLAG_VALUES = frozenset({"true", "false", "yes", "no", "on", "off", "1", "0"})


def usage_hint(err: BaseException, args: Sequence[str]) -> str:
    """What to add to click's usage error ``err`` for the command line ``args``, or "".

    ``qkv explain --causal true``: click says ``Got unexpected extra argument (true)``; the
    hint says ``--causal is a flag and takes no value: write --causal or --no-causal``.
    (For :class:`qkv.cli.app.QkvGroup`, which prints click's errors as one line.)
    """
    ctx = getattr(err, "ctx", None)
    command = getattr(ctx, "command", None)
    message = err.format_message() if hasattr(err, "format_message") else str(err)
    if command is None or "unexpected extra argument" not in message:
        return ""
    args = [str(a) for a in args]
    for before, word in itertools.pairwise(args):
        if word.lower() not in _FLAG_VALUES:
            continue
        for param in command.params:
            names = [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]
            if getattr(param, "is_flag", False) and before in names:
                longs = [n for n in names if n.startswith("--")] or names
                return f"; {before} is a flag and takes no value: write {' or '.join(longs)}"
    return ""


def status(console: Console, text: str):
    """``console.status(text)`` with ``text`` shown as typed (rich markup escaped)."""
    return console.status(escape(text))


def expected_errors() -> tuple[type[BaseException], ...]:
    """The exception classes that are expected failures of a command, not bugs.

    ``ValueError`` (qkv's argument, file and checkpoint errors are all ValueErrors),
    ``TypeError``, ``OSError`` (a missing or unwritable file), ``ImportError`` (a missing
    optional dependency, whose message says what to install), qkv's ``MissingData`` (a corpus
    not on this machine), and, once their libraries are loaded, ``SafetensorError`` (a
    truncated or corrupt weights file) and ``torch.OutOfMemoryError``; rich's
    ``MarkupError`` too, as a safety net for user text printed as markup by mistake.
    """
    from qkv.data.text import MissingData

    errors: list[type[BaseException]] = [ValueError, TypeError, OSError, ImportError, MissingData]
    safetensors = sys.modules.get("safetensors")
    if safetensors is not None and hasattr(safetensors, "SafetensorError"):
        errors.append(safetensors.SafetensorError)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "OutOfMemoryError"):
        errors.append(torch.OutOfMemoryError)
    # A safety net: user text printed as rich markup by mistake ("[/x]" in a path) is a
    # bug of the print, but the user still gets one line, not a traceback.
    errors.append(MarkupError)
    return tuple(errors)


def check_device(value: str, option: str = "--device") -> str:
    """``value`` when it names a device torch can use on this machine
    (:func:`qkv.checks.check_device`, the option named in its errors).

    Raises:
        ValueError: ``"--device 'banana' is not a device ..."`` or ``"--device 'cuda' is not
            available: ..."``.
    """
    from qkv.checks import check_device as checked

    checked(value, option)
    return value


def check_out_folder(path: str | Path, option: str = "--out") -> Path:
    """``path`` as a folder that exists or can be created: neither it nor a folder above
    it is a file.

    Raises:
        ValueError: ``"--out x/y is a file, not a folder"``, ``"--out x/y cannot be
            created: x is a file, not a folder"``, or an empty path or ``.`` (the current
            folder: typer turns ``''`` into ``.``).
    """
    if not str(path).strip() or Path(path) == Path("."):
        raise ValueError(f"{option} {str(path)!r} is the current folder; name a folder for the "
                         "files (the working folder is never written into)")
    folder = Path(path).expanduser()
    for above in (folder, *folder.parents):
        if above.is_dir():
            break
        if above.exists():
            if above == folder:
                raise ValueError(f"{option} {path} is a file, not a folder")
            raise ValueError(f"{option} {path} cannot be created: {above} is a file, not a "
                             "folder")  # fmt: skip
    return folder


# Options several commands share, checked once by guard before the command runs:
# parameter name -> check(value) (raising ValueError that names the option).
SHARED_CHECKS: dict[str, Callable[[Any], Any]] = {
    "device": check_device,
    "out": check_out_folder,
}


def guard(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` with the shared checks first and expected failures turned into one line.

    The wrapper keeps ``command``'s signature and docstring (typer reads both). Options named
    in :data:`SHARED_CHECKS` are checked when given; an exception of
    :func:`expected_errors` becomes :func:`fail`'s one line and exit status 2; anything else
    (a bug) propagates with its traceback.
    """

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            for name, check in SHARED_CHECKS.items():
                if kwargs.get(name) is not None:
                    check(kwargs[name])
            return command(*args, **kwargs)
        except typer.Exit:
            raise
        except Exception as err:
            if isinstance(err, expected_errors()):
                raise fail(err) from None
            raise

    return run


class DTypeName(str, Enum):
    """Floating dtypes a command accepts as ``--dtype``; shared by every command."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float64 = "float64"

    def to_torch(self):
        """The matching ``torch.dtype`` (torch imported here, not at package import)."""
        import torch

        return getattr(torch, self.value)


BeamSize = Annotated[int | None, typer.Option(
    "--beam-size", min=1, show_default=False,
    help="Beam search with this many beams \\[default: greedy decoding].",
)]
# The old name, still accepted (hidden from --help): qkv eval/generate/translate had --beam.
BeamAlias = Annotated[int | None, typer.Option(
    "--beam", min=1, hidden=True, show_default=False, help="The old name of --beam-size.",
)]


def beam_of(beam_size: int | None, beam: int | None) -> tuple[int | None, str]:
    """``(beams, option)``: ``--beam-size``, or its old name ``--beam`` when only that is
    given, and the option as typed, for messages (``--beam 2``).

    Raises:
        ValueError: both given, with different values.
    """
    if beam is not None and beam_size is not None and beam != beam_size:
        raise ValueError(f"--beam is the old name of --beam-size; got --beam-size {beam_size} "
                         f"and --beam {beam}: give one")  # fmt: skip
    if beam_size is None and beam is not None:
        return beam, "--beam"
    return beam_size, "--beam-size"


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
ModelDevice = Annotated[str | None, typer.Option(
    "--device", help="Where the model runs: cpu (the default), cuda, cuda:N, mps.",
    show_default=False,
)]
RepetitionPenalty = Annotated[float | None, typer.Option(
    "--repetition-penalty", min=0.0, show_default=False,
    help="Divide (or multiply, if negative) the logits of tokens already in the text by this "
    "(transformers' repetition_penalty; 1.2 is common).",
)]
NoRepeatNgram = Annotated[int | None, typer.Option(
    "--no-repeat-ngram-size", min=1, show_default=False,
    help="Never repeat an n-gram of this size.",
)]
MinP = Annotated[float | None, typer.Option(
    "--min-p", min=0.0, max=1.0, show_default=False,
    help="Sample only tokens at least this fraction as probable as the likeliest.",
)]
Stop = Annotated[list[str] | None, typer.Option(
    "--stop", show_default=False,
    help="End the text before this string (matched on the text; repeat for several).",
)]


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``1 MiB``, ``4 GiB``, ``512 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def metrics_line(metrics: dict[str, float]) -> str:
    """``exact match 99.2%  BLEU 98.1  chrF 99.0`` or ``loss 1.234  perplexity 3.43``: the
    metrics in words (:func:`qkv.train.metrics.describe_metrics`), never metric keys."""
    from qkv.train.metrics import describe_metrics

    return describe_metrics(metrics)
