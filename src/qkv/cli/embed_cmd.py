"""``qkv embed``: sentence embeddings of a few texts and the table of their cosine similarities.

The numbers are :func:`qkv.pretrained.embed`'s (all-MiniLM-L6-v2 by default: mean-pooled,
L2-normalised, the same as sentence-transformers); :func:`print_table` only formats them.
"""

from __future__ import annotations

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

__all__ = ["command", "print_table", "short"]

NAME = "embed"
LABEL_CHARS = 40  # texts longer than this are cut in the table's row labels


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
    texts: Annotated[list[str] | None, typer.Argument(
        help="The texts to embed (one or more; '-' reads standard input, one per line).",
        show_default=False,
    )] = None,
    model: Annotated[str, typer.Option(
        "--model", "-m", help="A sentence encoder: packaged name or Hugging Face-format folder.",
    )] = "all-MiniLM-L6-v2",
    batch_size: Annotated[int, typer.Option(
        "--batch-size", min=1, help="Texts per forward pass.",
    )] = 32,
    input_file: Annotated[Path | None, typer.Option(
        "--input", "-i", help="A UTF-8 file of texts, one per line ('-': standard input).",
        show_default=False,
    )] = None,
    out_file: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Save the embeddings to this new file (its folders are created): "
        ".npy (N, E) float32, .jsonl ({text, embedding} per line) or .safetensors (tensor "
        "'embeddings', texts in the metadata).",
        show_default=False,
    )] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", metavar=FLAG,
        help="Print one JSON object per text ({\"text\", \"embedding\"}) instead "
        "of the similarity table.",
    )] = False,
    device: ModelDevice = None,
) -> None:
    """Embed texts with a sentence encoder and print their cosine-similarity table.

    [bold]Example:[/bold] qkv embed "A cat sits on the mat." "A kitten rests on a rug."
    "Stock prices fell."

    [bold]Example:[/bold] qkv embed --input sentences.txt --out vectors.npy
    """
    from qkv import pretrained

    items = read_items(texts, input_file, what="text")
    # before any work (the parameter is not named "out": guard's check is for folders)
    out = check_out_file(out_file) if out_file is not None else None
    console = Console(highlight=False)
    stderr = Console(stderr=True, highlight=False)
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    stages = Stages("embed")  # stderr: spinners on a terminal, a line per stage in a pipe
    with stages.stage(f"loading {model}"):
        bundle = pretrained.load(model, device=device)
    with stages.stage(f"embedding {len(items)} texts"):
        embeddings, cosine = pretrained.embed(items, bundle, batch_size=batch_size)
    if out is not None:
        write_embeddings(out, items, embeddings)
        stderr.print(f"wrote {len(items)} embeddings ({embeddings.shape[1]} floats each) to "
                     f"{out}", markup=False)  # fmt: skip
    if as_json:
        print_jsonl({"text": t, "embedding": row}
                    for t, row in zip(items, embeddings.tolist(), strict=True))  # fmt: skip
    elif out is None:
        print_table(items, embeddings, cosine, console)
