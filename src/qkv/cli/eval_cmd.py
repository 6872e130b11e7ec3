"""``qkv eval``: measure a trained checkpoint on held-out data.

Without a data option the checkpoint's own run is used: ``qkv train`` left ``data.json`` in
the run folder, from which the same test split (or, for text, the validation split) is built
again, never seen in training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from qkv.cli.common import BeamAlias, BeamSize, ModelDevice, beam_of
from qkv.train.runs import load_run, seq2seq_parts
from qkv.train.spec import DataSpec, load_dataset

__all__ = ["command", "evaluate_checkpoint"]

NAME = "eval"


def evaluate_checkpoint(
    checkpoint: str | Path,
    *,
    task: str | None = None,
    pairs: Path | None = None,
    text: Path | None = None,
    split: str = "test",
    seed: int | None = None,
    beam: int | None = None,
    source_column: str | None = None,
    target_column: str | None = None,
    text_column: str | None = None,
    device: str | None = None,
) -> tuple[dict[str, float], str]:
    """Metrics of the checkpoint at ``checkpoint`` and a description of the data.

    Args:
        checkpoint: a checkpoint or run folder.
        task: a task name: its ``split``, as the run's data.json describes it when that is
            the same task (and ``seed`` is None or the run's), else the task with default
            sizes and ``seed`` (default 0).
        pairs: a ``.tsv``, ``.csv`` or ``.jsonl`` file of pairs (columns/keys ``source`` and
            ``target``, or ``source_column``/``target_column``), every pair of it evaluated.
        text: a text file or folder, all of it evaluated (language models).
        split: ``"test"`` or ``"valid"`` of a task or of the run's own data.
        seed: the seed of ``task``.
        beam: beam size for decoding (None: greedy).
        source_column, target_column: ``pairs``' column or key names.
        text_column: ``text``: the column (``.csv``/``.tsv``) or key (``.jsonl``; default
            ``"text"``) of its records, as ``qkv train --text-column`` reads them.
        device: None (the CPU) or where the model runs (``"cuda"``, ...).

    Returns:
        ``(metrics, what was evaluated)``; seq2seq metrics hold ``"bleu"`` only when the
        references average 4 or more BLEU tokens, else ``"bleu_ref_tokens"``
        (:func:`qkv.train.evaluate_seq2seq`).

    Raises:
        FileNotFoundError, ValueError: no or a corrupt checkpoint, no data to evaluate on,
            a model that does not fit the data.
        ImportError: sacrebleu missing.
    """
    from qkv.train import evaluate_lm, evaluate_seq2seq

    _check_choice(split, task, pairs, text)
    ckpt, folder, spec = load_run(checkpoint, device)
    data, what = _eval_data(folder, spec, task=task, pairs=pairs, text=text, split=split,
                            seed=seed, columns=(source_column, target_column, text_column))
    if not data:
        raise ValueError(f"nothing to evaluate in {what}")
    if isinstance(data, str):
        tok = ckpt.tokenizers.get("text")
        if tok is None:
            raise ValueError(f"{folder} is not a language model with a text tokenizer")
        return evaluate_lm(ckpt.model, tok.encode(data),
                           block_size=int(ckpt.model.config.max_len)), what  # fmt: skip
    model, src_tok, tgt_tok = seq2seq_parts(ckpt, folder, "eval")
    metrics = evaluate_seq2seq(model, data, src_tok, tgt_tok, batch_size=256, beam=beam)
    return metrics, f"{what}, {len(data):,} pairs"


def _check_choice(split: str, *sources: Any) -> None:
    """``--split`` is test or valid, and at most one of ``--task``/``--pairs``/``--text``."""
    if split not in ("test", "valid"):
        raise ValueError(f"--split must be 'test' or 'valid', got {split!r}")
    if sum(x is not None for x in sources) > 1:
        raise ValueError("give at most one of --task, --pairs and --text")


def _eval_data(folder: Path, spec: DataSpec | None, *, task: str | None, pairs: Path | None,
               text: Path | None, split: str, seed: int | None,
               columns: tuple[str | None, str | None, str | None]) -> tuple[Any, str]:  # fmt: skip
    """The data :func:`evaluate_checkpoint` measures on, and its description: ``pairs``,
    ``text``, ``task`` or the run's own split (``columns``: source, target, text)."""
    from qkv.data import load_text
    from qkv.data.records import RECORD_SUFFIXES, load_pairs, load_records_text

    source_column, target_column, text_column = columns
    if pairs is not None:
        return (load_pairs(pairs, source=source_column, target=target_column),
                f"{pairs} (all pairs)")  # fmt: skip
    if text is not None:
        suffix = Path(text).suffix.lower()
        if suffix == ".jsonl" or (text_column and suffix in RECORD_SUFFIXES):
            return load_records_text(text, key=text_column or "text"), f"{text} (all of it)"
        return load_text(text), f"{text} (all of it)"
    same = spec is not None and (spec.kind, spec.source) == ("task", task)
    if task is not None and not (same and seed in (None, spec.seed)):
        spec = DataSpec.build({}, task=task, seed=seed or 0)
    if spec is None:
        raise ValueError(
            f"{folder}: no data.json in its run folder to say what it was trained on; "
            "give --task, --pairs or --text"
        )
    split = "valid" if spec.kind == "text" else split
    what = f"{spec.kind} {spec.source}, {'validation' if split == 'valid' else 'test'} split"
    return getattr(load_dataset(spec), split), what


Checkpoint = Annotated[Path, typer.Argument(
    help="A checkpoint folder, or a run folder (its best/ checkpoint is used).",
    show_default=False,
)]
Task = Annotated[str | None, typer.Option("--task", help="Evaluate on this task.")]
Pairs = Annotated[Path | None, typer.Option(
    "--pairs", help="Evaluate on these pairs: a .tsv, .csv or .jsonl file.",
)]
SourceColumn = Annotated[str | None, typer.Option(
    "--source-column", help="--pairs: the source column or key (default 'source').",
)]
TargetColumn = Annotated[str | None, typer.Option(
    "--target-column", help="--pairs: the target column or key (default 'target').",
)]
TextColumn = Annotated[str | None, typer.Option(
    "--text-column", help="--text: the column of a .csv/.tsv or key of a .jsonl (default "
    "for .jsonl: 'text').",
)]
Text = Annotated[Path | None, typer.Option("--text", help="Evaluate an LM on this text.")]
Split = Annotated[str, typer.Option("--split", help="test or valid.")]
TaskSeed = Annotated[int | None, typer.Option(
    "--seed", help="Seed of --task's data (default: the run's, else 0).",
)]


def command(
    checkpoint: Checkpoint, task: Task = None, pairs: Pairs = None,
    source_column: SourceColumn = None, target_column: TargetColumn = None,
    text_column: TextColumn = None, text: Text = None, split: Split = "test",
    seed: TaskSeed = None,
    beam_size: BeamSize = None,
    beam: BeamAlias = None,
    device: ModelDevice = None,
) -> None:
    """Evaluate a checkpoint: exact match, BLEU, chrF (or loss and perplexity for text).

    Without --task, --pairs or --text it uses the held-out split of the data it was trained on.
    BLEU reads "n/a" when the references average under 4 tokens (no 4-grams: perfect outputs
    would score 0).

    [bold]Example:[/bold] qkv eval runs/dates

    [bold]Example (CSV pairs):[/bold] qkv eval runs/enfr --pairs test.csv --source-column en
    --target-column fr

    [bold]Example (JSONL text):[/bold] qkv eval runs/posts --text held_out.jsonl --text-column body
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    from qkv.cli.train_cmd import metrics_text

    beam, _ = beam_of(beam_size, beam)
    if (source_column or target_column) and pairs is None:
        raise ValueError("--source-column/--target-column name the columns of --pairs; give "
                         "--pairs FILE")  # fmt: skip
    if text_column and text is None:
        raise ValueError("--text-column names a column of --text; give --text FILE")
    metrics, what = evaluate_checkpoint(checkpoint, task=task, pairs=pairs, text=text,
                                        split=split, seed=seed, beam=beam,
                                        source_column=source_column,
                                        target_column=target_column,
                                        text_column=text_column, device=device)  # fmt: skip
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"{checkpoint}: {what}", markup=False)
    console.print(metrics_text(metrics), markup=False)
