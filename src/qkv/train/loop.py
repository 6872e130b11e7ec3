"""The training loop: one function, :func:`fit`, read top to bottom; its steps are named methods
of :class:`qkv.train.steps.Run`, numbered in their comments.

:func:`fit` knows nothing about tasks: a :class:`Job` brings the model, the batches of each
epoch, the loss of a batch and the evaluation; :mod:`qkv.train.seq2seq` and
:mod:`qkv.train.lm` build jobs for translation-style tasks and language modelling.

Resuming is exact. Everything that decides what happens next is either a pure function of
the step (the learning rate) or saved in the ``last`` checkpoint: weights, optimizer moments,
the data position (epoch, batches used), the RNG states behind dropout, the early-stopping
counters and the loss history. The RNG states are snapshotted at the end of every step, and
evaluation runs inside :func:`torch.random.fork_rng`, so an evaluation or an interruption
never shifts the random numbers of later steps.

Data parallelism needs no change here: under ``torchrun`` (or any initialised process group
of several ranks) each rank trains on its share of the same global batch, with DDP or FSDP2,
and the run equals one process with the same seed and batch (:mod:`qkv.train.parallel`);
with ``config.context_parallel`` several ranks also share each sequence
(:mod:`qkv.train.context`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from qkv.data.tokenizers import Tokenizer
from qkv.train.config import TrainConfig
from qkv.train.losses import LossParts
from qkv.train.memory import checkpointed_blocks
from qkv.train.parallel import Shard
from qkv.train.steps import Run, seed_everything

__all__ = ["Callback", "Job", "TrainResult", "fit", "seed_everything"]

# Called after every step with {"event": "step", "step", "loss", "ce", "lr", "tokens"} and after
# every evaluation with {"event": "eval", "step", <metrics>}; returning True stops the run.
Callback = Callable[[dict[str, Any]], "bool | None"]


@dataclass
class Job:
    """What :func:`fit` trains.

    Attributes:
        model: the module; ``job.loss`` calls it.
        epoch_batches: ``epoch -> batches`` of that epoch, the same every time it is called
            with the same epoch (so a resumed run can skip to where it stopped, and every
            rank of a data-parallel run draws the same global batches): seed from the epoch,
            never from the global random generators.
        batch_tokens: ``batch -> int``, the target tokens the loss of ``batch`` sums over.
        loss: ``(model, batch) -> LossParts``.
        evaluate: ``() -> {metric: float}`` on validation data, or None. In a data-parallel
            run every rank calls it (with ``model`` holding the current weights) and it must
            return the same numbers on each, e.g. by splitting the data and reducing the sums
            (as :func:`~qkv.train.evaluate_lm` with ``distributed=True`` does).
        metrics: the names ``evaluate`` returns (checked against ``config.metric`` up front).
        tokenizers: saved with every checkpoint, ``{role: tokenizer}``.
        shard: ``(batch, rank, world_size) -> that rank's part, or None when it has no rows``,
            for a data-parallel run; None = contiguous rows of every tensor in the batch (a
            tensor, or a dataclass, tuple, list or dict of tensors, first dimension ``B``).
        sequence_shard: ``(part, rank, size) -> that rank's positions of every sequence in
            part`` for context parallelism (``config.context_parallel > 1``, see
            :mod:`qkv.train.context`), e.g. :func:`~qkv.train.context.shard_positions`; None =
            this job cannot be trained context-parallel (:func:`fit` refuses it).
    """

    model: nn.Module
    epoch_batches: Callable[[int], Iterable[Any]]
    batch_tokens: Callable[[Any], int]
    loss: Callable[[nn.Module, Any], LossParts]
    evaluate: Callable[[], dict[str, float]] | None = None
    metrics: tuple[str, ...] = ()
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)
    shard: Shard | None = None
    sequence_shard: Shard | None = None


@dataclass(frozen=True)
class TrainResult:
    """What a run did.

    Attributes:
        steps: optimizer steps completed (including those before a resume).
        history: one ``{"step", "loss", "ce", "lr", "tokens"}`` per step; ``loss`` is the
            mean training loss per target token that the step minimised (label-smoothed when
            ``config.label_smoothing > 0``), ``ce`` the plain (unsmoothed) cross-entropy of
            the same logits, comparable with the validation loss (both of the global batch,
            in a data-parallel run).
        evals: one ``{"step", <metric>: value, ...}`` per evaluation.
        best_metric, best_step: the best value of ``config.metric`` and its step (None
            without validation data).
        stopped: ``"steps"``, ``"early_stopping"`` or ``"callback"``.
        run_dir: the run folder, or None.
        seconds: wall time of this call.
        tokens_per_second: training throughput of this call (evaluation excluded).
    """

    steps: int
    history: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    best_metric: float | None
    best_step: int | None
    stopped: str
    run_dir: Path | None
    seconds: float
    tokens_per_second: float

    @property
    def final_metrics(self) -> dict[str, Any]:
        """The last evaluation (``{}`` without one)."""
        return dict(self.evals[-1]) if self.evals else {}


def fit(
    job: Job,
    config: TrainConfig,
    *,
    callbacks: Sequence[Callback] | None = None,
    resume: bool | str | Path | None = None,
) -> TrainResult:
    """Train ``job.model`` for ``config.steps`` optimizer steps.

    Args:
        job: model, data, loss and evaluation.
        config: the :class:`TrainConfig`.
        callbacks: functions called after every step and evaluation (see :data:`Callback`).
        resume: None/False = start fresh (seeded by ``config.seed``); True = continue from
            ``<run_dir>/last``; a path = continue from that checkpoint folder (written by
            any number of processes).

    With an initialised process group of several ranks, every rank calls :func:`fit` with
    the same arguments; each trains on its share of every batch (DDP, or FSDP2 with
    ``config.fsdp``), rank 0 alone shows progress and writes files, and ``job.model`` holds
    the trained weights on every rank at the end (:mod:`qkv.train.parallel`). Callbacks run
    on every rank; the run stops when one of them asks on any rank.

    Returns:
        a :class:`TrainResult`.

    Raises:
        KeyboardInterrupt: re-raised after ``<run_dir>/last`` is written (Ctrl-C; a
            data-parallel run keeps its last periodic checkpoint instead).
        FloatingPointError: a non-finite loss or gradient norm (the step is not applied).
        FileNotFoundError / CheckpointError: a checkpoint to resume from is missing or bad.
        ValueError: ``config.metric`` not among the evaluation's metrics, patience without
            validation data, no training batches, or ``config.checkpoint_activations``
            with a model that has no blocks (no ``nn.ModuleList``).
        PeerError: data-parallel: another rank failed (its own error says why) or timed out.
    """
    run = Run(job, config, callbacks, resume)
    run.ranks.train_model.train()
    try:
        # config.checkpoint_activations: the blocks of the model being trained recompute
        # their activations in backward, during the steps only (qkv.train.memory)
        with checkpointed_blocks(run.ranks.train_model, config.checkpoint_activations):
            while run.running:
                run.step()  # steps 2-11
        run.finish()  # step 12
    except KeyboardInterrupt:
        run.interrupted()
        raise
    except Exception as err:
        peer = run.peer_error(err)
        if peer is not None:
            raise peer from err
        raise
    finally:
        run.bar.close()
    run.plot()  # step 13
    return TrainResult(**run.summary())
