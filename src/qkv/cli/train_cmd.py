"""``qkv train``: train a model from scratch on a synthetic task, a file of pairs or any text.

Tasks and pairs (``.tsv``, ``.csv``, ``.jsonl``) train a
:class:`~qkv.models.Seq2SeqTransformer`; text trains a GPT-2-style :class:`~qkv.models.DecoderLM`;
the tokenizers are characters, bytes or a byte-level BPE (``--tokenizer``). The run folder
(``--out``) receives the checkpoints (``best``, ``last``, each with its tokenizers),
``metrics.jsonl``, ``loss.png`` and ``data.json`` (the data spec, for ``qkv eval``);
``--resume RUN`` continues a run folder exactly where its ``last`` checkpoint stopped. The
settings are described in :mod:`qkv.train.spec`; building and running the model is
:mod:`qkv.train.runs`. ``--from`` (fine-tuning a pretrained model) is :func:`qkv.train.finetuning`,
its options turned into a spec by :mod:`qkv.cli.train_from`. The command's options become one
:class:`~qkv.cli.train_options.TrainArgs` record, which every path reads.

Under ``torchrun`` the same command trains data-parallel: each process starts the process
group (gloo on CPU, NCCL with ``--device cuda``, each rank on ``cuda:LOCAL_RANK``), builds the
same seeded model and data, and trains on its share of every global batch, with DDP or, with
``--fsdp``, FSDP2. Rank 0 alone prints and writes the run folder::

    torchrun --nproc-per-node 2 -m qkv train dates --steps 800 --out runs/dates
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from qkv.cli import train_options as o
from qkv.cli.common import fail
from qkv.cli.train_from import lora_options, report, resume_from, run_from
from qkv.cli.train_options import COLUMNS, FIELDS, LEVERS, TrainArgs
from qkv.distributed.data_parallel import (
    World,
    barrier,
    current_world,
    init_distributed,
    is_peer_failure,
    launched,
    leave,
    shutdown,
)
from qkv.train.finetune_spec import FINETUNE_FILE
from qkv.train.metrics import describe_metrics
from qkv.train.runs import (
    build_model,
    build_train_config,
    make_tokenizers,
    run_tokenizers,
    run_training,
)
from qkv.train.spec import DATA_FILE, DataSpec, load_dataset, read_data_spec, read_spec_toml

__all__ = ["command", "metrics_text", "resume_notice"]

NAME = "train"
# What --resume takes along: the run brings its own data and settings.
RESUME_TAKES = ("resume", "steps", "max_seconds", "device", "threads")
EXPECTED = (ValueError, TypeError, FileNotFoundError, ImportError, OSError, FloatingPointError,
            RuntimeError)  # fmt: skip


def command(
    task: o.Task = None, text: o.Text = None, pairs: o.Pairs = None,
    source_column: o.SourceColumn = None, target_column: o.TargetColumn = None,
    text_column: o.TextColumn = None, tokenizer: o.Tokenizer = None,
    vocab_size: o.VocabSize = None, from_: o.From = None, chat: o.Chat = None,
    lora_rank: o.LoraRank = None, lora_alpha: o.LoraAlpha = None,
    lora_dropout: o.LoraDropout = None, lora_targets: o.LoraTargets = None,
    resume: o.Resume = None, config: o.Config = None, out: o.Out = None,
    steps: o.Steps = None, batch_size: o.BatchSize = None, lr: o.Lr = None,
    eval_every: o.EvalEvery = None, d_model: o.DModel = None, layers: o.Layers = None,
    heads: o.Heads = None, seed: o.Seed = None, max_seconds: o.MaxSeconds = None,
    device: o.Device = None, threads: o.Threads = None, pack: o.Pack = None,
    fsdp: o.Fsdp = None, context_parallel: o.ContextParallel = None,
    context_method: o.ContextMethod = None,
    checkpoint_activations: o.CheckpointActivations = None, bf16: o.Bf16 = None,
) -> None:  # fmt: skip
    """Train a transformer from scratch (a synthetic task, a file of pairs, any text), or
    fine-tune a pretrained one (--from).

    Tasks and pairs (.tsv, .csv, .jsonl) train an encoder-decoder; text trains a GPT-2-style
    language model. --out receives the checkpoints (with their tokenizers), metrics.jsonl,
    loss.png and data.json (for qkv eval). The test metrics follow: exact match, BLEU (n/a
    when targets average under 4 tokens), chrF (loss and perplexity for text). The training
    loss shown is the label-smoothed objective; "ce" beside it is the plain cross-entropy, the
    number to compare with validation. Options win over the --config file. Under torchrun it
    trains data-parallel (--fsdp: sharded); --batch-size stays the global batch and --seed
    gives the same weights as one process.

    [bold]Example:[/bold] qkv train dates --steps 800 --out runs/dates

    [bold]Example (CSV/JSONL pairs):[/bold] qkv train --pairs data.csv --source-column en
    --target-column fr --out runs/enfr

    [bold]Example (JSONL text):[/bold] qkv train --text posts.jsonl --text-column body
    --out runs/posts

    [bold]Example (BPE):[/bold] qkv train --text notes.txt --tokenizer bpe --vocab-size 2000
    --out runs/notes

    [bold]Example (resume):[/bold] qkv train --resume runs/dates   (or --steps 2000 to go on)

    [bold]Packed text:[/bold] qkv train --text notes/ --pack --steps 500 --out runs/notes

    [bold]On 2 processes:[/bold] torchrun --nproc-per-node 2 -m qkv train dates --out runs/dates

    [bold]Fine-tune (LoRA):[/bold] qkv train --from SmolLM2-135M-Instruct --chat chats.jsonl
    --lora-rank 8 --out runs/chat
    """
    args = TrainArgs(**{name: value for name, value in locals().items() if name in FIELDS})
    console = Console(highlight=False, soft_wrap=True)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    closing, world = _guarded(args, console)
    if world.is_zero:
        closing()
    if launched():
        leave(0)  # no interpreter finalisation under torchrun: see leave()


def _guarded(args: TrainArgs, console: Console) -> tuple[Callable[[], None], World]:
    """:func:`_dispatch`, its expected failures as one line (naming the rank in a
    data-parallel run), the process group shut down whatever happens."""
    finished = False
    try:
        done = _dispatch(args, console)
        finished = True
    except EXPECTED as err:
        if isinstance(err, RuntimeError) and not is_peer_failure(err):
            raise  # a bug, not an expected failure: keep its traceback
        world, message = current_world(), str(err)  # "rank r of N: ..." in a data-parallel run
        parallel = world.parallel and not message.startswith(str(world))
        raise fail(f"{world}: {message}" if parallel else err) from None
    finally:
        if launched():
            shutdown(together=finished)
    return done


def _dispatch(args: TrainArgs, console: Console) -> tuple[Callable[[], None], World]:
    """Fine-tune, resume or train from scratch, as the options say; ``(the closing lines to
    print on rank 0, the world)``."""
    lora = lora_options(args)
    if args.from_ is None and (args.chat is not None or lora is not None):
        raise ValueError("--chat and --lora-rank fine-tune a pretrained model: give --from "
                         "MODEL")  # fmt: skip
    if args.from_ is not None:
        run = run_from(args, _say(console))
        return functools.partial(report, console, run), run.world
    if args.resume is not None:
        clash = args.given(*(f for f in FIELDS if f not in RESUME_TAKES))
        if clash:
            raise ValueError(f"--resume continues a run with its own data and settings; "
                             f"drop {', '.join(clash)} (only --steps, --max-seconds, "
                             "--device and --threads go with it)")  # fmt: skip
        if (args.resume / FINETUNE_FILE).is_file():  # a fine-tuning run
            run = resume_from(args, _say(console))
            return functools.partial(report, console, run), run.world
        done, spec, run_dir, world = _resume(console, args.resume, args.steps,
                                             args.max_seconds, args.device)  # fmt: skip
    else:
        done, spec, run_dir, world = _train(console, args)
    return functools.partial(_report, console, done, spec, run_dir, world), world


def _blamed(err: ValueError, config: Path | None, file_alone: Any) -> str:
    """``err``'s message, from settings the file and the command line gave together, led by
    the file's name where the file's settings alone (``file_alone()``) fail too; an option
    given on the command line is named by itself, not as the file's."""
    if config is None:
        return str(err)
    try:
        file_alone()
    except ValueError:
        return f"{config}: {err}"
    return str(err)


def _say(console: Console) -> Any:
    """Print on rank 0 only (the world is known once the run has started)."""

    def say(*args: Any, **kwargs: Any) -> None:
        if current_world().is_zero:
            console.print(*args, markup=False, **kwargs)

    return say


def _report(console: Console, done: dict[str, Any], spec: DataSpec, run_dir: Path,
            world: World) -> None:  # fmt: skip
    """Rank 0's closing lines: speed, the test metrics, where the checkpoint is."""
    result, test = done["result"], done["test"]
    console.print(f"trained {result.steps:,} steps in {result.seconds:.1f} s "
                  f"({result.tokens_per_second:,.0f} tokens/s"
                  f"{f' on {world.size} processes' if world.parallel else ''})")  # fmt: skip
    console.print(f"{done['split']}: " + metrics_text(test))
    console.print(f"checkpoint: {run_dir / 'best'}", markup=False)
    if spec.kind != "text":
        console.print(f"next: qkv translate {run_dir} \"...\"   or   qkv eval {run_dir}",
                      markup=False)


def metrics_text(metrics: dict[str, float]) -> str:
    """The metrics in words (:func:`qkv.train.metrics.describe_metrics`, as the evaluation
    lines during training): ``exact match 99.2%  BLEU 98.1  chrF 99.0``, or ``BLEU n/a
    (targets average 2.9 tokens; BLEU needs 4-grams)`` on short targets, never a metric key
    such as ``bleu_ref_tokens``."""
    return describe_metrics(metrics)


def _train(console: Console, args: TrainArgs) -> tuple[dict[str, Any], DataSpec, Path, World]:
    """Build the run and train it; ``(run_training's result, spec, run folder, world)``."""
    if args.max_seconds is not None and args.max_seconds <= 0:
        raise ValueError(f"--max-seconds must be > 0, got {args.max_seconds}")
    config = args.config
    tables = read_spec_toml(config) if config is not None else {"train": {}, "data": {},
                                                              "model": {}}  # fmt: skip
    spec, run_dir = _data_spec(args, tables)
    options = {**args.pick("steps", "batch_size", "lr", "eval_every", "seed", "device", "fsdp",
                           "pack", *LEVERS), "run_dir": str(run_dir)}  # fmt: skip
    try:
        train_config = build_train_config(spec.kind, tables["train"], options)
    except ValueError as err:
        raise ValueError(_blamed(err, config, lambda: build_train_config(
            spec.kind, tables["train"], {"run_dir": str(run_dir)}))) from None
    # under torchrun: join the process group (a no-op for a single process)
    world = init_distributed(train_config.device)
    say = console.print if world.is_zero else _quiet
    if (run_dir / "last").exists() or (run_dir / DATA_FILE).exists():
        raise ValueError(f"--out {run_dir} already holds a run; choose another folder")
    barrier()  # every rank has looked before rank 0 writes
    data = load_dataset(spec)
    toks = make_tokenizers(spec, data)
    vocab = {role: tok.vocab_size for role, tok in toks.items()}
    try:
        # seeded right before the weights are drawn: one seed, one initial model
        model = build_model(spec.kind, tables["model"], args.pick("d_model", "layers", "heads"),
                            vocab, train_config.block_size, seed=train_config.seed)
    except ValueError as err:
        raise ValueError(f"{config}: [model] {err}" if config is not None else err) from None
    say(_header(spec, model, train_config, run_dir, world))
    if world.is_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / DATA_FILE, spec.to_json())
    done = run_training(spec, data, toks, model, train_config, max_seconds=args.max_seconds,
                        log=say)  # fmt: skip
    return done, spec, run_dir, world


def _data_spec(args: TrainArgs, tables: dict[str, Any]) -> tuple[DataSpec, Path]:
    """The data spec of a run from scratch (options over ``--config``'s ``[data]``) and its
    run folder; an error in the file's settings names the file."""
    try:
        spec = DataSpec.build(tables["data"], task=args.task, pairs=args.pairs, text=args.text,
                              seed=args.seed, **args.pick(*COLUMNS))  # fmt: skip
        if args.seed is None and "seed" not in tables["data"] and "seed" in tables["train"]:
            spec = DataSpec(**{**spec.to_json(), "seed": tables["train"]["seed"]})
        run_dir = args.out if args.out is not None else Path("runs") / Path(spec.source).stem
    except ValueError as err:
        raise ValueError(f"{args.config}: {err}" if args.config is not None else err) from None
    return spec, run_dir


def _header(spec: DataSpec, model: Any, config: Any, run_dir: Path, world: World) -> str:
    """The run's first line: the data, the model, the steps, where, on how many processes."""
    # user text (paths, a corpus name) is escaped: "[" in it is not rich markup
    parallel = ""
    if world.parallel:
        per_sequence = (f", {config.context_parallel} per sequence"
                        if config.context_parallel > 1 else "")  # fmt: skip
        parallel = f" ({world.size} processes, {'FSDP' if config.fsdp else 'DDP'}{per_sequence})"
    return (f"[bold]qkv train[/bold] {spec.kind} {escape(str(spec.source))} "
            f"({spec.tokenizer} tokenizer): {type(model).__name__}, "
            f"{model.num_parameters():,} parameters, {config.steps:,} steps → "
            f"{escape(str(run_dir))}{parallel}")  # fmt: skip


def _resume(console, run_dir: Path, steps, max_seconds, device):
    """Continue the run in ``run_dir`` from ``last``: its data spec, saved TrainConfig,
    model and tokenizers; ``(run_training's result, spec, run folder, world)``."""
    from qkv.checkpoint import load_checkpoint
    from qkv.train.config import TrainConfig

    if max_seconds is not None and max_seconds <= 0:
        raise ValueError(f"--max-seconds must be > 0, got {max_seconds}")
    spec = read_data_spec(run_dir)
    last = run_dir / "last"
    if spec is None or not last.is_dir():
        raise ValueError(f"--resume {run_dir}: not a qkv train run folder (expected "
                         f"{DATA_FILE} and last/ in it)")  # fmt: skip
    ckpt = load_checkpoint(last)
    saved = ckpt.train_state or {}
    if not isinstance(saved.get("config"), dict):
        raise ValueError(f"--resume {run_dir}: {last} holds no training state to continue")
    changes = {k: v for k, v in (("steps", steps), ("device", device)) if v is not None}
    train_config = TrainConfig.from_dict({**saved["config"], "run_dir": str(run_dir),
                                          **changes})  # fmt: skip
    if train_config.steps <= int(saved.get("step", 0)):
        raise ValueError(f"--resume {run_dir}: the run already did {saved.get('step')} of "
                         f"its {train_config.steps} steps; give --steps above that to go on")
    world = init_distributed(train_config.device)
    say = console.print if world.is_zero else _quiet
    notice = resume_notice(saved["config"], train_config, int(saved.get("step", 0)))
    if notice is not None:
        say(notice, markup=False)
    data = load_dataset(spec)
    toks = run_tokenizers(last, spec.kind)
    say(f"[bold]qkv train --resume[/bold] {escape(str(run_dir))}: step {saved.get('step')} → "
        f"{train_config.steps:,}")  # fmt: skip
    done = run_training(spec, data, toks, ckpt.model, train_config, max_seconds=max_seconds,
                        log=say, resume=last)  # fmt: skip
    return done, spec, run_dir, world


def resume_notice(saved: dict[str, Any], config: Any, step: int) -> str | None:
    """The one line ``qkv train --resume`` prints when its ``--steps`` changes the run's plan
    (``saved``: the TrainConfig the run was last trained with, as a dict; ``config``: the
    one it resumes with, at ``step`` steps done), or None when the plan is the same.

    A cosine schedule decays to its floor at the last step, so a new total re-plans the
    learning rate from the next step on: the line says from what to what. The other
    schedules do not depend on the total; only the end of the run moves.
    """
    from qkv.train.config import TrainConfig
    from qkv.train.schedules import lr_at

    planned = saved.get("steps")
    if not isinstance(planned, int) or planned == config.steps:
        return None
    verb = "extends" if config.steps > planned else "shortens"
    head = (f"note: --steps {config.steps:,} {verb} the run, which was planned for "
            f"{planned:,} steps")  # fmt: skip
    if config.schedule != "cosine":
        return (f"{head}; its {config.schedule} learning-rate schedule does not depend on the "
                "total, so only the end of the run moves")  # fmt: skip
    nxt = step + 1
    try:
        before = TrainConfig.from_dict({**config.to_dict(), "steps": planned})
        change = f" (step {nxt:,}: lr {lr_at(nxt, before):.2e} -> {lr_at(nxt, config):.2e})"
    except ValueError:  # a plan TrainConfig would refuse today: say it without the numbers
        change = ""
    return (f"{head}: the cosine learning-rate schedule is re-planned to reach its floor at step "
            f"{config.steps:,} instead of {planned:,}{change}")  # fmt: skip


def _quiet(*args: Any, **kwargs: Any) -> None:
    """Ranks other than 0 print nothing."""


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically (a crash leaves the old file or the new one)."""
    import json

    from qkv.inspect.files import atomic_write

    atomic_write(path, json.dumps(data, indent=1) + "\n")
