"""``qkv train``: train a model from scratch on a synthetic task, a TSV of pairs or any text.

Tasks and pairs train a :class:`~qkv.models.Seq2SeqTransformer` with character tokenizers;
text trains a GPT-2-style :class:`~qkv.models.DecoderLM`. The run folder (``--out``) receives
the checkpoints (``best``, ``last``), ``metrics.jsonl``, ``loss.png`` and ``data.json`` (the
data spec, for ``qkv eval``). The settings are described in :mod:`qkv.cli.runs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console

from qkv.cli.runs import DATA_FILE, Dataset, DataSpec, fail, load_dataset, read_toml

__all__ = [
    "build_model",
    "build_train_config",
    "command",
    "make_tokenizers",
    "metrics_line",
    "run_training",
]

NAME = "train"

# Defaults under the config file and the options, per kind of model; the encoder-decoder's
# are the date recipe's (qkv.train.recipes), which also suit the other synthetic tasks.
SEQ2SEQ_TRAIN = dict(steps=1000, batch_size=128, lr=2e-3, schedule="cosine", warmup=100,
                     label_smoothing=0.1, eval_every=100, eval_examples=500,
                     metric="exact_match", log_every=50)  # fmt: skip
LM_TRAIN = dict(steps=1000, batch_size=32, lr=1e-3, schedule="cosine", warmup=100,
                eval_every=200, metric="loss", log_every=50, block_size=128)
SEQ2SEQ_MODEL = dict(d_model=64, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                     dropout=0.0, norm="pre", positions="rope")  # fmt: skip
LM_MODEL = dict(d_model=128, num_layers=4, num_heads=4, dropout=0.0)


def build_train_config(kind: str, table: dict[str, Any], options: dict[str, Any]):
    """A :class:`~qkv.train.TrainConfig`: defaults, then the file's keys, then the options.

    Raises:
        ValueError: an unknown key or a bad value (the message names it).
    """
    from qkv.train import TrainConfig

    base = LM_TRAIN if kind == "text" else SEQ2SEQ_TRAIN
    given = {k: v for k, v in options.items() if v is not None}
    fields = {**base, **table, **given}
    if "warmup" not in table and isinstance(fields.get("steps"), int):
        # a tenth of a short run, at most the default: --steps 50 still reaches its peak lr
        fields["warmup"] = max(1, min(base["warmup"], fields["steps"] // 10))
    return TrainConfig.from_dict(fields)


def build_model(kind: str, table: dict[str, Any], options: dict[str, Any], vocab: dict[str, int],
                block_size: int):  # fmt: skip
    """The model: ``[model]`` keys over the defaults, the options over both.

    Args:
        kind: the data kind (``"text"`` builds a DecoderLM, others a Seq2SeqTransformer).
        table: the config file's ``[model]`` table.
        options: ``d_model``, ``layers``, ``heads`` from the command line (None = not given).
        vocab: ``{"src": V, "tgt": V}`` or ``{"text": V}``.
        block_size: the LM's window (its ``max_len``).

    Raises:
        ValueError: an unknown key or a bad value.
    """
    from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer

    d, layers, heads = options.get("d_model"), options.get("layers"), options.get("heads")
    if kind == "text":
        cli = {"d_model": d, "num_layers": layers, "num_heads": heads}
        fields = {**LM_MODEL, "max_len": block_size, **table}
        fields.update({k: v for k, v in cli.items() if v is not None})
        base = DecoderLMConfig.gpt2_style(vocab["text"]).to_dict()
        return DecoderLM(DecoderLMConfig.from_dict({**base, **fields, "vocab_size": vocab["text"]}))
    cli = {"d_model": d, "num_encoder_layers": layers, "num_decoder_layers": layers,
           "num_heads": heads}  # fmt: skip
    fields = {**SEQ2SEQ_MODEL, **table}
    fields.update({k: v for k, v in cli.items() if v is not None})
    fields.setdefault("d_ff", 4 * fields["d_model"])
    fields.update(src_vocab_size=vocab["src"], tgt_vocab_size=vocab["tgt"])
    return Seq2SeqTransformer(Seq2SeqConfig.from_dict(fields))


def make_tokenizers(spec: DataSpec, data: Dataset) -> dict[str, Any]:
    """Character tokenizers fitted on the training split: ``{"text"}`` or ``{"src", "tgt"}``."""
    from qkv.data import CharTokenizer

    if spec.kind == "text":
        return {"text": CharTokenizer.fit(data.train)}
    return {"src": CharTokenizer.fit(s for s, _ in data.train),
            "tgt": CharTokenizer.fit(t for _, t in data.train)}  # fmt: skip


def run_training(spec: DataSpec, data: Dataset, toks: dict[str, Any], model, config, *,
                 max_seconds: float | None, console: Console) -> dict[str, Any]:  # fmt: skip
    """Train and test; returns ``{"result", "test": metrics, "split": name}``.

    Raises:
        ValueError, ImportError: from training and evaluation.
    """
    from qkv.train import evaluate_lm, evaluate_seq2seq, train_lm, train_seq2seq
    from qkv.train.recipes import StopWhen

    callbacks = [StopWhen(config.metric, None, max_seconds)] if max_seconds else []
    if spec.kind == "text":
        tok = toks["text"]
        ids, valid = tok.encode(data.train), tok.encode(data.valid)
        console.print(f"text: {len(ids):,} training and {len(valid):,} validation characters, "
                      f"vocabulary {tok.vocab_size}")  # fmt: skip
        result = train_lm(model, ids, config, valid_ids=valid, tokenizer=tok, callbacks=callbacks)
        _keep_best(model, result)
        test = evaluate_lm(model, valid, block_size=config.block_size,
                           batch_size=config.batch_size or 32)  # fmt: skip
        return {"result": result, "test": test, "split": "validation"}
    src_tok, tgt_tok = toks["src"], toks["tgt"]
    console.print(f"pairs: {len(data.train):,} training, {len(data.valid):,} validation, "
                  f"{len(data.test):,} test")  # fmt: skip
    result = train_seq2seq(model, data.train, src_tok, tgt_tok, config, valid=data.valid,
                           callbacks=callbacks)  # fmt: skip
    _keep_best(model, result)
    test = evaluate_seq2seq(model, data.test, src_tok, tgt_tok, batch_size=256)
    return {"result": result, "test": test, "split": "test"}


def command(
    task: Annotated[str | None, typer.Argument(
        help="A synthetic task: copy, reverse, sort, addition or dates.", show_default=False,
    )] = None,
    text: Annotated[Path | None, typer.Option(
        "--text", help="Train a language model on this text file or folder.",
    )] = None,
    pairs: Annotated[Path | None, typer.Option(
        "--pairs", help="Train a translation model on this TSV file (source<TAB>target).",
    )] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", help="A TOML file: TrainConfig keys, \\[data] and \\[model] tables.",
    )] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="The run folder (default runs/<task or file name>); must not hold a run.",
    )] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Optimizer steps.")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="Examples per step.")] = (
        None
    ),
    lr: Annotated[float | None, typer.Option("--lr", help="Peak learning rate.")] = None,
    eval_every: Annotated[int | None, typer.Option(
        "--eval-every", help="Validate every this many steps.",
    )] = None,
    d_model: Annotated[int | None, typer.Option("--d-model", help="Model width.")] = None,
    layers: Annotated[int | None, typer.Option(
        "--layers", help="Blocks (per stack for encoder-decoders).",
    )] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="Attention heads.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seeds data and training.")] = None,
    max_seconds: Annotated[float | None, typer.Option(
        "--max-seconds", help="Stop training after this many seconds.",
    )] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu, cuda, ...")] = None,
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, help="CPU threads for torch (default: torch's own).",
    )] = None,
) -> None:
    """Train a transformer from scratch: a synthetic task, a TSV of pairs, or any text.

    Tasks and TSV pairs train an encoder-decoder; text trains a GPT-2-style language model.
    --out receives the checkpoints, metrics.jsonl, loss.png and data.json (for qkv eval).
    The test metrics follow: exact match, BLEU, chrF (loss and perplexity for text).
    Options win over the --config file.

    [bold]Example:[/bold] qkv train dates --steps 800 --out runs/dates
    """
    console = Console(highlight=False, soft_wrap=True)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if max_seconds is not None and max_seconds <= 0:
            raise ValueError(f"--max-seconds must be > 0, got {max_seconds}")
        tables = read_toml(config) if config is not None else {"train": {}, "data": {},
                                                                  "model": {}}  # fmt: skip
        try:
            spec = DataSpec.build(tables["data"], task=task, pairs=pairs, text=text, seed=seed)
            if seed is None and "seed" not in tables["data"] and "seed" in tables["train"]:
                spec = DataSpec(**{**spec.to_json(), "seed": tables["train"]["seed"]})
            run_dir = out if out is not None else Path("runs") / Path(spec.source).stem
            options = dict(steps=steps, batch_size=batch_size, lr=lr, eval_every=eval_every,
                           seed=seed, device=device, run_dir=str(run_dir))  # fmt: skip
            train_config = build_train_config(spec.kind, tables["train"], options)
        except ValueError as err:
            raise ValueError(f"{config}: {err}" if config is not None else err) from None
        if (run_dir / "last").exists() or (run_dir / DATA_FILE).exists():
            raise ValueError(f"--out {run_dir} already holds a run; choose another folder")
        data = load_dataset(spec)
        toks = make_tokenizers(spec, data)
        vocab = {role: tok.vocab_size for role, tok in toks.items()}
        try:
            model = build_model(spec.kind, tables["model"], dict(d_model=d_model, layers=layers,
                                heads=heads), vocab, train_config.block_size)  # fmt: skip
        except ValueError as err:
            raise ValueError(f"{config}: [model] {err}" if config is not None else err) from None
        console.print(f"[bold]qkv train[/bold] {spec.kind} {spec.source}: "
                      f"{type(model).__name__}, {model.num_parameters():,} parameters, "
                      f"{train_config.steps:,} steps → {run_dir}")  # fmt: skip
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / DATA_FILE, spec.to_json())
        done = run_training(spec, data, toks, model, train_config, max_seconds=max_seconds,
                            console=console)  # fmt: skip
    except (ValueError, TypeError, FileNotFoundError, ImportError, OSError) as err:
        raise fail(err) from None
    result, test = done["result"], done["test"]
    console.print(f"trained {result.steps:,} steps in {result.seconds:.1f} s "
                  f"({result.tokens_per_second:,.0f} tokens/s)")  # fmt: skip
    console.print(f"{done['split']}: " + metrics_line(test))
    console.print(f"checkpoint: {run_dir / 'best'}")
    if spec.kind != "text":
        console.print(f"next: qkv translate {run_dir} \"...\"   or   qkv eval {run_dir}")


def _keep_best(model, result) -> None:
    """Load the ``best`` checkpoint's weights when later steps did not improve on it, so the
    test metrics printed are those of the checkpoint ``qkv eval`` and ``qkv translate`` use."""
    from qkv.train import load_checkpoint

    if result.run_dir is not None and result.best_step not in (None, result.steps):
        load_checkpoint(result.run_dir / "best", model)
    model.eval()


def metrics_line(metrics: dict[str, float]) -> str:
    """``exact match 99.2%  BLEU 98.1  chrF 99.0`` or ``loss 1.234  perplexity 3.43``."""
    parts = []
    for key, value in metrics.items():
        if key == "exact_match":
            parts.append(f"exact match {value:.1%}")
        elif key == "token_accuracy":
            parts.append(f"token accuracy {value:.1%}")
        elif key in ("bleu", "chrf"):
            parts.append(f"{'BLEU' if key == 'bleu' else 'chrF'} {value:.1f}")
        else:
            parts.append(f"{key} {value:.4g}")
    return "  ".join(parts)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    import json

    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
