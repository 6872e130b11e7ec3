"""Training and evaluating decoder-only language models on a token stream.

:func:`train_lm` draws random windows of ``config.block_size`` tokens
(:func:`~qkv.data.lm_batches`, nanoGPT style, seed ``config.seed + epoch``) and minimises
next-token cross-entropy; :func:`evaluate_lm` walks the validation stream in consecutive
windows, so its numbers do not depend on a seed.

Under ``torchrun`` (an initialised process group of several ranks) :func:`train_lm` trains
data-parallel (:mod:`qkv.train.parallel`), and its evaluations split the windows across the
ranks and add up their sums (``evaluate_lm(..., distributed=True)``). With
``config.context_parallel = N`` it also shares each window's positions among ``N`` ranks
(context parallelism, token streams only: :mod:`qkv.train.context`); evaluation then runs
without it, every rank evaluating whole windows of its share.

Documents: both functions also take a list of token-id documents instead of a stream (e.g.
paragraphs, each ``tok.encode(text, add_bos=True, add_eos=True)``). Rows of ``block_size``
positions are then made once by :func:`~qkv.data.packing.pack_lm`: with ``config.pack``
(``qkv train --pack``) several documents per row with document ids, passed to the model as
``document_ids=`` so attention never crosses documents; without it one document per row,
right-padded (the padded baseline; each batch is cut to its longest row). Targets never cross
a document's end, and padding counts in no loss and in no token of ``tokens_per_second``.
A :class:`~qkv.data.packing.LabeledDocument` is learned only where its labels say (a chat's
assistant turns, :func:`qkv.pretrained.chat_documents`); rows that learn nothing are dropped.
Each epoch visits the rows in a seeded random order (seed ``config.seed + epoch``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.data.batching import LMBatch, lm_batches
from qkv.data.datasets import dataset_documents, is_torch_data
from qkv.data.packing import IGNORE_INDEX, PAD_DOCUMENT, LabeledDocument, PackedRows, pack_lm
from qkv.data.tokenizers import Tokenizer
from qkv.distributed.data_parallel import all_reduce_sum, current_world, share, slice_rows
from qkv.train.config import TrainConfig
from qkv.train.context import shard_positions
from qkv.train.loop import Callback, Job, TrainResult, fit
from qkv.train.losses import LossParts, token_loss
from qkv.train.metrics import perplexity
from qkv.train.parallel import train_device

__all__ = ["LM_METRICS", "document_batches", "evaluate_lm", "train_lm"]

LM_METRICS = ("loss", "perplexity", "token_accuracy")


def _stream(name: str, ids: Sequence[int] | Tensor, block_size: int, vocab: int | None) -> Tensor:
    t = torch.as_tensor(ids)
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(
            f"{name} must be a 1-D integer stream (N,), got shape {tuple(t.shape)} and dtype "
            f"{t.dtype}"
        )
    if t.numel() < block_size + 1:
        raise ValueError(f"{name} must hold at least block_size + 1 = {block_size + 1} tokens, "
                         f"got {t.numel()}")  # fmt: skip
    if vocab is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise ValueError(f"{name} has ids outside the model's vocabulary [0, {vocab}): "
                         f"min {int(t.min())}, max {int(t.max())}")  # fmt: skip
    return t.long()


def _is_documents(ids: object) -> bool:
    """A list of documents (sequences or 1-D tensors), not one stream of ints."""
    return isinstance(ids, list | tuple) and len(ids) > 0 and not isinstance(ids[0], int)


def _rows(name: str, docs: Sequence, block_size: int, packed: bool, vocab: int | None
          ) -> PackedRows:  # fmt: skip
    """Rows of documents for language modelling, checked against the vocabulary."""
    rows = _learned_rows(pack_lm(docs, block_size, packed=packed))
    if len(rows) == 0:
        raise ValueError(f"{name} holds no document of 2 or more tokens with a learned token: "
                         "nothing to predict")  # fmt: skip
    real, learned = rows.document_ids != PAD_DOCUMENT, rows.targets != IGNORE_INDEX  # (N, T)
    lo = min(int(rows.tokens[real].min()), int(rows.targets[learned].min()))
    hi = max(int(rows.tokens[real].max()), int(rows.targets[learned].max()))
    if vocab is not None and (lo < 0 or hi >= vocab):
        raise ValueError(f"{name} has ids outside the model's vocabulary [0, {vocab}): "
                         f"min {lo}, max {hi}")  # fmt: skip
    return rows


def _learned_rows(rows: PackedRows) -> PackedRows:
    """``rows`` without those that learn nothing (a piece of a :class:`LabeledDocument` with
    no learned token): a batch of them would average a loss over zero tokens."""
    keep = (rows.targets != IGNORE_INDEX).any(dim=1)  # (N,)
    if bool(keep.all()):
        return rows
    return dataclasses.replace(rows, tokens=rows.tokens[keep], targets=rows.targets[keep],
                               document_ids=rows.document_ids[keep],
                               positions=rows.positions[keep])  # fmt: skip


def document_batches(rows: PackedRows, batch_size: int, order: Tensor, packed: bool
                     ) -> Iterator[LMBatch]:  # fmt: skip
    """Batches of ``batch_size`` rows of :func:`~qkv.data.packing.pack_lm`, in ``order``
    (``(N,)`` row indices): packed rows carry their document ids, padded ones (one document
    each, ``packed=False``) are cut to the longest row of their batch."""
    for k in range(0, len(order), batch_size):
        idx = order[k : k + batch_size]
        inputs, targets = rows.tokens[idx], rows.targets[idx]  # (B, T) each
        if packed:
            yield LMBatch(inputs, targets, rows.document_ids[idx])
            continue
        width = int((rows.document_ids[idx] != PAD_DOCUMENT).sum(dim=1).max())
        yield LMBatch(inputs[:, :width], targets[:, :width])  # (B, width) each


def _logits(model: nn.Module, batch: LMBatch) -> Tensor:
    if batch.document_ids is None:
        return model(batch.inputs)  # (B, T, V)
    return model(batch.inputs, document_ids=batch.document_ids)  # (B, T, V)


def _sparse(model: nn.Module, docs: object) -> bool:
    """Whether to compute logits only where a target counts: documents with labels (a chat's
    replies: most positions are context) on a model that takes ``logits_at`` (DecoderLM)."""
    inner = getattr(model, "module", model)  # under DDP
    return (_is_documents(docs) and any(isinstance(d, LabeledDocument) for d in docs)
            and "logits_at" in inspect.signature(inner.forward).parameters)  # fmt: skip


def _batch_loss(model: nn.Module, batch: LMBatch, sparse: bool,
                label_smoothing: float = 0.0) -> LossParts:  # fmt: skip
    """:func:`~qkv.train.losses.token_loss` of a batch; ``sparse``: the output layer runs on
    the ``N`` positions whose target counts only (the same loss, less compute)."""
    if not sparse:
        return token_loss(_logits(model, batch), batch.targets, pad_id=None,
                          label_smoothing=label_smoothing)  # fmt: skip
    keep = batch.targets != IGNORE_INDEX  # (B, T)
    extra = {} if batch.document_ids is None else {"document_ids": batch.document_ids}
    logits = model(batch.inputs, logits_at=keep, **extra)  # (N, V)
    return token_loss(logits[None], batch.targets[keep][None], pad_id=None,
                      label_smoothing=label_smoothing)  # fmt: skip


def _windows(stream: Tensor, block_size: int, batch_size: int) -> Iterator[LMBatch]:
    """Consecutive non-overlapping windows, ``batch_size`` per batch (the last may be smaller)."""
    n = (stream.numel() - 1) // block_size
    starts = torch.arange(n) * block_size  # (n,)
    offsets = torch.arange(block_size + 1)  # (T + 1,)
    for k in range(0, n, batch_size):
        window = stream[starts[k : k + batch_size, None] + offsets[None, :]]  # (B, T + 1)
        yield LMBatch(inputs=window[:, :-1], targets=window[:, 1:])  # (B, T) each


def evaluate_lm(
    model: nn.Module,
    ids: Sequence[int] | Tensor,
    *,
    block_size: int,
    batch_size: int = 16,
    max_batches: int | None = None,
    distributed: bool = False,
    pack: bool = False,
) -> dict[str, float]:
    """Loss, perplexity and next-token accuracy of ``model`` on a token stream or documents.

    Args:
        model: ``model(input_ids (B, T)) -> logits (B, T, V)``, e.g. :class:`qkv.models.DecoderLM`
            (with ``pack``, also ``document_ids=``).
        ids: ``(N,)`` token stream, ``N >= block_size + 1``, or a list of token-id documents
            (evaluated in rows of documents, in order).
        block_size: window length ``T``.
        batch_size: windows per batch.
        max_batches: evaluate at most this many batches (None = the whole stream).
        distributed: every rank of the initialised process group calls this with the same
            arguments; each evaluates its share of the rows of every batch and the sums are
            added across ranks, so every rank returns the numbers of the whole stream.
        pack: documents only: several per row with document ids (else one per padded row).

    Returns:
        ``{"loss", "perplexity", "token_accuracy"}`` (loss = mean nats per token).

    Raises:
        ValueError: a malformed or too-short stream, ids outside the model's vocabulary.
    """
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if _is_documents(ids):
        rows = _rows("ids", ids, block_size, pack, vocab)
        batches = document_batches(rows, batch_size, torch.arange(len(rows)), pack)
    else:
        _no_pack(pack)
        batches = _windows(_stream("ids", ids, block_size, vocab), block_size, batch_size)
    device = next(iter(model.parameters())).device
    sparse = _sparse(model, ids)
    was_training = model.training
    world = current_world() if distributed else None
    model.eval()
    nll, tokens, correct = 0.0, 0, 0
    try:
        with torch.no_grad():
            for k, batch in enumerate(batches):
                if max_batches is not None and k >= max_batches:
                    break
                if world is not None:  # this rank's rows of the batch
                    batch = slice_rows(batch, share(len(batch.inputs), world.rank, world.size))
                    if not len(batch.inputs):
                        continue
                batch = batch.to(device)
                parts = _batch_loss(model, batch, sparse)
                nll += parts.nll_sum
                tokens += parts.tokens
                correct += parts.correct
    finally:
        model.train(was_training)
    if world is not None:
        nll, tokens, correct = all_reduce_sum([nll, tokens, correct])
        tokens, correct = round(tokens), round(correct)  # counts, exact in float64
    return {
        "loss": nll / tokens,
        "perplexity": perplexity(nll, tokens),
        "token_accuracy": correct / tokens,
    }


def train_lm(
    model: nn.Module,
    ids: Sequence[int] | Tensor,
    config: TrainConfig,
    *,
    valid_ids: Sequence[int] | Tensor | None = None,
    tokenizer: Tokenizer | None = None,
    callbacks: Sequence[Callback] | None = None,
    resume: bool | str | Path | None = None,
) -> TrainResult:
    """Train a decoder-only language model on the token stream ``ids``, or on documents.

    Under ``torchrun`` every rank calls this with the same arguments and the run is
    data-parallel (see :func:`~qkv.train.loop.fit`): ``config.batch_size`` stays the global
    batch, each rank trains on its share, and the weights equal one process's. With
    ``config.context_parallel = N`` (a token stream only) every group of ``N`` ranks shares
    its rows' ``(B_g, T)`` windows, each rank running the model on ``(B_g, T_r)`` positions
    (:mod:`qkv.train.context`); the weights still equal one process's, and evaluations run
    on whole windows (each rank its share of them, no context parallelism).

    Args:
        model: e.g. :class:`qkv.models.DecoderLM`; seed (:func:`~qkv.train.seed_everything`)
            before building it for reproducible initial weights (in a data-parallel run every
            rank starts from rank 0's).
        ids: ``(N,)`` training stream, a list of token-id documents (see the module
            docstring; ``config.pack`` packs them), or a map-style
            :class:`torch.utils.data.Dataset` (or a ``DataLoader`` over one) whose items are
            documents (a list of int or a 1-D integer tensor ``(N,)``): read once in index
            order and trained on as that list of documents (:mod:`qkv.data.datasets`).
        config: :class:`TrainConfig` (``batch_size`` windows or rows of ``block_size``
            tokens; ``metric`` one of :data:`LM_METRICS`; ``pack`` for documents).
        valid_ids: validation stream or documents (or a Dataset of documents), evaluated on
            ``config.eval_batches`` batches.
        tokenizer: saved with the checkpoints (role ``"text"``).
        callbacks: see :data:`qkv.train.loop.Callback`.
        resume: see :func:`qkv.train.loop.fit`.

    Returns:
        a :class:`~qkv.train.loop.TrainResult`.

    Raises:
        ValueError: ``config.batch_tokens`` set (LM batches are ``batch_size`` windows),
            malformed or too-short streams, ``config.pack`` with a stream (packing needs
            document boundaries), ``config.context_parallel > 1`` with documents, and as
            :func:`~qkv.train.loop.fit`.
        TypeError: a Dataset whose first item is not a document of token ids (the message
            names what it is).
    """
    if is_torch_data(ids):
        ids = dataset_documents("ids", ids)
    if is_torch_data(valid_ids):
        valid_ids = dataset_documents("valid_ids", valid_ids)
    if config.batch_size is None:
        raise ValueError(
            f"train_lm needs config.batch_size (windows per batch), got batch_tokens="
            f"{config.batch_tokens}"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    T, batch_size = config.block_size, config.batch_size
    if _is_documents(ids):
        if config.context_parallel > 1:
            raise ValueError(
                f"--context-parallel {config.context_parallel} trains on windows of a token "
                "stream; pass one stream of ids, not a list of documents"
            )
        rows = _rows("ids", ids, T, config.pack, vocab)

        def epoch_batches(epoch: int) -> Iterator[LMBatch]:
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(
                config.seed + epoch))  # fmt: skip
            return document_batches(rows, batch_size, order, config.pack)
    else:
        _no_pack(config.pack)
        stream = _stream("ids", ids, T, vocab)

        def epoch_batches(epoch: int) -> Iterator[LMBatch]:
            return lm_batches(stream, T, batch_size, seed=config.seed + epoch)

    valid = valid_ids
    if valid_ids is not None and not _is_documents(valid_ids):
        valid = _stream("valid_ids", valid_ids, T, vocab)
    device = train_device(config)
    sparse = _sparse(model, ids)
    distributed = current_world().parallel

    def loss(model: nn.Module, batch: LMBatch):
        batch = batch.to(device)
        return _batch_loss(model, batch, sparse, config.label_smoothing)

    def evaluate() -> dict[str, float]:
        assert valid is not None
        return evaluate_lm(model, valid, block_size=T, batch_size=batch_size,
                           max_batches=config.eval_batches, distributed=distributed,
                           pack=config.pack and _is_documents(valid))  # fmt: skip

    job = Job(
        model=model, epoch_batches=epoch_batches,
        batch_tokens=lambda b: int((b.targets != IGNORE_INDEX).sum()),
        loss=loss, evaluate=None if valid is None else evaluate, metrics=LM_METRICS,
        tokenizers={} if tokenizer is None else {"text": tokenizer},
        sequence_shard=shard_positions,
    )  # fmt: skip
    return fit(job, config, callbacks=callbacks, resume=resume)


def _no_pack(pack: bool) -> None:
    if pack:
        raise ValueError(
            "pack=True needs documents: pass a list of token-id documents (e.g. "
            "[tok.encode(d, add_bos=True, add_eos=True) for d in "
            "qkv.data.packing.split_documents(text)]), not one token stream"
        )
