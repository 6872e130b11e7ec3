"""The options of ``qkv train`` (:mod:`qkv.cli.train_cmd`), declared once each: a typer
annotation per option, named after it (``--lora-rank`` is ``LoraRank``), so the command's
signature reads as a list and its body as the logic; :class:`TrainArgs` holds what one
command line gave, as one record."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import typer

from qkv.cli.common import FLAG

__all__ = [
    "BatchSize",
    "Bf16",
    "Chat",
    "CheckpointActivations",
    "Config",
    "ContextMethod",
    "ContextParallel",
    "DModel",
    "Device",
    "EvalEvery",
    "From",
    "Fsdp",
    "Heads",
    "Layers",
    "LoraAlpha",
    "LoraDropout",
    "LoraRank",
    "LoraTargets",
    "Lr",
    "MaxSeconds",
    "Out",
    "Pack",
    "Pairs",
    "Resume",
    "Seed",
    "SourceColumn",
    "Steps",
    "TargetColumn",
    "Task",
    "Text",
    "TextColumn",
    "Threads",
    "Tokenizer",
    "TrainArgs",
    "VocabSize",
]

Task = Annotated[str | None, typer.Argument(
    help="A synthetic task: copy, reverse, sort, addition or dates.", show_default=False,
)]
Text = Annotated[Path | None, typer.Option(
    "--text", help="Train a language model on this text file or folder, or on the records "
    "of a .jsonl (or .csv/.tsv with --text-column).",
)]
Pairs = Annotated[Path | None, typer.Option(
    "--pairs", help="Train a translation model on pairs: a .tsv (source<TAB>target, or "
    "named columns under a header), .csv (header) or .jsonl file.",
)]
SourceColumn = Annotated[str | None, typer.Option(
    "--source-column", help="--pairs: the source column (CSV/TSV header) or key (JSONL); "
    "default 'source'.",
)]
TargetColumn = Annotated[str | None, typer.Option(
    "--target-column", help="--pairs: the target column or key; default 'target'.",
)]
TextColumn = Annotated[str | None, typer.Option(
    "--text-column", help="--text: train on this column of a .csv/.tsv or key of a .jsonl "
    "(default for .jsonl: 'text'); records become paragraphs.",
)]
Tokenizer = Annotated[str | None, typer.Option(
    "--tokenizer", help="char (characters seen in training; default), byte (UTF-8 bytes) or "
    "bpe (byte-level BPE trained on the training split, saved in the run folder).",
)]
VocabSize = Annotated[int | None, typer.Option(
    "--vocab-size", help="--tokenizer bpe: vocabulary size (>= 260; default 1000).",
)]
From = Annotated[str | None, typer.Option(
    "--from", help="Fine-tune this pretrained decoder (a packaged name such as "
    "SmolLM2-135M-Instruct, a Hugging Face folder, a .gguf file) on --chat or --text; "
    "<out>/model receives it as a Hugging Face folder.", show_default=False,
)]
Chat = Annotated[Path | None, typer.Option(
    "--chat", help="--from: conversations, a .jsonl of {\"messages\": [...]} lines; the "
    "loss counts the assistant turns only.",
)]
LoraRank = Annotated[int | None, typer.Option(
    "--lora-rank", help="--from: train LoRA adapters of this rank, the other weights "
    "frozen (without it, every weight trains).",
)]
LoraAlpha = Annotated[float | None, typer.Option(
    "--lora-alpha", help="--lora-rank: the update's scale is alpha / rank (default alpha: "
    "twice the rank).",
)]
LoraDropout = Annotated[float | None, typer.Option(
    "--lora-dropout", help="--lora-rank: dropout on the adapters' input (default 0).",
)]
LoraTargets = Annotated[str | None, typer.Option(
    "--lora-targets", help="--lora-rank: comma-separated layer-name patterns (default "
    "'*.q_proj,*.k_proj,*.v_proj,*.out_proj').",
)]
Resume = Annotated[Path | None, typer.Option(
    "--resume", help="Continue this run folder exactly from its last checkpoint (its data, "
    "model, tokenizers and settings; --steps may change its total, and a note says how the "
    "learning-rate schedule is re-planned).",
)]
Config = Annotated[Path | None, typer.Option(
    "--config", help="A TOML file: TrainConfig keys, \\[data] and \\[model] tables.",
)]
Out = Annotated[Path | None, typer.Option(
    "--out", help="The run folder (default runs/<task or file name>); must not hold a run.",
)]
Steps = Annotated[int | None, typer.Option("--steps", help="Optimizer steps.")]
BatchSize = Annotated[int | None, typer.Option(
    "--batch-size", help="Examples per step (in all, under torchrun).",
)]
Lr = Annotated[float | None, typer.Option("--lr", help="Peak learning rate.")]
EvalEvery = Annotated[int | None, typer.Option(
    "--eval-every", help="Validate every this many steps.",
)]
DModel = Annotated[int | None, typer.Option("--d-model", help="Model width.")]
Layers = Annotated[int | None, typer.Option(
    "--layers", help="Blocks (per stack for encoder-decoders).",
)]
Heads = Annotated[int | None, typer.Option("--heads", help="Attention heads.")]
Seed = Annotated[int | None, typer.Option("--seed", help="Seeds data and training.")]
MaxSeconds = Annotated[float | None, typer.Option(
    "--max-seconds", help="Stop training after this many seconds.",
)]
Device = Annotated[str | None, typer.Option("--device", help="cpu, cuda, ...")]
Threads = Annotated[int | None, typer.Option(
    "--threads", min=1, help="CPU threads for torch (default: torch's own).",
)]
Pack = Annotated[bool | None, typer.Option(
    "--pack/--no-pack", metavar=FLAG, show_default=False, help="Text: train on "
    "paragraphs packed into rows with document ids (no attention across paragraphs, "
    "positions restart), or on windows of the stream \\[default: --config's, else "
    "windows].",
)]
Fsdp = Annotated[bool | None, typer.Option(
    "--fsdp/--no-fsdp", metavar=FLAG, show_default=False, help="Under torchrun: shard "
    "weights, gradients and optimizer state (FSDP2), or keep a replica per process (DDP) "
    "\\[default: --config's, else DDP].",
)]
ContextParallel = Annotated[int | None, typer.Option(
    "--context-parallel", help="Text, under torchrun: processes that share each sequence "
    "(context parallelism; must divide the number of processes) \\[default: 1].",
    show_default=False,
)]
ContextMethod = Annotated[str | None, typer.Option(
    "--context-method", help="--context-parallel: auto, ring or all_to_all (how attention "
    "crosses the processes) \\[default: auto].", show_default=False,
)]
CheckpointActivations = Annotated[bool | None, typer.Option(
    "--checkpoint-activations/--no-checkpoint-activations", metavar=FLAG,
    show_default=False, help="Each block recomputes its activations in backward instead "
    "of storing them: less memory, about a third more compute, the same results "
    "\\[default: --config's, else off].",
)]
Bf16 = Annotated[bool | None, typer.Option(
    "--bf16/--no-bf16", metavar=FLAG, show_default=False, help="bfloat16 autocast around "
    "forward and loss (much slower on a CPU without native bfloat16: a note says so) "
    "\\[default: --config's, else float32].",
)]


@dataclass(frozen=True)
class TrainArgs:
    """One ``qkv train`` command line: every option as the command received it (None: not
    given), named as the command's parameters (``from_`` is ``--from``)."""

    task: str | None = None
    text: Path | None = None
    pairs: Path | None = None
    source_column: str | None = None
    target_column: str | None = None
    text_column: str | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    from_: str | None = None
    chat: Path | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: str | None = None
    resume: Path | None = None
    config: Path | None = None
    out: Path | None = None
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    eval_every: int | None = None
    d_model: int | None = None
    layers: int | None = None
    heads: int | None = None
    seed: int | None = None
    max_seconds: float | None = None
    device: str | None = None
    threads: int | None = None
    pack: bool | None = None
    fsdp: bool | None = None
    context_parallel: int | None = None
    context_method: str | None = None
    checkpoint_activations: bool | None = None
    bf16: bool | None = None

    def given(self, *names: str) -> list[str]:
        """The options among ``names`` (fields) that the command line gave, as typed."""
        return [flag(n) for n in names if getattr(self, n) is not None]

    def pick(self, *names: str) -> dict[str, Any]:
        """``{name: value}`` for the fields ``names`` (None where not given)."""
        return {n: getattr(self, n) for n in names}


FIELDS = tuple(f.name for f in fields(TrainArgs))
# The data's columns and tokenizer, and the memory and parallelism levers, as they travel on.
COLUMNS = ("source_column", "target_column", "text_column", "tokenizer", "vocab_size")
LEVERS = ("checkpoint_activations", "bf16", "context_parallel", "context_method")


def flag(name: str) -> str:
    """How the command line spells the field ``name``: ``TASK``, ``--from``, ``--lora-rank``."""
    return {"task": "TASK", "from_": "--from"}.get(name, f"--{name.replace('_', '-')}")
