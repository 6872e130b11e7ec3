"""Training and evaluating decoder-only language models on a token stream.

:func:`train_lm` draws random windows of ``config.block_size`` tokens
(:func:`~qkv.data.lm_batches`, nanoGPT style, seed ``config.seed + epoch``) and minimises
next-token cross-entropy; :func:`evaluate_lm` walks the validation stream in consecutive
windows, so its numbers do not depend on a seed.

Under ``torchrun`` (an initialised process group of several ranks) :func:`train_lm` trains
data-parallel (:mod:`qkv.train.parallel`), and its evaluations split the windows across the
ranks and add up their sums (``evaluate_lm(..., distributed=True)``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.data.batching import LMBatch, lm_batches
from qkv.data.tokenizers import Tokenizer
from qkv.distributed.data_parallel import all_reduce_sum, current_world, share, slice_rows
from qkv.train.config import TrainConfig
from qkv.train.loop import Callback, Job, TrainResult, fit
from qkv.train.losses import token_loss
from qkv.train.metrics import perplexity
from qkv.train.parallel import train_device

__all__ = ["LM_METRICS", "evaluate_lm", "train_lm"]

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
) -> dict[str, float]:
    """Loss, perplexity and next-token accuracy of ``model`` on a token stream.

    Args:
        model: ``model(input_ids (B, T)) -> logits (B, T, V)``, e.g. :class:`qkv.models.DecoderLM`.
        ids: ``(N,)`` token stream, ``N >= block_size + 1``.
        block_size: window length ``T``.
        batch_size: windows per batch.
        max_batches: evaluate at most this many batches (None = the whole stream).
        distributed: every rank of the initialised process group calls this with the same
            arguments; each evaluates its share of the rows of every batch and the sums are
            added across ranks, so every rank returns the numbers of the whole stream.

    Returns:
        ``{"loss", "perplexity", "token_accuracy"}`` (loss = mean nats per token).

    Raises:
        ValueError: a malformed or too-short stream, ids outside the model's vocabulary.
    """
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    stream = _stream("ids", ids, block_size, vocab)
    device = next(iter(model.parameters())).device
    was_training = model.training
    world = current_world() if distributed else None
    model.eval()
    nll, tokens, correct = 0.0, 0, 0
    try:
        with torch.no_grad():
            for k, batch in enumerate(_windows(stream, block_size, batch_size)):
                if max_batches is not None and k >= max_batches:
                    break
                if world is not None:  # this rank's rows of the batch
                    batch = slice_rows(batch, share(len(batch.inputs), world.rank, world.size))
                    if not len(batch.inputs):
                        continue
                batch = batch.to(device)
                parts = token_loss(model(batch.inputs), batch.targets, pad_id=None)
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
    """Train a decoder-only language model on the token stream ``ids``.

    Under ``torchrun`` every rank calls this with the same arguments and the run is
    data-parallel (see :func:`~qkv.train.loop.fit`): ``config.batch_size`` stays the global
    batch, each rank trains on its share, and the weights equal one process's.

    Args:
        model: e.g. :class:`qkv.models.DecoderLM`; seed (:func:`~qkv.train.seed_everything`)
            before building it for reproducible initial weights (in a data-parallel run every
            rank starts from rank 0's).
        ids: ``(N,)`` training stream.
        config: :class:`TrainConfig` (``batch_size`` windows of ``block_size`` tokens;
            ``metric`` one of :data:`LM_METRICS`).
        valid_ids: validation stream, evaluated on ``config.eval_batches`` batches.
        tokenizer: saved with the checkpoints (role ``"text"``).
        callbacks: see :data:`qkv.train.loop.Callback`.
        resume: see :func:`qkv.train.loop.fit`.

    Returns:
        a :class:`~qkv.train.loop.TrainResult`.

    Raises:
        ValueError: ``config.batch_tokens`` set (LM batches are ``batch_size`` windows),
            malformed or too-short streams, and as :func:`~qkv.train.loop.fit`.
    """
    if config.batch_size is None:
        raise ValueError(
            f"train_lm needs config.batch_size (windows per batch), got batch_tokens="
            f"{config.batch_tokens}"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    stream = _stream("ids", ids, config.block_size, vocab)
    valid = None if valid_ids is None else _stream("valid_ids", valid_ids, config.block_size, vocab)
    device, batch_size = train_device(config), config.batch_size
    distributed = current_world().parallel

    def epoch_batches(epoch: int) -> Iterator[LMBatch]:
        return lm_batches(stream, config.block_size, batch_size, seed=config.seed + epoch)

    def loss(model: nn.Module, batch: LMBatch):
        batch = batch.to(device)
        return token_loss(model(batch.inputs), batch.targets, pad_id=None,
                          label_smoothing=config.label_smoothing)  # fmt: skip

    def evaluate() -> dict[str, float]:
        assert valid is not None
        return evaluate_lm(model, valid, block_size=config.block_size, batch_size=batch_size,
                           max_batches=config.eval_batches, distributed=distributed)  # fmt: skip

    job = Job(
        model=model, epoch_batches=epoch_batches, batch_tokens=lambda b: b.targets.numel(),
        loss=loss, evaluate=None if valid is None else evaluate, metrics=LM_METRICS,
        tokenizers={} if tokenizer is None else {"text": tokenizer},
    )  # fmt: skip
    return fit(job, config, callbacks=callbacks, resume=resume)
