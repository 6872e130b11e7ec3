"""``qkv embed``: sentence embeddings of a few texts and the table of their cosine similarities.

The numbers are :func:`qkv.pretrained.embed`'s (all-MiniLM-L6-v2 by default: mean-pooled,
L2-normalised, the same as sentence-transformers); :func:`print_table` only formats them. The
command's options travel as one :class:`EmbedOptions`, checked once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table
from torch import Tensor

from qkv.cli.common import FLAG, ModelDevice
from qkv.cli.inputs import read_items
from qkv.cli.outputs import check_out_file, print_jsonl, write_embeddings
from qkv.cli.progress import Stages

__all__ = ["EmbedOptions", "command", "print_table", "short"]

NAME = "embed"
LABEL_CHARS = 40  # texts longer than this are cut in the table's row labels

Texts = Annotated[list[str] | None, typer.Argument(
    help="The texts to embed (one or more; '-' reads standard input, one per line).",
    show_default=False,
)]
Model = Annotated[str, typer.Option(
    "--model", "-m", help="A sentence encoder: packaged name or Hugging Face-format folder.",
)]
BatchSize = Annotated[int, typer.Option("--batch-size", min=1, help="Texts per forward pass.")]
InputFile = Annotated[Path | None, typer.Option(
    "--input", "-i", help="A UTF-8 file of texts, one per line ('-': standard input).",
    show_default=False,
)]
OutFile = Annotated[Path | None, typer.Option(
    "--out", "-o", help="Save the embeddings to this new file (its folders are created): "
    ".npy (N, E) float32, .jsonl ({text, embedding} per line) or .safetensors (tensor "
    "'embeddings', texts in the metadata).",
    show_default=False,
)]
AsJson = Annotated[bool, typer.Option(
    "--json", metavar=FLAG,
    help="Print one JSON object per text ({\"text\", \"embedding\"}) instead "
    "of the similarity table.",
)]


@dataclass(frozen=True)
class EmbedOptions:
    """What ``qkv embed`` embeds and where the vectors go; checked once, when built.

    Raises:
        ValueError: an ``--out`` that exists, is a folder or has an unknown suffix
            (:func:`qkv.cli.outputs.check_out_file`).
    """

    texts: tuple[str, ...]  # TEXTS and --input's, in order
    model: str = "all-MiniLM-L6-v2"
    batch_size: int = 32
    out: Path | None = None  # a new .npy, .jsonl or .safetensors file; None: none written
    as_json: bool = False
    device: str | None = None  # None: the CPU

    def __post_init__(self) -> None:
        if self.out is not None:  # before any work (guard's "out" check is for folders)
            object.__setattr__(self, "out", check_out_file(self.out))


def short(text: str, limit: int = LABEL_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def print_table(texts: list[str], embeddings: Tensor, cosine: Tensor, console: Console) -> None:
    """Print the ``(N, N)`` ``cosine`` table of ``texts``, 4 decimals, with the closest pair.

    Args:
        texts: ``N`` strings (row labels, numbered; columns are the numbers).
        embeddings: ``(N, E)``; only its shape is shown.
        cosine: ``(N, N)``.
        console: where to print.
    """
    N, E = embeddings.shape
    console.print(f"{N} text{'s' * (N != 1)} -> embeddings ({N}, {E}), L2-normalised; "
                  "cosine similarity:")  # fmt: skip
    table = Table(
        Column("text", overflow="fold"),
        *(Column(str(j + 1), justify="right") for j in range(N)),
        header_style="bold",
    )
    for i, text in enumerate(texts):
        table.add_row(escape(f"{i + 1} {short(text)}"), *(f"{float(c):.4f}" for c in cosine[i]))
    console.print(table)
    if N > 1:
        # 1) the most similar pair of different texts: mask the diagonal out
        off = cosine.clone().fill_diagonal_(float("-inf"))  # (N, N)
        i, j = divmod(int(off.argmax()), N)
        console.print(f"most similar: {i + 1} and {j + 1} ({float(cosine[i, j]):.4f})")


def command(
    texts: Texts = None,
    model: Model = "all-MiniLM-L6-v2",
    batch_size: BatchSize = 32,
    input_file: InputFile = None,
    out_file: OutFile = None,
    as_json: AsJson = False,
    device: ModelDevice = None,
) -> None:
    """Embed texts with a sentence encoder and print their cosine-similarity table.

    [bold]Example:[/bold] qkv embed "A cat sits on the mat." "A kitten rests on a rug."
    "Stock prices fell."

    [bold]Example:[/bold] qkv embed --input sentences.txt --out vectors.npy
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    items = read_items(texts, input_file, what="text")
    options = EmbedOptions(texts=tuple(items), model=model, batch_size=batch_size,
                           out=out_file, as_json=as_json, device=device)  # fmt: skip
    embed(options)


def embed(options: EmbedOptions) -> None:
    """Load the encoder, embed the texts; write them (``--out``), print them as JSON lines
    (``--json``) or, when neither, print the similarity table."""
    from qkv import pretrained

    items = list(options.texts)
    stages = Stages("embed")  # stderr: spinners on a terminal, a line per stage in a pipe
    with stages.stage(f"loading {options.model}"):
        bundle = pretrained.load(options.model, device=options.device)
    with stages.stage(f"embedding {len(items)} texts"):
        embeddings, cosine = pretrained.embed(items, bundle, batch_size=options.batch_size)
    if options.out is not None:
        write_embeddings(options.out, items, embeddings)
        Console(stderr=True, highlight=False).print(
            f"wrote {len(items)} embeddings ({embeddings.shape[1]} floats each) to "
            f"{options.out}", markup=False)  # fmt: skip
    if options.as_json:
        print_jsonl({"text": t, "embedding": row}
                    for t, row in zip(items, embeddings.tolist(), strict=True))  # fmt: skip
    elif options.out is None:
        print_table(items, embeddings, cosine, Console(highlight=False))
