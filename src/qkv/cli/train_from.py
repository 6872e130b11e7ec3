"""``qkv train --from MODEL``: fine-tune a pretrained decoder, fully or with LoRA adapters.

The steps, each a library call (docs/fine-tuning.md shows them as code):

1. load the model and its tokenizer (:func:`qkv.pretrained.load`: a packaged name, a Hugging
   Face folder, a GGUF file or a qkv checkpoint of a decoder);
2. its data as documents: conversations (``--chat``, learned on the assistant turns only,
   :func:`qkv.pretrained.chat_documents`) or paragraphs of text (``--text``,
   :func:`qkv.pretrained.text_documents`); a seeded tenth (at most 200) held out to validate;
3. with ``--lora-rank``, adapters on the layers named by ``--lora-targets``, the rest frozen
   (:func:`qkv.nn.lora.add_lora`); without, every weight trains;
4. :func:`qkv.train.train_lm` on packed rows (documents never attend to each other), the
   validation loss before and after;
5. the best validation checkpoint's weights, merged (:func:`qkv.nn.lora.merge_lora`), written
   as a Hugging Face folder ``<out>/model`` (:func:`qkv.pretrained.save_hf`: qkv and
   transformers load it), and the adapters alone as ``<out>/adapters.safetensors``
   (:func:`qkv.checkpoint.save_adapters`), with ``<out>/finetune.json`` saying what was done.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from qkv.checkpoint import load_checkpoint
from qkv.checkpoint.adapters import save_adapters
from qkv.data.files import BadFileError, read_json
from qkv.distributed.data_parallel import World, barrier, current_world, init_distributed
from qkv.nn.lora import add_lora, merge_lora
from qkv.pretrained import DecoderBundle, chat_documents, load, save_hf, text_documents
from qkv.pretrained.chat_data import documents_learned
from qkv.train import TrainConfig, evaluate_lm, seed_everything, train_lm
from qkv.train.memory import bf16_note
from qkv.train.recipes import StopWhen

__all__ = ["DEFAULT_TARGETS", "FINETUNE_FILE", "FineTune", "LoRAOptions", "finetune", "plan",
           "resume_finetune"]

FINETUNE_FILE = "finetune.json"
# Attention's four projections, as PEFT's LoRA examples and the LoRA paper adapt.
DEFAULT_TARGETS = ("*.q_proj", "*.k_proj", "*.v_proj", "*.out_proj")
# Fine-tuning defaults (--config's training keys and the options win over them): AdamW
# without weight decay, a cosine schedule, packed rows of up to 512 tokens.
FINETUNE_TRAIN = dict(steps=200, batch_size=8, block_size=512, schedule="cosine",
                      weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip=1.0,
                      metric="loss", log_every=10, pack=True)  # fmt: skip
LR = {"lora": 2e-4, "full": 2e-5}
MAX_VALID = 200


@dataclass(frozen=True)
class LoRAOptions:
    """``--lora-rank``, ``--lora-alpha`` (default twice the rank), ``--lora-dropout`` and
    ``--lora-targets`` (comma-separated name patterns)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


@dataclass(frozen=True)
class FineTune:
    """What a fine-tuning run adapts, to what (``<out>/finetune.json``; ``--resume`` reads it).

    Attributes:
        base: ``--from``. data: ``--chat`` or ``--text``. kind: ``"chat"`` or ``"text"``.
        text_column: ``--text-column``. lora: the adapters, or None (full fine-tuning).
    """

    base: str
    data: str
    kind: str
    text_column: str | None
    lora: LoRAOptions | None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "lora": None if self.lora is None else asdict(self.lora)}

    @classmethod
    def read(cls, file: Path) -> FineTune:
        """Raises: BadFileError: a file ``finetune.json`` does not describe, named."""
        record = read_json(file)
        try:
            lora = record["lora"]
            return cls(record["base"], record["data"], record["kind"], record["text_column"],
                       None if lora is None else LoRAOptions(lora["rank"], lora["alpha"],
                       lora["dropout"], tuple(lora["targets"])))  # fmt: skip
        except (KeyError, TypeError) as err:
            why = f"no {err.args[0]!r} entry" if isinstance(err, KeyError) else str(err)
            raise BadFileError(f"{file}: not a qkv fine-tuning record ({why}); it is written "
                               "by qkv train --from", path=file) from None


def _bundle(name: str) -> DecoderBundle:
    """The pretrained decoder to fine-tune; anything else named by ``--from``."""
    bundle = load(name)
    if not isinstance(bundle, DecoderBundle):
        kind = {"EncoderBundle": "a sentence encoder", "Seq2SeqBundle": "an encoder-decoder",
                "SpeechBundle": "a speech model"}.get(type(bundle).__name__, "not a decoder")
        raise ValueError(f"--from {name}: {kind}; qkv train --from fine-tunes decoder "
                         "language models (GPT-2, Llama, Mistral, Qwen, Gemma 2, Phi-3 "
                         "folders, GGUF files, qkv text checkpoints)")  # fmt: skip
    if bundle.tokenizer is None:
        raise ValueError(f"--from {name}: the model has no tokenizer files to encode the data")
    return bundle


def plan(base: str, text: Path | None, chat: Path | None, text_column: str | None,
         lora: LoRAOptions | None) -> FineTune:  # fmt: skip
    """The options of ``qkv train --from`` as one record.

    Raises:
        ValueError: neither or both of ``--chat`` and ``--text``.
    """
    if (text is None) == (chat is None):
        raise ValueError("--from needs its data: --chat FILE.jsonl (conversations) or --text "
                         "PATH (plain text), one of them")  # fmt: skip
    data, kind = (chat, "chat") if chat is not None else (text, "text")
    return FineTune(base, str(data), kind, text_column, lora)


def _documents(bundle: DecoderBundle, spec: FineTune) -> list:
    """The fine-tuning documents of ``--chat`` or ``--text``."""
    from qkv.data.records import RECORD_SUFFIXES, load_records_text
    from qkv.data.text import load_text

    data = Path(spec.data)
    if spec.kind == "chat":
        return chat_documents(bundle.tokenizer, data)
    records = data.is_file() and data.suffix.lower() in RECORD_SUFFIXES
    body = load_records_text(data, key=spec.text_column or "text") if records else load_text(data)
    return text_documents(bundle.tokenizer, body, eos_id=bundle.eos_id)


def _split(docs: list, seed: int) -> tuple[list, list | None]:
    """A seeded tenth of the documents (1 to :data:`MAX_VALID`) held out; none under 10."""
    if len(docs) < 10:
        return docs, None
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    n = min(MAX_VALID, len(docs) // 10)
    held = set(order[:n])
    return [d for i, d in enumerate(docs) if i not in held], [docs[i] for i in sorted(held)]


def _config(table: dict[str, Any], options: dict[str, Any], lora: LoRAOptions | None,
            max_len: int) -> TrainConfig:  # fmt: skip
    """Fine-tuning defaults, then ``--config``'s training keys, then the options."""
    given = {k: v for k, v in options.items() if v is not None}
    fields = {**FINETUNE_TRAIN, "lr": LR["lora" if lora else "full"], **table, **given}
    if "block_size" not in table:  # the default, shortened to the model's positions
        fields["block_size"] = min(fields["block_size"], max_len)
    if "warmup" not in table:
        fields["warmup"] = max(1, fields["steps"] // 10)
    if "eval_every" not in table and "eval_every" not in given:
        fields["eval_every"] = max(1, fields["steps"] // 4)
    if fields.get("context_parallel", 1) != 1:
        raise ValueError(f"--context-parallel {fields['context_parallel']}: fine-tuning "
                         "(--from) trains on packed documents, which context parallelism does "
                         "not take yet; drop --context-parallel")  # fmt: skip
    config = TrainConfig.from_dict(fields)
    if config.block_size > max_len:
        raise ValueError(f"block_size {config.block_size} is longer than the model's "
                         f"{max_len} positions; lower it in --config")  # fmt: skip
    return config


def _adapt(bundle: DecoderBundle, lora: LoRAOptions | None) -> str:
    """Adapters on the model (or every weight trainable); a line saying which."""
    model = bundle.model
    total = sum(p.numel() for p in model.parameters())
    if lora is None:
        for p in model.parameters():
            p.requires_grad_(True)
        return f"full fine-tuning, {total:,} parameters"
    try:
        layers = add_lora(model, list(lora.targets), rank=lora.rank, alpha=lora.alpha,
                          dropout=lora.dropout)  # fmt: skip
    except ValueError as err:
        raise ValueError(f"--lora-targets: {err}") from None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (f"LoRA r={lora.rank} alpha={lora.alpha:g} on {len(layers)} layers: "
            f"{trainable:,} of {total:,} parameters train")  # fmt: skip


def finetune(spec: FineTune, *, run_dir: Path, table: dict[str, Any],
             options: dict[str, Any], max_seconds: float | None,
             say: Any) -> tuple[dict[str, Any], World]:  # fmt: skip
    """Steps 1-5 of the module docstring; ``(what was done, the world)``.

    Raises:
        ValueError: a model that cannot be fine-tuned, missing or bad data (naming the file
            and line), bad LoRA options or training settings (naming the option).
    """
    bundle = _bundle(spec.base)
    docs = _documents(bundle, spec)
    config = _config(table, {**options, "run_dir": str(run_dir)}, spec.lora,
                     bundle.model.config.max_len)  # fmt: skip
    world = init_distributed(config.device)
    if (run_dir / "last").exists() or (run_dir / FINETUNE_FILE).exists():
        raise ValueError(f"--out {run_dir} already holds a run; choose another folder")
    seed_everything(config.seed)  # one seed, one initial adapter (A is drawn at random)
    adapted = _adapt(bundle, spec.lora)
    barrier()  # every rank has looked before rank 0 writes
    if world.is_zero:
        _record(run_dir, spec, {"status": "training"})
    return _train(bundle, spec, docs, config, run_dir, adapted, say, max_seconds, None), world


def resume_finetune(run_dir: Path, steps: int | None, max_seconds: float | None,
                    device: str | None, say: Any) -> tuple[dict[str, Any], World]:  # fmt: skip
    """Continue a fine-tuning run from ``<run_dir>/last``: the same base model, data and
    adapters (``finetune.json``), its saved training settings (``--steps`` may raise the
    total), the weights, optimizer, data position and random state of ``last``.

    Raises:
        ValueError: no ``last`` checkpoint, or ``--steps`` not above the steps done.
        BadFileError: a ``finetune.json`` that is not a fine-tuning record.
    """
    spec, last = FineTune.read(run_dir / FINETUNE_FILE), run_dir / "last"
    if not (last / "config.json").is_file():
        raise ValueError(f"--resume {run_dir}: no last/ checkpoint to continue from (the run "
                         "stopped before its first save)")  # fmt: skip
    bundle = _bundle(spec.base)
    adapted = _adapt(bundle, spec.lora)
    saved = load_checkpoint(last, bundle.model).train_state or {}
    changes = {k: v for k, v in (("steps", steps), ("device", device)) if v is not None}
    config = TrainConfig.from_dict({**saved["config"], "run_dir": str(run_dir), **changes})
    if config.steps <= int(saved.get("step", 0)):
        raise ValueError(f"--resume {run_dir}: the run already did {saved.get('step')} of its "
                         f"{config.steps} steps; give --steps above that to go on")  # fmt: skip
    world = init_distributed(config.device)
    say(f"qkv train --resume {run_dir}: step {saved.get('step')} → {config.steps:,}")
    docs = _documents(bundle, spec)
    return _train(bundle, spec, docs, config, run_dir, adapted, say, max_seconds, last), world


def _train(bundle: DecoderBundle, spec: FineTune, docs: list, config: TrainConfig,
           run_dir: Path, adapted: str, say: Any, max_seconds: float | None,
           resume: Path | None) -> dict[str, Any]:  # fmt: skip
    """Validate, train (or go on from ``resume``), keep the best weights, validate, write."""
    train_docs, valid_docs = _split(docs, config.seed)
    what = "conversations" if spec.kind == "chat" else "paragraphs"
    say(f"qkv train --from {spec.base}: {adapted}; {len(train_docs):,} {what} "
        f"({documents_learned(train_docs):,} tokens to learn), "
        f"{len(valid_docs or []):,} held out; {config.steps:,} steps → {run_dir}")  # fmt: skip
    note = bf16_note(config.device) if config.bf16 else None
    if note is not None:
        say(note)
    model = bundle.model.to(config.device)
    before = _validate(model, valid_docs, config)
    callbacks = [StopWhen(config.metric, None, max_seconds)] if max_seconds else []
    result = train_lm(model, train_docs, config, valid_ids=valid_docs, callbacks=callbacks,
                      resume=resume)  # fmt: skip
    if (run_dir / "best").is_dir():  # the best validation step's weights
        load_checkpoint(run_dir / "best", model)
    after = _validate(model, valid_docs, config)
    done = {"result": result, "before": before, "after": after}
    if current_world().is_zero:
        _write(bundle, run_dir, spec, done)
    return done


def _validate(model: torch.nn.Module, docs: list | None, config: TrainConfig
              ) -> dict[str, float] | None:  # fmt: skip
    if not docs:
        return None
    return evaluate_lm(model, docs, block_size=config.block_size, batch_size=config.batch_size,
                       pack=True, distributed=current_world().parallel)  # fmt: skip


def _write(bundle: DecoderBundle, run_dir: Path, spec: FineTune, done: dict[str, Any]) -> None:
    """Adapters, the merged model as a Hugging Face folder, and ``finetune.json``."""
    if spec.lora is not None:
        save_adapters(bundle.model, run_dir / "adapters.safetensors")
        merge_lora(bundle.model)
    bundle.model.eval()
    save_hf(bundle, run_dir / "model", overwrite=True)
    _record(run_dir, spec, {"status": "done", "steps": done["result"].steps,
                            "validation_before": done["before"],
                            "validation_after": done["after"]})  # fmt: skip


def _record(run_dir: Path, spec: FineTune, extra: dict[str, Any]) -> None:
    """``finetune.json``, written atomically (at the start, then with the results)."""
    from qkv.inspect.files import atomic_write

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / FINETUNE_FILE, json.dumps({**spec.to_json(), **extra},
                                                     indent=1) + "\n")  # fmt: skip


def lora_options(rank: int | None, alpha: float | None, dropout: float | None,
                 targets: str | None) -> LoRAOptions | None:  # fmt: skip
    """The ``--lora-*`` options as one record (None: full fine-tuning).

    Raises:
        ValueError: naming the option: LoRA shape options without ``--lora-rank``, a rank
            below 1, a negative or non-finite alpha, a dropout outside [0, 1), no pattern.
    """
    if rank is None:
        given = [n for n, v in (("--lora-alpha", alpha), ("--lora-dropout", dropout),
                                ("--lora-targets", targets)) if v is not None]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)} shape LoRA adapters: give --lora-rank too")
        return None
    if rank < 1:
        raise ValueError(f"--lora-rank must be an int >= 1, got {rank}")
    alpha = 2.0 * rank if alpha is None else alpha
    if not 0 <= alpha < float("inf"):
        raise ValueError(f"--lora-alpha must be a finite number >= 0, got {alpha}")
    dropout = 0.0 if dropout is None else dropout
    if not 0 <= dropout < 1:
        raise ValueError(f"--lora-dropout must lie in [0, 1), got {dropout}")
    text = ",".join(DEFAULT_TARGETS) if targets is None else targets
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    if not patterns:
        raise ValueError(f"--lora-targets must name layer patterns such as '*.q_proj,*.v_proj', "
                         f"got {targets!r}")  # fmt: skip
    return LoRAOptions(rank, float(alpha), float(dropout), patterns)


def refuse_clashes(given: dict[str, Any]) -> None:
    """``--from`` brings its model, tokenizer and data kind: the options that shape a model
    from scratch (``given``: option -> value, None when absent) are refused, named."""
    clash = [k for k, v in given.items() if v is not None]
    if clash:
        raise ValueError(f"--from fine-tunes a pretrained model with its own architecture and "
                         f"tokenizer; drop {', '.join(clash)}")  # fmt: skip


def report(console: Any, done: dict[str, Any], run_dir: Path, world: World) -> None:
    """Rank 0's closing lines of a fine-tuning run."""
    result, before, after = done["result"], done["before"], done["after"]
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
