"""``qkv translate``: translate text with a trained encoder-decoder checkpoint, or with a
pretrained one (``--model PATH``: a Hugging Face BART, T5 or Marian/Opus-MT folder, through
:func:`qkv.pretrained.load`); one output per line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from qkv.cli.inputs import read_items
from qkv.cli.outputs import print_jsonl
from qkv.train.runs import load_run, seq2seq_parts

__all__ = ["command", "translate_pretrained", "translate_texts"]

NAME = "translate"


def _check(texts: list[str], beam: int | None, compile: bool = False) -> None:
    if compile and beam is not None:
        raise ValueError(f"--compile (a static KV cache) does not serve --beam {beam}; drop one")
    if not texts:
        raise ValueError("no texts to translate; give at least one")
    if beam is not None and beam < 1:
        raise ValueError(f"--beam must be >= 1, got {beam}")


def translate_texts(checkpoint: str | Path, texts: list[str], *, beam: int | None = None,
                    max_new_tokens: int | None = None,
                    compile: bool = False) -> list[str]:  # fmt: skip
    """Translate ``texts`` with the encoder-decoder checkpoint at ``checkpoint``.

    Raises:
        FileNotFoundError: no checkpoint; ValueError: a corrupt one, a decoder-only model,
            no texts, a bad beam size.
    """
    from qkv.generate import translate

    _check(texts, beam, compile)
    ckpt, folder, _ = load_run(checkpoint)
    model, src_tok, tgt_tok = seq2seq_parts(ckpt, folder, "translate")
    return translate(model, texts, src_tok, tgt_tok, beam_size=beam,
                     max_new_tokens=max_new_tokens, compile=compile)  # fmt: skip


def translate_pretrained(model: str | Path, texts: list[str], *, beam: int | None = None,
                         max_new_tokens: int | None = None,
                         compile: bool = False) -> list[str]:  # fmt: skip
    """Translate ``texts`` with a pretrained encoder-decoder (``qkv.pretrained.load(model)``).

    Raises:
        ValueError: no texts, a bad beam size, a model that is not an encoder-decoder, a
            folder without a tokenizer; the errors of :func:`qkv.pretrained.load`.
    """
    from qkv.pretrained import load
    from qkv.pretrained.seq2seq_bundle import Seq2SeqBundle

    _check(texts, beam, compile)
    bundle = load(model)
    if not isinstance(bundle, Seq2SeqBundle):
        raise ValueError(f"--model {str(model)!r} is a {type(bundle.model).__name__}, not an "
                         "encoder-decoder; qkv translate needs BART, T5 or Marian")  # fmt: skip
    if bundle.tokenizer is None:
        raise ValueError(f"--model {str(model)!r} has no tokenizer files (tokenizer.json, or "
                         "Marian's source.spm/target.spm/vocab.json), so texts cannot be encoded")
    return bundle.translate(texts, beam_size=beam, max_new_tokens=max_new_tokens,
                            compile=compile)


def command(
    inputs: Annotated[list[str] | None, typer.Argument(
        metavar="[CHECKPOINT] TEXTS...",
        help="A checkpoint folder, or a run folder (its best/ checkpoint is used), then the "
             "texts to translate; with --model, only the texts.",
        show_default=False,
    )] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A pretrained encoder-decoder instead of a checkpoint: a Hugging "
        "Face folder (BART, T5, Marian/Opus-MT).", show_default=False,
    )] = None,
    beam: Annotated[int | None, typer.Option(
        "--beam", help="Beam search with this many beams (default: greedy decoding).",
    )] = None,
    compile: Annotated[bool, typer.Option(
        "--compile", help="A static KV cache and torch.compile for the decoding steps (the "
        "first run compiles; needs a C++ compiler, else eager; not with --beam).",
    )] = False,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", min=1, help="Longest output (default: 2 × input + 10).",
    )] = None,
    input_file: Annotated[Path | None, typer.Option(
        "--input", "-i", help="A UTF-8 file of texts to translate, one per line ('-': "
        "standard input).", show_default=False,
    )] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object per text ({\"source\", \"translation\"}), one "
        "per line.",
    )] = False,
) -> None:
    """Translate texts with a trained encoder-decoder checkpoint, or a pretrained one with
    --model; one output per line.

    [bold]Example:[/bold] qkv translate runs/demo "tuesday 3rd of march 2015" "7/4/76"

    [bold]Example:[/bold] qkv translate --model ~/models/opus-mt-en-de "Hello, world."

    [bold]Example:[/bold] qkv translate runs/demo --input dates.txt --json ('-' in the texts or
    as the file reads standard input, one text per line)
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    items = list(inputs or [])
    if model is None:
        if not items:
            raise ValueError("give a CHECKPOINT folder and the TEXTS to translate, or --model "
                             "PATH and the texts")  # fmt: skip
        checkpoint, items = items[0], items[1:]
    texts = read_items(items, input_file, what="text to translate")
    if model is not None:
        outputs = translate_pretrained(model, texts, beam=beam, max_new_tokens=max_new_tokens,
                                       compile=compile)
    else:
        outputs = translate_texts(checkpoint, texts, beam=beam, max_new_tokens=max_new_tokens,
                                  compile=compile)  # fmt: skip
    if as_json:
        print_jsonl({"source": t, "translation": o} for t, o in zip(texts, outputs, strict=True))
        return
    console = Console(highlight=False, soft_wrap=True)
    for line in outputs:
        console.print(line, markup=False)
