"""``qkv translate``: run a trained encoder-decoder checkpoint on text, one output per line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from qkv.train.runs import load_run, seq2seq_parts

__all__ = ["command", "translate_texts"]

NAME = "translate"


def translate_texts(checkpoint: str | Path, texts: list[str], *, beam: int | None = None,
                    max_new_tokens: int | None = None) -> list[str]:  # fmt: skip
    """Translate ``texts`` with the encoder-decoder checkpoint at ``checkpoint``.

    Raises:
        FileNotFoundError: no checkpoint; ValueError: a corrupt one, a decoder-only model,
            no texts, a bad beam size.
    """
    from qkv.generate import translate

    if not texts:
        raise ValueError("give at least one text to translate")
    if beam is not None and beam < 1:
        raise ValueError(f"--beam must be >= 1, got {beam}")
    ckpt, folder, _ = load_run(checkpoint)
    model, src_tok, tgt_tok = seq2seq_parts(ckpt, folder, "translate")
    return translate(model, texts, src_tok, tgt_tok, beam_size=beam,
                     max_new_tokens=max_new_tokens)  # fmt: skip


def command(
    checkpoint: Annotated[Path, typer.Argument(
        help="A checkpoint folder, or a run folder (its best/ checkpoint is used).",
        show_default=False,
    )],
    texts: Annotated[list[str], typer.Argument(help="Texts to translate.", show_default=False)],
    beam: Annotated[int | None, typer.Option(
        "--beam", help="Beam size (default: greedy decoding).",
    )] = None,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", min=1, help="Longest output (default: 2 × input + 10).",
    )] = None,
) -> None:
    """Translate texts with a trained encoder-decoder checkpoint; one output per line.

    [bold]Example:[/bold] qkv translate runs/demo "tuesday 3rd of march 2015" "7/4/76"
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    outputs = translate_texts(checkpoint, texts, beam=beam, max_new_tokens=max_new_tokens)
    console = Console(highlight=False, soft_wrap=True)
    for line in outputs:
        console.print(line, markup=False)
