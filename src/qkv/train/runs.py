"""A training run from a :class:`~qkv.train.spec.DataSpec`: build, train, test, and read back.

What ``qkv train``, ``qkv eval`` and ``qkv translate`` do, as plain functions:

1. :func:`build_train_config` and :func:`build_model`: defaults per kind of data, then the
   spec file's keys, then the command line's options.
2. :func:`make_tokenizers`: the spec's tokenizers (characters, bytes or byte-level BPE)
   fitted on the training split; they are saved in every checkpoint of the run
   (``tokenizer-<role>.json``), so ``qkv translate``/``eval``/``generate`` and
   ``qkv train --resume`` read them back from the run folder (:func:`run_tokenizers`).
3. :func:`run_training`: train, keep the best checkpoint's weights, test on held-out data
   (text with ``config.pack``: paragraphs as documents, :func:`text_documents`, packed).
4. :func:`find_checkpoint`, :func:`load_run`, :func:`seq2seq_parts`: a finished run's
   checkpoint, its data spec and its encoder-decoder parts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.checkpoint import load_checkpoint
from qkv.data import BPETokenizer, ByteTokenizer, CharTokenizer
from qkv.data.packing import plan_rows, split_documents
from qkv.distributed.data_parallel import current_world, planned_world_size
from qkv.generate import is_seq2seq
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.train.config import TrainConfig
from qkv.train.context import check_context_world
from qkv.train.lm import evaluate_lm, train_lm
from qkv.train.loop import seed_everything
from qkv.train.memory import bf16_note
from qkv.train.recipes import StopWhen
from qkv.train.seq2seq import evaluate_seq2seq, train_seq2seq
from qkv.train.spec import DEFAULT_BPE_VOCAB, Dataset, DataSpec, read_data_spec

__all__ = [
    "build_model",
    "build_train_config",
    "find_checkpoint",
    "keep_best",
    "load_run",
    "make_tokenizers",
    "packing_line",
    "run_tokenizers",
    "run_training",
    "seq2seq_parts",
    "text_documents",
]

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
        ValueError: an unknown key or a bad value (the message names it); ``--pack`` or
            ``--context-parallel`` with data other than text; ``--context-parallel N`` that
            the processes ``torchrun`` starts cannot host (one process, or ``N`` not dividing
            their number).
    """
    base = LM_TRAIN if kind == "text" else SEQ2SEQ_TRAIN
    given = {k: v for k, v in options.items() if v is not None}
    fields = {**base, **table, **given}
    if "warmup" not in table and isinstance(fields.get("steps"), int):
        # a tenth of a short run, at most the default: --steps 50 still reaches its peak lr
        fields["warmup"] = max(1, min(base["warmup"], fields["steps"] // 10))
    config = TrainConfig.from_dict(fields)
    if config.pack and kind != "text":
        raise ValueError(
            f"--pack: pack packs language-model documents: it applies to text (--text), not to "
            f"{kind} data"
        )
    if config.context_parallel > 1 and kind != "text":
        raise ValueError(
            f"--context-parallel {config.context_parallel}: context parallelism trains language "
            f"models on text (--text), not on {kind} data"
        )
    # before any process group or run folder: the world torchrun is starting must host it
    size = planned_world_size()
    if size is not None:
        check_context_world(config.context_parallel, size)
    return config


def build_model(kind: str, table: dict[str, Any], options: dict[str, Any], vocab: dict[str, int],
                block_size: int, *, seed: int | None = None):  # fmt: skip
    """The model: ``[model]`` keys over the defaults, the options over both.

    Args:
        kind: the data kind (``"text"`` builds a DecoderLM, others a Seq2SeqTransformer).
        table: the config file's ``[model]`` table.
        options: ``d_model``, ``layers``, ``heads`` from the command line (None = not given).
        vocab: ``{"src": V, "tgt": V}`` or ``{"text": V}``.
        block_size: the LM's window (its ``max_len``).
        seed: :func:`~qkv.train.seed_everything` with it just before the weights are drawn,
            so one seed always gives the same initial model; None = draw from the generators
            as they stand.

    Raises:
        ValueError: an unknown key or a bad value.
    """
    d, layers, heads = options.get("d_model"), options.get("layers"), options.get("heads")
    if kind == "text":
        cli = {"d_model": d, "num_layers": layers, "num_heads": heads}
        fields = {**LM_MODEL, "max_len": block_size, **table}
        fields.update({k: v for k, v in cli.items() if v is not None})
        base = DecoderLMConfig.gpt2_style(vocab["text"]).to_dict()
        config = DecoderLMConfig.from_dict({**base, **fields, "vocab_size": vocab["text"]})
        _seed(seed)
        return DecoderLM(config)
    cli = {"d_model": d, "num_encoder_layers": layers, "num_decoder_layers": layers,
           "num_heads": heads}  # fmt: skip
    fields = {**SEQ2SEQ_MODEL, **table}
    fields.update({k: v for k, v in cli.items() if v is not None})
    fields.setdefault("d_ff", 4 * fields["d_model"])
    fields.update(src_vocab_size=vocab["src"], tgt_vocab_size=vocab["tgt"])
    config = Seq2SeqConfig.from_dict(fields)
    _seed(seed)
    return Seq2SeqTransformer(config)


def _seed(seed: int | None) -> None:
    if seed is not None:
        seed_everything(seed)


def make_tokenizers(spec: DataSpec, data: Dataset) -> dict[str, Any]:
    """The tokenizers of ``spec.tokenizer`` fitted on the training split: ``{"text"}`` or
    ``{"src", "tgt"}`` (one per side).

    ``"char"``: the characters seen in training; ``"byte"``: UTF-8 bytes (nothing to fit);
    ``"bpe"``: byte-level BPE (:class:`~qkv.data.BPETokenizer`) trained on the split's text up
    to ``spec.vocab_size`` (default 1000) entries.

    Raises:
        ImportError: ``"bpe"`` without the ``tokenizers`` library.
    """
    if spec.kind == "text":
        sides = {"text": [data.train]}
    else:
        sides = {"src": [s for s, _ in data.train], "tgt": [t for _, t in data.train]}
    if spec.tokenizer == "byte":
        return {role: ByteTokenizer() for role in sides}
    if spec.tokenizer == "bpe":
        vocab = spec.vocab_size or DEFAULT_BPE_VOCAB
        return {role: BPETokenizer.train(texts, vocab) for role, texts in sides.items()}
    return {role: CharTokenizer.fit(texts) for role, texts in sides.items()}


def run_tokenizers(folder: Path, kind: str) -> dict[str, Any]:
    """The tokenizers saved in the checkpoint ``folder`` (``{"text"}`` or ``{"src", "tgt"}``).

    Raises:
        ValueError: the checkpoint lacks one of them.
    """
    ckpt = load_checkpoint(folder)
    roles = ("text",) if kind == "text" else ("src", "tgt")
    missing = [r for r in roles if r not in ckpt.tokenizers]
    if missing:
        raise ValueError(f"{folder} holds no tokenizer for {missing} (tokenizer-<role>.json); "
                         "it cannot be resumed")  # fmt: skip
    return {r: ckpt.tokenizers[r] for r in roles}


def run_training(spec: DataSpec, data: Dataset, toks: dict[str, Any], model, config, *,
                 max_seconds: float | None, log: Callable[[str], object] = print,
                 resume: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Train and test; returns ``{"result", "test": metrics, "split": name}``.

    ``resume``: a ``last`` checkpoint to continue exactly (:func:`~qkv.train.loop.fit`).
    ``log`` receives one line about the data before training starts (and, with ``bf16``
    on a CPU that emulates it, :func:`~qkv.train.memory.bf16_note`'s line). Under ``torchrun``
    every rank calls this alike: training is data-parallel, and the test split is shared
    out across the ranks and its metrics reduced.

    Raises:
        ValueError, ImportError: from training and evaluation.
    """
    callbacks = [StopWhen(config.metric, None, max_seconds)] if max_seconds else []
    distributed = current_world().parallel
    note = bf16_note(config.device) if config.bf16 else None
    if note is not None:  # bf16 emulated on this CPU: it runs, slowly (qkv.train.memory)
        log(note)
    if spec.kind == "text":
        tok = toks["text"]
        if config.pack:
            ids, valid = text_documents(tok, data.train), text_documents(tok, data.valid)
            log(packing_line(ids, config.block_size) + f", vocabulary {tok.vocab_size}")
        else:
            ids, valid = tok.encode(data.train), tok.encode(data.valid)
            log(f"text: {len(ids):,} training and {len(valid):,} validation tokens "
                f"({spec.tokenizer}), vocabulary {tok.vocab_size}")  # fmt: skip
        result = train_lm(model, ids, config, valid_ids=valid, tokenizer=tok, callbacks=callbacks,
                          resume=resume)  # fmt: skip
        keep_best(model, result)
        test = evaluate_lm(model, valid, block_size=config.block_size, pack=config.pack,
                           batch_size=config.batch_size or 32, distributed=distributed)  # fmt: skip
        return {"result": result, "test": test, "split": "validation"}
    src_tok, tgt_tok = toks["src"], toks["tgt"]
    log(f"pairs: {len(data.train):,} training, {len(data.valid):,} validation, "
                  f"{len(data.test):,} test")  # fmt: skip
    result = train_seq2seq(model, data.train, src_tok, tgt_tok, config, valid=data.valid,
                           callbacks=callbacks, resume=resume)  # fmt: skip
    keep_best(model, result)
    test = evaluate_seq2seq(model, data.test, src_tok, tgt_tok, batch_size=256,
                            distributed=distributed)  # fmt: skip
    return {"result": result, "test": test, "split": "test"}


def text_documents(tok: Any, text: str) -> list[list[int]]:
    """The paragraphs of ``text`` (split at blank lines) as documents ``BOS ids EOS``."""
    return [tok.encode(d, add_bos=True, add_eos=True) for d in split_documents(text)]


def packing_line(documents: list[list[int]], block_size: int) -> str:
    """One line on packed training data: documents, rows and the padding fraction."""
    lengths = [max(0, len(d) - 1) for d in documents]  # (input, target) pairs per document
    rows = plan_rows(lengths, block_size)
    padding = 1.0 - sum(lengths) / max(1, len(rows) * block_size)
    return (f"text: {len(documents):,} documents packed into {len(rows):,} rows of "
            f"{block_size} ({padding:.1%} padding)")  # fmt: skip


def keep_best(model, result) -> None:
    """Load the ``best`` checkpoint's weights when later steps did not improve on it (so the
    test metrics are those of the checkpoint ``qkv eval`` and ``qkv translate`` use); eval mode."""
    if result.run_dir is not None and result.best_step not in (None, result.steps):
        load_checkpoint(result.run_dir / "best", model)
    model.eval()


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder at ``path``: the folder itself, or a run folder's ``best`` (else
    ``last``) checkpoint.

    Raises:
        FileNotFoundError: nothing there that looks like a qkv checkpoint.
    """
    root = Path(path)
    for folder in (root, root / "best", root / "last"):
        if (folder / "config.json").is_file():
            return folder
    if not root.exists():
        raise FileNotFoundError(f"no checkpoint at {root}: no such file or folder")
    raise FileNotFoundError(
        f"no checkpoint at {root}: expected a folder with config.json (a qkv checkpoint) or a "
        "run folder holding best/ or last/"
    )


def load_run(path: str | os.PathLike, device: str | None = None
             ) -> tuple[Any, Path, DataSpec | None]:  # fmt: skip
    """Load the checkpoint at ``path`` (see :func:`find_checkpoint`), its model on ``device``
    (None: the CPU).

    Returns:
        ``(checkpoint, folder, data spec of its run or None)``; the model is in eval mode.

    Raises:
        FileNotFoundError: no checkpoint; CheckpointError (a ValueError): a corrupt or
            unreadable one; ValueError: a bad ``data.json``.
    """
    folder = find_checkpoint(path)
    ckpt = load_checkpoint(folder, device=device)
    ckpt.model.eval()
    spec = read_data_spec(folder.parent) if folder.name in ("best", "last") else None
    return ckpt, folder, spec


def seq2seq_parts(ckpt: Any, folder: Path, command: str) -> tuple[Any, Any, Any]:
    """``(model, src_tok, tgt_tok)`` of an encoder-decoder checkpoint.

    Raises:
        ValueError: a decoder-only model, or a checkpoint without its tokenizers.
    """
    if not is_seq2seq(ckpt.model):
        raise ValueError(
            f"{folder} holds a {type(ckpt.model).__name__}; qkv {command} needs an "
            "encoder-decoder (Seq2SeqTransformer) checkpoint"
        )
    toks = ckpt.tokenizers
    if "src" not in toks:
        raise ValueError(f"{folder} has no source tokenizer (tokenizer-src.json)")
    return ckpt.model, toks["src"], toks.get("tgt", toks["src"])
