"""``qkv translate``: translate text with a trained encoder-decoder checkpoint, or with a
pretrained one (``--model PATH``: a Hugging Face BART, T5 or Marian/Opus-MT folder, through
:func:`qkv.pretrained.load`); one output per line. The command's options travel as one
:class:`TranslateOptions`, checked once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from qkv.cli.common import (
    FLAG,
    TRANSLATION_NEW_TOKENS,
    BeamAlias,
    BeamSize,
    ModelDevice,
    beam_of,
    blank_output_hint,
    warn,
)
from qkv.cli.inputs import read_items
from qkv.cli.outputs import print_jsonl
from qkv.train.runs import load_run, seq2seq_parts

__all__ = ["TranslateOptions", "command", "input_warnings", "translate_pretrained",
           "translate_texts"]

NAME = "translate"
SHOWN_UNKNOWN = 8  # unknown characters named in a warning, at most

Inputs = Annotated[list[str] | None, typer.Argument(
    metavar="[CHECKPOINT] TEXTS...",
    help="A checkpoint folder, or a run folder (its best/ checkpoint is used), then the "
         "texts to translate; with --model, only the texts.",
    show_default=False,
)]
Model = Annotated[str | None, typer.Option(
    "--model", "-m", help="A pretrained encoder-decoder instead of a checkpoint: a Hugging "
    "Face folder (BART, T5, Marian/Opus-MT).", show_default=False,
)]
Compile = Annotated[bool, typer.Option(
    "--compile", metavar=FLAG, help="A static KV cache and torch.compile for the decoding "
    "steps (the first run compiles; needs a C++ compiler, else eager; not with "
    "--beam-size).",
)]
MaxNewTokens = Annotated[int | None, typer.Option(
    "--max-new-tokens", "-n", min=1, show_default=False,
    help=f"Most tokens of each translation \\[default: {TRANSLATION_NEW_TOKENS}, within "
    "the model's max_len].",
)]
InputFile = Annotated[Path | None, typer.Option(
    "--input", "-i", help="A UTF-8 file of texts to translate, one per line ('-': "
    "standard input).", show_default=False,
)]
AsJson = Annotated[bool, typer.Option(
    "--json", metavar=FLAG, help="Print one JSON object per text ({\"source\", "
    "\"translation\"}), one per line.",
)]


def _check(texts: list[str], beam: int | None, compile: bool = False,
           typed: str = "--beam-size") -> None:  # fmt: skip
    if compile and beam is not None:
        raise ValueError(f"--compile (a static KV cache) does not serve {typed} {beam}; "
                         "drop one")  # fmt: skip
    if not texts:
        raise ValueError("no texts to translate; give at least one")
    if beam is not None and beam < 1:
        raise ValueError(f"--beam-size must be >= 1, got {beam}")


def _which(texts: list[str], i: int) -> str:
    """``"the text"`` for one text, ``"text 3"`` (1-based) among several."""
    return "the text" if len(texts) == 1 else f"text {i + 1}"


def input_warnings(texts: list[str], tokenizer: Any = None) -> list[str]:
    """One warning per text that is empty (or only whitespace), or, given the model's source
    ``tokenizer`` (a qkv tokenizer: unknown pieces encode to ``UNK_ID``), holds characters it
    never saw in training.

    An empty text is not translated: its output is an empty line (a model asked to translate
    nothing makes something up, such as ``1900-00000``). Unknown characters are translated
    as ``<unk>``, so the output may be wrong; the warning names them.
    """
    from qkv.data.tokenizer_base import UNK_ID

    out = []
    for i, text in enumerate(texts):
        if not text.strip():
            out.append(f"{_which(texts, i)} is empty: its translation is an empty line")
            continue
        if tokenizer is None:
            continue
        unknown = sorted({c for c in text if not c.isspace() and UNK_ID in tokenizer.encode(c)})
        if unknown:
            shown = " ".join(repr(c) for c in unknown[:SHOWN_UNKNOWN])
            rest = len(unknown) - SHOWN_UNKNOWN
            more = f" and {rest} more" if rest > 0 else ""
            out.append(f"{_which(texts, i)} has {len(unknown)} character"
                       f"{'s' * (len(unknown) != 1)} the model never saw in training ({shown}"
                       f"{more}): read as <unk>, the translation may be wrong")  # fmt: skip
    return out


def _nonempty(texts: list[str], translate: Callable[[list[str]], list[str]]) -> list[str]:
    """``translate`` of the texts that are not blank; a blank text's output is ``""``."""
    keep = [i for i, t in enumerate(texts) if t.strip()]
    done = translate([texts[i] for i in keep]) if keep else []
    out = [""] * len(texts)
    for i, text in zip(keep, done, strict=True):
        out[i] = text
    return out


def translate_texts(checkpoint: str | Path, texts: list[str], *, beam: int | None = None,
                    max_new_tokens: int | None = None, compile: bool = False,
                    on_warning: Callable[[str], None] | None = None,
                    device: str | None = None) -> list[str]:  # fmt: skip
    """Translate ``texts`` with the encoder-decoder checkpoint at ``checkpoint``; an empty (or
    blank) text gives ``""`` without running the model.

    Args:
        on_warning: called with each of :func:`input_warnings`' lines (empty texts, characters
            the source tokenizer never saw).
        device: None (the CPU) or where the model runs (``"cuda"``, ...).

    Raises:
        FileNotFoundError: no checkpoint; ValueError: a corrupt one, a decoder-only model,
            no texts, a bad beam size.
    """
    from qkv.generate import translate

    _check(texts, beam, compile)
    ckpt, folder, _ = load_run(checkpoint, device)
    model, src_tok, tgt_tok = seq2seq_parts(ckpt, folder, "translate")
    for line in input_warnings(texts, src_tok):
        if on_warning is not None:
            on_warning(line)
    return _nonempty(texts, lambda batch: translate(
        model, batch, src_tok, tgt_tok, beam_size=beam, max_new_tokens=max_new_tokens,
        compile=compile))  # fmt: skip


def translate_pretrained(model: str | Path, texts: list[str], *, beam: int | None = None,
                         max_new_tokens: int | None = None, compile: bool = False,
                         on_warning: Callable[[str], None] | None = None,
                         device: str | None = None) -> list[str]:  # fmt: skip
    """Translate ``texts`` with a pretrained encoder-decoder (``qkv.pretrained.load(model)``);
    an empty (or blank) text gives ``""`` without running the model.

    Args:
        on_warning: called with a line for each empty text (:func:`input_warnings`; a
            pretrained tokenizer's unknown characters are not checked).
        device: None (the CPU) or where the model runs (``"cuda"``, ...).

    Raises:
        ValueError: no texts, a bad beam size, a model that is not an encoder-decoder, a
            folder without a tokenizer; the errors of :func:`qkv.pretrained.load`.
    """
    from qkv.pretrained import load
    from qkv.pretrained.seq2seq_bundle import Seq2SeqBundle

    _check(texts, beam, compile)
    bundle = load(model, device=device)
    if not isinstance(bundle, Seq2SeqBundle):
        raise ValueError(f"--model {str(model)!r} is a {type(bundle.model).__name__}, not an "
                         "encoder-decoder; qkv translate needs BART, T5 or Marian")  # fmt: skip
    if bundle.tokenizer is None:
        raise ValueError(f"--model {str(model)!r} has no tokenizer files (tokenizer.json, or "
                         "Marian's source.spm/target.spm/vocab.json), so texts cannot be encoded")
    for line in input_warnings(texts):
        if on_warning is not None:
            on_warning(line)
    return _nonempty(texts, lambda batch: bundle.translate(
        batch, beam_size=beam, max_new_tokens=max_new_tokens, compile=compile))  # fmt: skip


@dataclass(frozen=True)
class TranslateOptions:
    """What ``qkv translate`` translates, with what and how; checked once, when built (the
    options as typed, before anything loads).

    Raises:
        ValueError: no texts, ``--compile`` with a beam size, a beam size < 1.
    """

    texts: tuple[str, ...]  # TEXTS and --input's, in order
    checkpoint: str | None = None  # a checkpoint or run folder; None: --model
    model: str | None = None  # a pretrained encoder-decoder; None: checkpoint
    beam: int | None = None  # --beam-size or --beam; None: greedy
    typed: str = "--beam-size"  # how the beam size was typed, for messages
    compile: bool = False
    max_new_tokens: int | None = None  # None: the library's default, from the source
    as_json: bool = False
    device: str | None = None  # None: the CPU

    def __post_init__(self) -> None:
        _check(list(self.texts), self.beam, self.compile, self.typed)


def command(
    inputs: Inputs = None,
    model: Model = None,
    beam_size: BeamSize = None,
    beam: BeamAlias = None,
    compile: Compile = False,
    max_new_tokens: MaxNewTokens = None,
    input_file: InputFile = None,
    as_json: AsJson = False,
    device: ModelDevice = None,
) -> None:
    """Translate texts with a trained encoder-decoder checkpoint, or a pretrained one with
    --model; one output per line.

    An empty text gives an empty line (with a warning on stderr), so outputs stay in step
    with inputs; characters a checkpoint's tokenizer never saw in training are named in a
    warning; a blank translation gets a hint.

    [bold]Example:[/bold] qkv translate runs/demo "tuesday 3rd of march 2015" "7/4/76"

    [bold]Example:[/bold] qkv translate --model ~/models/opus-mt-en-de "Hello, world."

    [bold]Example:[/bold] qkv translate runs/demo --input dates.txt --json ('-' in the texts or
    as the file reads standard input, one text per line)
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    beams, typed = beam_of(beam_size, beam)
    checkpoint, items = _split_inputs(list(inputs or []), model)
    texts = read_items(items, input_file, what="text to translate")
    options = TranslateOptions(texts=tuple(texts), checkpoint=checkpoint, model=model,
                               beam=beams, typed=typed, compile=compile,
                               max_new_tokens=max_new_tokens, as_json=as_json,
                               device=device)  # fmt: skip
    print_translations(options, translations(options))


def _split_inputs(items: list[str], model: str | None) -> tuple[str | None, list[str]]:
    """``(checkpoint, texts)`` of the positional arguments: without --model, the first is
    the checkpoint.

    Raises:
        ValueError: neither a checkpoint nor --model.
    """
    if model is not None:
        return None, items
    if not items:
        raise ValueError("give a CHECKPOINT folder and the TEXTS to translate, or --model "
                         "PATH and the texts")  # fmt: skip
    return items[0], items[1:]


def translations(options: TranslateOptions) -> list[str]:
    """The translations of ``options.texts`` (one per text, ``""`` for a blank one), each
    input warning printed on stderr."""
    o = options
    given = {"beam": o.beam, "max_new_tokens": o.max_new_tokens, "compile": o.compile,
             "on_warning": warn, "device": o.device}  # fmt: skip
    if o.model is not None:
        return translate_pretrained(o.model, list(o.texts), **given)
    assert o.checkpoint is not None
    return translate_texts(o.checkpoint, list(o.texts), **given)


def print_translations(options: TranslateOptions, outputs: list[str]) -> None:
    """stdout: one line (or JSON object) per text; stderr: a hint if a translation is blank."""
    texts = options.texts
    if options.as_json:
        print_jsonl({"source": t, "translation": o} for t, o in zip(texts, outputs, strict=True))
    else:
        console = Console(highlight=False, soft_wrap=True)
        for line in outputs:
            console.print(line, markup=False)
    empty = {i for i, t in enumerate(texts) if not t.strip()}
    hint = blank_output_hint(outputs, skip=empty, trained_here=options.model is None)
    if hint is not None:
        warn(hint, prefix="")
