"""Training and evaluating encoder-decoder models on pairs of strings.

:func:`train_seq2seq` turns a :class:`~qkv.data.Task` (or plain pairs) into a
:class:`~qkv.train.loop.Job`: length-bucketed batches (:func:`~qkv.data.bucket_batches`,
reshuffled each epoch with seed ``config.seed + epoch``), teacher-forced label-smoothed
cross-entropy, and :func:`evaluate_seq2seq` on the validation split.

:func:`evaluate_seq2seq` measures two things. Teacher-forced (the model sees the reference
prefix): loss, perplexity and token accuracy. Free-running (the model decodes on its own,
greedy or beam search): exact match, BLEU and chrF against the references.

Under ``torchrun`` (an initialised process group of several ranks) :func:`train_seq2seq`
trains data-parallel (:mod:`qkv.train.parallel`), and its evaluations split the pairs across
the ranks, add up the sums and gather the decoded strings (``distributed=True``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkv.data.batching import Seq2SeqBatch, bucket_batches, encode_pairs
from qkv.data.datasets import dataset_pairs, is_torch_data
from qkv.data.tasks import Task
from qkv.data.tokenizers import PAD_ID, Tokenizer
from qkv.distributed.data_parallel import all_gather_json, all_reduce_sum, current_world, share
from qkv.generate import translate
from qkv.train.config import TrainConfig
from qkv.train.loop import Callback, Job, TrainResult, fit
from qkv.train.losses import token_loss
from qkv.train.metrics import bleu, bleu_applies, chrf, exact_match, perplexity
from qkv.train.parallel import train_device

__all__ = ["SEQ2SEQ_METRICS", "evaluate_seq2seq", "train_seq2seq"]

Pairs = Sequence[tuple[str, str]]
# The metrics an evaluation may return ("bleu" only on references of >= 4 tokens on average).
SEQ2SEQ_METRICS = ("loss", "perplexity", "token_accuracy", "exact_match", "bleu", "chrf")


def _check_fit(model: nn.Module, src_tok: Tokenizer, tgt_tok: Tokenizer) -> None:
    """The tokenizers' vocabularies and padding must fit the model's."""
    config = getattr(model, "config", None)
    for side, tok in (("src", src_tok), ("tgt", tgt_tok)):
        size = getattr(config, f"{side}_vocab_size", None)
        if size is not None and tok.vocab_size > size:
            raise ValueError(
                f"{side}_tok has {tok.vocab_size} tokens but the model's {side}_vocab_size is "
                f"{size}; build the model with {side}_vocab_size={tok.vocab_size}"
            )
    pad = getattr(config, "pad_id", PAD_ID)
    if pad != PAD_ID:
        raise ValueError(f"the model's pad_id must be {PAD_ID} (the tokenizers'), got {pad!r}")


def _as_pairs(name: str, pairs: Any) -> list[tuple[str, str]]:
    if is_torch_data(pairs):
        return dataset_pairs(name, pairs)
    if isinstance(pairs, str) or not isinstance(pairs, Sequence):
        raise TypeError(
            f"{name} must be a Task, a list of (source, target) pairs or a torch Dataset/"
            f"DataLoader of them, got {type(pairs).__name__}"
        )
    return list(pairs)


def evaluate_seq2seq(
    model: nn.Module,
    pairs: Pairs,
    src_tok: Tokenizer,
    tgt_tok: Tokenizer,
    *,
    batch_size: int = 64,
    beam: int | None = None,
    alpha: float = 0.6,
    bleu_tokenize: str = "auto",
    distributed: bool = False,
) -> dict[str, float]:
    """Teacher-forced and free-running metrics of ``model`` on ``pairs``.

    Args:
        model: an encoder-decoder model (``forward(src, tgt_in)``, ``encode``, ``decode``).
        pairs: ``(source, reference)`` strings.
        src_tok, tgt_tok: the tokenizers.
        batch_size: pairs per batch.
        beam: beam size for decoding; None = greedy.
        alpha: beam search length penalty.
        bleu_tokenize: sacrebleu tokenizer for BLEU: ``"13a"`` (words, the WMT standard),
            ``"char"`` (characters), or ``"auto"``: ``"char"`` when no reference contains
            whitespace (digit strings, dates: one "word" each, where word BLEU says nothing),
            else ``"13a"``.
        distributed: every rank of the initialised process group calls this with the same
            arguments; each scores and decodes its share of the pairs, the sums are added
            and the decoded strings gathered, so every rank returns the numbers of all pairs.

    Returns:
        ``{"loss", "perplexity", "token_accuracy", "exact_match", "bleu", "chrf"}``; loss is
        the unsmoothed mean negative log-likelihood per target token (EOS included), token
        accuracy the fraction of target tokens the teacher-forced argmax gets right. When the
        references average fewer than 4 BLEU tokens (:func:`~qkv.train.metrics.bleu_applies`:
        perfect outputs would score 0.0) there is no ``"bleu"``; ``"bleu_ref_tokens"`` (that
        mean) stands in its place, and :func:`~qkv.train.metrics.bleu_text` prints
        ``BLEU n/a (...)``.

    Raises:
        ValueError: no pairs, vocabularies larger than the model's, a bad batch size.
        ImportError: sacrebleu missing (``pip install 'qkv[train]'``).
    """
    pairs = _as_pairs("pairs", pairs)
    if not pairs:
        raise ValueError("pairs must hold at least one (source, reference) pair, got none")
    _check_fit(model, src_tok, tgt_tok)
    world = current_world() if distributed else None
    mine = pairs if world is None else pairs[share(len(pairs), world.rank, world.size)]
    was_training = model.training
    model.eval()
    nll = tokens = correct = 0
    hyps: list[str] = []
    try:
        device = next(iter(model.parameters())).device
        # 1) teacher forcing: loss and token accuracy given the reference prefix
        examples = encode_pairs(mine, src_tok, tgt_tok)
        with torch.no_grad():
            batches = bucket_batches(examples, batch_size=batch_size, shuffle=False) if mine else []
            for batch in batches:
                batch = batch.to(device)
                parts = token_loss(model(batch.src, batch.tgt_in), batch.tgt_out, pad_id=PAD_ID)
                nll += parts.nll_sum
                tokens += parts.tokens
                correct += parts.correct
        # 2) free running: the model's own decoding against the references
        if mine:
            hyps = translate(model, [s for s, _ in mine], src_tok, tgt_tok,
                             batch_size=batch_size, beam_size=beam, alpha=alpha)  # fmt: skip
    finally:
        model.train(was_training)
    # 3) in a data-parallel evaluation: the sums of all ranks, the strings in pair order
    if world is not None:
        nll, tokens, correct = all_reduce_sum([nll, tokens, correct])
        tokens, correct = round(tokens), round(correct)  # counts, exact in float64
        hyps = [h for part in all_gather_json(hyps) for h in part]
    refs = [t for _, t in pairs]
    if bleu_tokenize == "auto":
        bleu_tokenize = "13a" if any(any(c.isspace() for c in r) for r in refs) else "char"
    metrics = {
        "loss": nll / tokens,
        "perplexity": perplexity(nll, tokens) if math.isfinite(nll) else math.inf,
        "token_accuracy": correct / tokens,
        "exact_match": exact_match(hyps, refs),
    }
    # 4) BLEU only where it means something: references of >= 4 tokens on average
    meaningful, mean_tokens = bleu_applies(refs, tokenize=bleu_tokenize)
    if meaningful:
        metrics["bleu"] = bleu(hyps, refs, tokenize=bleu_tokenize)
    else:
        metrics["bleu_ref_tokens"] = mean_tokens
    metrics["chrf"] = chrf(hyps, refs)
    return metrics


def train_seq2seq(
    model: nn.Module,
    data: Task | Pairs,
    src_tok: Tokenizer,
    tgt_tok: Tokenizer | None,
    config: TrainConfig,
    *,
    valid: Pairs | None = None,
    callbacks: Sequence[Callback] | None = None,
    resume: bool | str | Path | None = None,
) -> TrainResult:
    """Train an encoder-decoder model on string pairs.

    Under ``torchrun`` every rank calls this with the same arguments and the run is
    data-parallel (see :func:`~qkv.train.loop.fit`): ``config.batch_size`` (or
    ``batch_tokens``) stays the global batch, each rank trains on its share of every batch,
    and the weights equal one process's.

    Args:
        model: e.g. :class:`qkv.models.Seq2SeqTransformer` (its vocabularies must hold the
            tokenizers', and its ``pad_id`` be 0); seed before building it for reproducible
            initial weights (in a data-parallel run every rank starts from rank 0's).
        data: a :class:`~qkv.data.Task` (trains on ``train``, validates on ``valid``), a
            list of ``(source, target)`` pairs, or a map-style :class:`torch.utils.data.Dataset`
            (or a ``DataLoader`` over one) whose items are such pairs of ``str``: read once in
            index order and batched as the list would be (the loader's own sampler and batch
            size are not used; :mod:`qkv.data.datasets`).
        src_tok: tokenizer of the sources.
        tgt_tok: tokenizer of the targets; None = ``src_tok``.
        config: :class:`TrainConfig` (``batch_size`` or ``batch_tokens``; ``metric`` one of
            :data:`SEQ2SEQ_METRICS`).
        valid: validation pairs, as a list or a torch Dataset (default: the task's ``valid``
            split; none for plain pairs).
        callbacks: see :data:`qkv.train.loop.Callback`.
        resume: see :func:`qkv.train.loop.fit`.

    Returns:
        a :class:`~qkv.train.loop.TrainResult`; its ``evals`` hold :func:`evaluate_seq2seq`
        metrics on up to ``config.eval_examples`` validation pairs.

    Raises:
        ValueError: no training pairs, vocabularies larger than the model's, and as
            :func:`~qkv.train.loop.fit`.
        TypeError: ``data`` of another type, or a Dataset whose first item is not a pair of
            strings (the message names what it is).
    """
    tgt_tok = src_tok if tgt_tok is None else tgt_tok
    if isinstance(data, Task):
        train_pairs = data.pairs("train")
        valid = data.pairs("valid") if valid is None else valid
    else:
        train_pairs = _as_pairs("data", data)
    if not train_pairs:
        raise ValueError("the training data holds no pairs")
    _check_fit(model, src_tok, tgt_tok)
    valid = _as_pairs("valid", valid)[: config.eval_examples] if valid is not None else None
    valid = valid or None
    examples = encode_pairs(train_pairs, src_tok, tgt_tok)
    device = train_device(config)
    distributed = current_world().parallel
    sizes = {"batch_size": config.batch_size, "batch_tokens": config.batch_tokens}

    def epoch_batches(epoch: int) -> list[Seq2SeqBatch]:
        return bucket_batches(examples, shuffle=True, seed=config.seed + epoch, **sizes)

    def loss(model: nn.Module, batch: Seq2SeqBatch):
        batch = batch.to(device)
        logits = model(batch.src, batch.tgt_in)  # (B, T, V)
        return token_loss(logits, batch.tgt_out, pad_id=PAD_ID,
                          label_smoothing=config.label_smoothing)  # fmt: skip

    def evaluate() -> dict[str, float]:
        assert valid is not None
        return evaluate_seq2seq(model, valid, src_tok, tgt_tok, batch_size=config.batch_size or 64,
                                distributed=distributed)  # fmt: skip

    job = Job(
        model=model, epoch_batches=epoch_batches, batch_tokens=lambda b: b.num_tokens,
        loss=loss, evaluate=evaluate if valid else None, metrics=SEQ2SEQ_METRICS,
        tokenizers={"src": src_tok, "tgt": tgt_tok},
    )  # fmt: skip
    return fit(job, config, callbacks=callbacks, resume=resume)
