"""``qkv train --from MODEL``: the command line of :func:`qkv.train.finetuning`.

The options become one :class:`~qkv.train.FineTuneSpec` (:func:`plan`): ``--from`` the base
model, ``--chat`` or ``--text`` the data, the ``--lora-*`` options its
:class:`~qkv.train.LoRAOptions`, ``--config``'s training keys and the training options its
``train``, ``--out`` its folder; the library runs it (or, with ``--resume``,
:func:`qkv.train.resume_finetune`), and its messages name these options (:data:`CLI_WORDS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.cli.train_options import LEVERS, TrainArgs
from qkv.train import FineTuneRun, FineTuneSpec, LoRAOptions, finetune, resume_finetune
from qkv.train.finetune_spec import DEFAULT_TARGETS, Words
from qkv.train.spec import read_spec_toml

__all__ = ["CLI_WORDS", "lora_options", "plan", "refuse_clashes", "report", "resume_from",
           "run_from"]  # fmt: skip

CLI_WORDS = Words(command="qkv train --from", resume_command="qkv train --resume",
                  fine_tuning="fine-tuning (--from)", base="--from", out="--out",
                  resume="--resume", steps="--steps", lora_targets="--lora-targets",
                  context_parallel="--context-parallel", config="--config")  # fmt: skip
# What shapes a model from scratch: --from brings its model, tokenizer and data kind.
CLASHES = ("task", "pairs", "resume", "d_model", "layers", "heads", "tokenizer", "vocab_size",
           "fsdp", "pack", "source_column", "target_column")  # fmt: skip
TRAIN_OPTIONS = ("steps", "batch_size", "lr", "eval_every", "seed", "device", *LEVERS)


def run_from(args: TrainArgs, say: Any) -> FineTuneRun:
    """``qkv train --from``: the options as a spec, fine-tuned."""
    refuse_clashes(args)
    return finetune(plan(args), max_seconds=args.max_seconds, say=say, words=CLI_WORDS)


def resume_from(args: TrainArgs, say: Any) -> FineTuneRun:
    """``qkv train --resume RUN`` of a fine-tuning run."""
    return resume_finetune(args.resume, steps=args.steps, max_seconds=args.max_seconds,
                           device=args.device, say=say, words=CLI_WORDS)  # fmt: skip


def plan(args: TrainArgs) -> FineTuneSpec:
    """The options of ``qkv train --from`` as one record (``--out`` by default
    ``runs/<model>-ft``).

    Raises:
        ValueError: neither or both of ``--chat`` and ``--text``; a bad ``--config``.
    """
    if (args.text is None) == (args.chat is None):
        raise ValueError("--from needs its data: --chat FILE.jsonl (conversations) or --text "
                         "PATH (plain text), one of them")  # fmt: skip
    data, kind = (args.chat, "chat") if args.chat is not None else (args.text, "text")
    given = {k: v for k, v in args.pick(*TRAIN_OPTIONS).items() if v is not None}
    out = args.out if args.out is not None else Path("runs") / f"{Path(args.from_).stem}-ft"
    return FineTuneSpec(args.from_, data, out, kind, args.text_column, lora_options(args),
                        train={**_train_table(args.config), **given})  # fmt: skip


def _train_table(config: Path | None) -> dict[str, Any]:
    """``--config``'s training keys for ``--from`` (its model and data are given)."""
    if config is None:
        return {}
    tables = read_spec_toml(config)
    extra = [f"[{k}]" for k in ("data", "model") if tables[k]]
    if extra:
        raise ValueError(f"{config}: {' and '.join(extra)} do not apply with --from (the "
                         "pretrained model and its tokenizer are given); keep the training "
                         "keys")  # fmt: skip
    return tables["train"]


def lora_options(args: TrainArgs) -> LoRAOptions | None:
    """The ``--lora-*`` options as one record (None: full fine-tuning).

    Raises:
        ValueError: naming the option: LoRA shape options without ``--lora-rank``, a rank
            below 1, a negative or non-finite alpha, a dropout outside [0, 1), no pattern.
    """
    if args.lora_rank is None:
        given = args.given("lora_alpha", "lora_dropout", "lora_targets")
        if given:
            raise ValueError(f"{', '.join(given)} shape LoRA adapters: give --lora-rank too")
        return None
    targets = ",".join(DEFAULT_TARGETS) if args.lora_targets is None else args.lora_targets
    patterns = tuple(p.strip() for p in targets.split(",") if p.strip())
    if not patterns:
        raise ValueError(f"--lora-targets must name layer patterns such as '*.q_proj,*.v_proj', "
                         f"got {args.lora_targets!r}")  # fmt: skip
    dropout = 0.0 if args.lora_dropout is None else args.lora_dropout
    try:
        return LoRAOptions(args.lora_rank, args.lora_alpha, dropout, patterns)
    except ValueError as err:  # "LoRAOptions.rank must be ..." -> "--lora-rank must be ..."
        raise ValueError(str(err).replace("LoRAOptions.", "--lora-", 1)) from None


def refuse_clashes(args: TrainArgs) -> None:
    """``--from`` brings its model, tokenizer and data kind: the options that shape a model
    from scratch are refused, named."""
    clash = args.given(*CLASHES)
    if clash:
        raise ValueError(f"--from fine-tunes a pretrained model with its own architecture and "
                         f"tokenizer; drop {', '.join(clash)}")  # fmt: skip


def report(console: Any, run: FineTuneRun) -> None:
    """Rank 0's closing lines of a fine-tuning run."""
    result, before, after, world, run_dir = run.result, run.before, run.after, run.world, \
        run.run_dir
    console.print(f"trained {result.steps:,} steps in {result.seconds:.1f} s "
                  f"({result.tokens_per_second:,.0f} learned tokens/s"
                  f"{f' on {world.size} processes' if world.parallel else ''})",
                  markup=False)  # fmt: skip
    if before is not None and after is not None:
        console.print(f"held out: loss {before['loss']:.3f} → {after['loss']:.3f}, token "
                      f"accuracy {before['token_accuracy']:.1%} → "
                      f"{after['token_accuracy']:.1%}", markup=False)  # fmt: skip
    console.print(f"model: {run_dir / 'model'} (a Hugging Face folder)", markup=False)
    if (run_dir / "adapters.safetensors").is_file():
        console.print(f"adapters: {run_dir / 'adapters.safetensors'}", markup=False)
    console.print(f"next: qkv chat --model {run_dir / 'model'}", markup=False)
