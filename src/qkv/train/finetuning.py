"""Fine-tuning a pretrained decoder, fully or with LoRA adapters: :func:`finetune` runs a
:class:`~qkv.train.finetune_spec.FineTuneSpec`, :func:`resume_finetune` continues its run folder.

The steps, each a library call:

1. the model and its tokenizer (:func:`qkv.pretrained.load`: a packaged name, a Hugging Face
   folder, a GGUF file or a qkv checkpoint of a decoder; or a bundle already loaded);
2. its data as documents: conversations (learned on the assistant turns only,
   :func:`qkv.pretrained.chat_documents`) or paragraphs of text
   (:func:`qkv.pretrained.text_documents`), or the documents given; a seeded tenth (at most
   200, none under 10 documents) held out to validate;
3. with LoRA, adapters on the layers the options name, the rest frozen
   (:func:`qkv.nn.lora.add_lora`); without, every weight trains;
4. :func:`qkv.train.train_lm` on packed rows (documents never attend to each other), the
   validation loss before and after;
5. the best validation checkpoint's weights, merged (:func:`qkv.nn.lora.merge_lora`), written
   as a Hugging Face folder ``<out>/model`` (:func:`qkv.pretrained.save_hf`: qkv and
   transformers load it), and the adapters alone as ``<out>/adapters.safetensors``
   (:func:`qkv.checkpoint.save_adapters`), with ``<out>/finetune.json`` saying what was done.

Under ``torchrun`` every rank calls it with the same spec and the run is data-parallel; rank 0
alone prints (through ``say``) and writes the folder.

Example::

    from qkv.train import FineTuneSpec, LoRAOptions, finetune

    run = finetune(FineTuneSpec("SmolLM2-135M-Instruct", "chats.jsonl", "runs/chat",
                                lora=LoRAOptions(rank=8), train={"steps": 100}))
    print(run.after)  # held-out loss and token accuracy
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkv.checkpoint import load_checkpoint
from qkv.checkpoint.adapters import save_adapters
from qkv.distributed.data_parallel import World, barrier, current_world, init_distributed
from qkv.nn.lora import add_lora, merge_lora
from qkv.pretrained import DecoderBundle, chat_documents, load, save_hf, text_documents
from qkv.pretrained.chat_data import documents_learned
from qkv.train.config import TrainConfig
from qkv.train.finetune_spec import (
    FINETUNE_FILE,
    PYTHON_WORDS,
    FineTuneSpec,
    Words,
    finetune_config,
    write_record,
)
from qkv.train.lm import evaluate_lm, train_lm
from qkv.train.loop import TrainResult, seed_everything
from qkv.train.memory import bf16_note
from qkv.train.recipes import StopWhen

__all__ = ["FineTuneRun", "finetune", "resume_finetune"]

MAX_VALID = 200
Say = Callable[[str], Any]


@dataclass(frozen=True)
class FineTuneRun:
    """What a fine-tuning run did.

    Attributes:
        spec: what it was given. result: :func:`~qkv.train.train_lm`'s record.
        before, after: the held-out ``loss``, ``perplexity`` and ``token_accuracy`` before
            and after training (None without held-out documents: fewer than 10).
        world: the processes it ran on (``world.size`` under torchrun).
    """

    spec: FineTuneSpec
    result: TrainResult
    before: dict[str, float] | None
    after: dict[str, float] | None
    world: World

    @property
    def run_dir(self) -> Path:
        return Path(self.spec.out)


def finetune(spec: FineTuneSpec, *, max_seconds: float | None = None, say: Say = print,
             words: Words = PYTHON_WORDS) -> FineTuneRun:  # fmt: skip
    """Steps 1-5 of the module docstring on ``spec``; ``<spec.out>`` receives the run.

    Args:
        spec: the base model, data, LoRA options, training settings and run folder.
        max_seconds: stop training after this many seconds (None: run every step).
        say: called with each line to show (rank 0 only), e.g. ``print``.
        words: how messages name the spec's fields (``qkv train`` passes its options').

    Raises:
        ValueError: a model that cannot be fine-tuned, missing or bad data (naming the file
            and line), bad LoRA targets or training settings (naming them), a run folder
            that already holds a run.
    """
    bundle = _bundle(spec.base, words)
    docs = _documents(bundle, spec, words)
    config = finetune_config(spec, bundle.model.config.max_len, words)
    world = init_distributed(config.device)
    run_dir = Path(spec.out)
    if (run_dir / "last").exists() or (run_dir / FINETUNE_FILE).exists():
        raise ValueError(f"{words.out} {run_dir} already holds a run; choose another folder")
    seed_everything(config.seed)  # one seed, one initial adapter (A is drawn at random)
    adapted = _adapt(bundle, spec, words)
    barrier()  # every rank has looked before rank 0 writes
    if world.is_zero:
        write_record(spec, {"status": "training"})
    _say(say)(f"{words.command} {_name(spec.base)}: {adapted}; " + _data_line(spec, docs, config))
    return _train(bundle, spec, docs, config, say, max_seconds, None, world)


def resume_finetune(run_dir: str | os.PathLike, *, steps: int | None = None,
                    max_seconds: float | None = None, device: str | None = None,
                    base: Any = None, data: Any = None, say: Say = print,
                    words: Words = PYTHON_WORDS) -> FineTuneRun:  # fmt: skip
    """Continue a fine-tuning run from ``<run_dir>/last``: the same base model, data and
    adapters (``finetune.json``), its saved training settings (``steps`` may raise the
    total), the weights, optimizer, data position and random state of ``last``; the run then
    ends as an uninterrupted one would.

    Args:
        run_dir: the run folder :func:`finetune` wrote.
        steps: the new total of steps (None: the run's own).
        device: where to go on (None: where it trained).
        base, data: the base model and documents again, when the run was given them in
            memory (``finetune.json`` records paths and names only); ``base`` must be the
            model as it was before fine-tuning (a fresh load), not the adapted one.
        max_seconds, say, words: as for :func:`finetune`.

    Raises:
        ValueError: no ``last`` checkpoint, ``steps`` not above the steps done, or a model
            or documents given in memory and not given again.
        BadFileError: a ``finetune.json`` that is not a fine-tuning record.
    """
    run_dir = Path(run_dir)
    spec, last = FineTuneSpec.read(run_dir / FINETUNE_FILE), run_dir / "last"
    spec = _given_again(spec, base, data, run_dir, words)
    if not (last / "config.json").is_file():
        raise ValueError(f"{words.resume} {run_dir}: no last/ checkpoint to continue from (the "
                         "run stopped before its first save)")  # fmt: skip
    bundle = _bundle(spec.base, words)
    adapted = _adapt(bundle, spec, words)
    saved = load_checkpoint(last, bundle.model).train_state or {}
    changes = {k: v for k, v in (("steps", steps), ("device", device)) if v is not None}
    config = TrainConfig.from_dict({**saved["config"], "run_dir": str(run_dir), **changes})
    if config.steps <= int(saved.get("step", 0)):
        raise ValueError(f"{words.resume} {run_dir}: the run already did {saved.get('step')} "
                         f"of its {config.steps} steps; give {words.steps} above that to go "
                         "on")  # fmt: skip
    world = init_distributed(config.device)
    _say(say)(f"{words.resume_command} {run_dir}: step {saved.get('step')} → {config.steps:,}")
    docs = _documents(bundle, spec, words)
    _say(say)(f"{words.command} {_name(spec.base)}: {adapted}; "
              + _data_line(spec, docs, config))  # fmt: skip
    return _train(bundle, spec, docs, config, say, max_seconds, last, world)


def _given_again(spec: FineTuneSpec, base: Any, data: Any, run_dir: Path, words: Words
                 ) -> FineTuneSpec:  # fmt: skip
    """``spec`` with the model and documents given in memory given again."""
    for name, given, recorded in (("base", base, spec.base), ("data", data, spec.data)):
        if given is None and recorded is None:
            raise ValueError(f"{words.resume} {run_dir}: the run's {name} was given in memory "
                             f"(finetune.json records none); pass {name}= again")  # fmt: skip
    return dataclasses.replace(spec, base=spec.base if base is None else base,
                               data=spec.data if data is None else data)  # fmt: skip


def _say(say: Say) -> Say:
    """``say`` on rank 0 only (the world is known once the run has started)."""
    return lambda line: say(line) if current_world().is_zero else None


def _name(base: Any) -> str:
    return base.name if isinstance(base, DecoderBundle) else str(base)


def _bundle(base: Any, words: Words) -> DecoderBundle:
    """The pretrained decoder to fine-tune; anything else is refused, named."""
    if base is None:
        raise ValueError(f"{words.base} is None; give a model name or path, or a DecoderBundle")
    bundle = base if isinstance(base, DecoderBundle) else load(base)
    if not isinstance(bundle, DecoderBundle):
        kind = {"EncoderBundle": "a sentence encoder", "Seq2SeqBundle": "an encoder-decoder",
                "SpeechBundle": "a speech model"}.get(type(bundle).__name__, "not a decoder")
        raise ValueError(f"{words.base} {_name(base)}: {kind}; {words.command} fine-tunes "
                         "decoder language models (GPT-2, Llama, Mistral, Qwen, Gemma 2, "
                         "Phi-3 folders, GGUF files, qkv text checkpoints)")  # fmt: skip
    return bundle


def _is_path(value: Any) -> bool:
    return isinstance(value, str | os.PathLike)


def _documents(bundle: DecoderBundle, spec: FineTuneSpec, words: Words) -> list:
    """The fine-tuning documents: those given, or those of the chat file or text."""
    from qkv.data.records import RECORD_SUFFIXES, load_records_text
    from qkv.data.text import load_text

    if spec.data is None:
        raise ValueError("FineTuneSpec.data is None; give a path or the documents")
    if not _is_path(spec.data):
        return list(spec.data)
    if bundle.tokenizer is None:
        raise ValueError(f"{words.base} {_name(spec.base)}: the model has no tokenizer files "
                         "to encode the data")  # fmt: skip
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


def _adapt(bundle: DecoderBundle, spec: FineTuneSpec, words: Words) -> str:
    """Adapters on the model (or every weight trainable); a line saying which."""
    model, lora = bundle.model, spec.lora
    total = sum(p.numel() for p in model.parameters())
    if lora is None:
        for p in model.parameters():
            p.requires_grad_(True)
        return f"full fine-tuning, {total:,} parameters"
    try:
        layers = add_lora(model, list(lora.targets), rank=lora.rank, alpha=lora.alpha,
                          dropout=lora.dropout)  # fmt: skip
    except ValueError as err:
        raise ValueError(f"{words.lora_targets}: {err}") from None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (f"LoRA r={lora.rank} alpha={lora.alpha:g} on {len(layers)} layers: "
            f"{trainable:,} of {total:,} parameters train")  # fmt: skip


def _data_line(spec: FineTuneSpec, docs: list, config: TrainConfig) -> str:
    """The rest of the first line: the documents, held out, steps, where."""
    train_docs, valid_docs = _split(docs, config.seed)
    what = "conversations" if spec.kind == "chat" else "paragraphs"
    return (f"{len(train_docs):,} {what} ({documents_learned(train_docs):,} tokens to learn), "
            f"{len(valid_docs or []):,} held out; {config.steps:,} steps → {spec.out}")


def _train(bundle: DecoderBundle, spec: FineTuneSpec, docs: list, config: TrainConfig,
           say: Say, max_seconds: float | None, resume: Path | None,
           world: World) -> FineTuneRun:  # fmt: skip
    """Validate, train (or go on from ``resume``), keep the best weights, validate, write."""
    train_docs, valid_docs = _split(docs, config.seed)
    note = bf16_note(config.device) if config.bf16 else None
    if note is not None:
        _say(say)(note)
    model = bundle.model.to(config.device)
    before = _validate(model, valid_docs, config)
    callbacks = [StopWhen(config.metric, None, max_seconds)] if max_seconds else []
    result = train_lm(model, train_docs, config, valid_ids=valid_docs, callbacks=callbacks,
                      resume=resume)  # fmt: skip
    run_dir = Path(spec.out)
    if (run_dir / "best").is_dir():  # the best validation step's weights
        load_checkpoint(run_dir / "best", model)
    after = _validate(model, valid_docs, config)
    run = FineTuneRun(spec, result, before, after, world)
    if current_world().is_zero:
        _write(bundle, run)
    return run


def _validate(model: torch.nn.Module, docs: list | None, config: TrainConfig
              ) -> dict[str, float] | None:  # fmt: skip
    if not docs:
        return None
    return evaluate_lm(model, docs, block_size=config.block_size, batch_size=config.batch_size,
                       pack=True, distributed=current_world().parallel)  # fmt: skip


def _write(bundle: DecoderBundle, run: FineTuneRun) -> None:
    """Adapters, the merged model as a Hugging Face folder, and ``finetune.json``."""
    run_dir = run.run_dir
    if run.spec.lora is not None:
        save_adapters(bundle.model, run_dir / "adapters.safetensors")
        merge_lora(bundle.model)
    bundle.model.eval()
    save_hf(bundle, run_dir / "model", overwrite=True)
    write_record(run.spec, {"status": "done", "steps": run.result.steps,
                       "validation_before": run.before, "validation_after": run.after})
