"""The training loop: one function, :func:`fit`, read top to bottom, one comment per step.

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
and the run equals one process with the same seed and batch (:mod:`qkv.train.parallel`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qkv.checkpoint import load_checkpoint
from qkv.data.tokenizers import Tokenizer
from qkv.distributed.data_parallel import PeerError, is_peer_failure
from qkv.train.config import TrainConfig
from qkv.train.losses import LossParts
from qkv.train.parallel import Ranks, Shard
from qkv.train.progress import MetricsLog, ProgressBar, plot_loss_curve
from qkv.train.schedules import lr_at
from qkv.train.state import set_rng

__all__ = ["Callback", "Job", "TrainResult", "fit"]

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
    """

    model: nn.Module
    epoch_batches: Callable[[int], Iterable[Any]]
    batch_tokens: Callable[[Any], int]
    loss: Callable[[nn.Module, Any], LossParts]
    evaluate: Callable[[], dict[str, float]] | None = None
    metrics: tuple[str, ...] = ()
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)
    shard: Shard | None = None


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


@dataclass
class _State:
    """Everything of a run that is not weights, optimizer or RNG; saved as JSON."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # batches of ``epoch`` already used
    best: float | None = None
    best_step: int | None = None
    bad_evals: int = 0  # evaluations since the last improvement
    stopped: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)


class _Cursor:
    """Walks through epochs of batches; ``(epoch, batch)`` is its position."""

    def __init__(self, epoch_batches: Callable[[int], Iterable[Any]], epoch: int, batch: int):
        self.epoch_batches, self.epoch, self.batch = epoch_batches, epoch, batch
        self._it: Iterator[Any] | None = None

    def next(self) -> Any:
        if self._it is None:
            self._it = islice(iter(self.epoch_batches(self.epoch)), self.batch, None)
        for _ in range(2):
            for item in self._it:
                self.batch += 1
                return item
            if self.batch == 0:
                break
            self.epoch, self.batch = self.epoch + 1, 0
            self._it = iter(self.epoch_batches(self.epoch))
        raise ValueError(f"the training data gave no batches in epoch {self.epoch}")


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python's ``random`` and NumPy's global generator."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


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
            validation data, or no training batches.
        PeerError: data-parallel: another rank failed (its own error says why) or timed out.
    """
    start = time.perf_counter()
    ranks = Ranks(job.model, config)
    model = ranks.model
    run_dir = Path(config.run_dir) if config.run_dir else None
    autocast = _autocast(config)
    if config.patience is not None and job.evaluate is None:
        raise ValueError(f"patience={config.patience} needs validation data, got none")
    if job.evaluate is not None and job.metrics and config.metric not in job.metrics:
        raise ValueError(
            f"config.metric={config.metric!r} is not measured here; choose one of {job.metrics}"
        )
    # 1) start fresh (seeded), or restore a checkpoint: weights, optimizer, data position, RNG;
    #    then, with several ranks, wrap the model (DDP or FSDP2) starting from rank 0's weights
    state = _State()
    if resume:
        state = _restore(_resume_path(resume, run_dir), ranks)
    else:
        seed_everything(config.seed)
        ranks.seed_rank(config.seed)
    ranks.start()
    rng = ranks.snapshot()
    data = _Cursor(job.epoch_batches, state.epoch, state.batch)
    main = ranks.world.is_zero  # rank 0 alone prints and writes
    log = MetricsLog(run_dir if main else None)
    bar = ProgressBar(config.steps, initial=state.step, enabled=config.progress and main,
                      log_every=config.log_every)  # fmt: skip

    def save(name: str, training: bool) -> None:
        if run_dir is None:
            return
        info = {"step": state.step, "metrics": state.evals[-1] if state.evals else {}}
        if not training:  # ``best``: weights and tokenizers, for inference
            ranks.save(run_dir / name, state.step, tokenizers=job.tokenizers, info=info)
            return
        train_state = {**asdict(state), "rng": rng[0], "config": config.to_dict()}
        ranks.save(run_dir / name, state.step, tokenizers=job.tokenizers, info=info,
                   train_state=train_state, rng=rng[1])  # fmt: skip

    def evaluate() -> None:
        ranks.sync(state.step)
        metrics = _evaluate(job, model, autocast, config.metric)
        record = {"step": state.step, **metrics}
        state.evals.append(record)
        log.append({"split": "valid", **record})
        bar.message("eval " + "  ".join(f"{k} {v:.4g}" for k, v in record.items()))
        value, best = metrics[config.metric], state.best
        better = math.isfinite(value) and (
            best is None or (value < best if config.metric_mode == "min" else value > best)
        )
        if better:
            state.best, state.best_step, state.bad_evals = value, state.step, 0
            save("best", training=False)
        else:
            state.bad_evals += 1
            if config.patience is not None and state.bad_evals >= config.patience:
                state.stopped = "early_stopping"
        save("last", training=True)
        if ranks.agree(_call(callbacks, {"event": "eval", **record})):
            state.stopped = "callback"

    train_seconds, train_tokens = 0.0, 0
    window_tokens, window_start = 0, time.perf_counter()
    ranks.train_model.train()
    try:
        while state.step < config.steps and state.stopped is None:
            step_start = time.perf_counter()
            step = state.step + 1
            # 2) the micro-batches of this step, and the target tokens the loss averages over
            micro = [data.next() for _ in range(config.accumulate)]
            tokens = sum(job.batch_tokens(b) for b in micro)
            # 3) the learning rate: a pure function of the step, so nothing to restore
            lr = lr_at(step, config)
            for group in ranks.train_optimizer.param_groups:
                group["lr"] = lr
            ranks.release()  # FSDP: the caller's module lends its memory until the next sync
            # 4) forward and backward on this rank's share of each micro-batch (all of it with
            #    one process); each summed loss is divided by the whole step's tokens (and
            #    weighted by the world size, as ranks average their gradients), so k
            #    micro-batches equal one batch k times larger and N ranks equal one process
            loss_sum = nll_sum = 0.0
            for i, batch in enumerate(micro):
                part, weight = ranks.share(batch, job.shard)
                with ranks.gradient_sync(i == len(micro) - 1):
                    with autocast:
                        parts = job.loss(ranks.train_model, part)
                    (parts.loss_sum * weight / tokens).backward()
                if weight:
                    loss_sum += float(parts.loss_sum.detach())
                    nll_sum += parts.nll_sum  # unsmoothed, from the same logits
            loss_sum, nll_sum = ranks.reduce(loss_sum, nll_sum)
            if not math.isfinite(loss_sum):
                raise FloatingPointError(
                    f"training loss is {loss_sum} at step {step}; try a lower lr (now "
                    f"{lr:.3g}), a longer warm-up or gradient clipping"
                )
            # 5) clip the global gradient norm
            if config.clip is not None:
                params = ranks.train_model.parameters()
                norm = torch.nn.utils.clip_grad_norm_(params, config.clip)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP
                if not torch.isfinite(norm):
                    raise FloatingPointError(f"gradient norm is {float(norm)} at step {step}")
            # 6) update the weights and clear the gradients
            ranks.train_optimizer.step()
            ranks.train_optimizer.zero_grad(set_to_none=True)
            # 7) record the step and snapshot what a resume needs (data position, RNG)
            state.step, state.epoch, state.batch = step, data.epoch, data.batch
            state.history.append({"step": step, "loss": loss_sum / tokens,
                                  "ce": nll_sum / tokens, "lr": lr, "tokens": tokens})  # fmt: skip
            rng = ranks.snapshot()
            train_seconds += time.perf_counter() - step_start
            train_tokens += tokens
            # 8) progress on screen; every log_every steps a record in metrics.jsonl
            window_tokens += tokens
            speed = window_tokens / max(time.perf_counter() - window_start, 1e-9)
            smoothed = config.label_smoothing > 0
            bar.update(step, loss=loss_sum / tokens, lr=lr, tokens_per_s=speed,
                       ce=nll_sum / tokens if smoothed else None)  # fmt: skip
            if step % config.log_every == 0:
                recent = state.history[-config.log_every :]
                log.append({"split": "train", "step": step, "lr": lr, "tokens_per_s": speed,
                            "loss": sum(h["loss"] for h in recent) / len(recent),
                            **_mean_ce(recent)})  # fmt: skip
                window_tokens, window_start = 0, time.perf_counter()
            # 9) callbacks; one returning True (on any rank) ends the run after this step
            if ranks.agree(_call(callbacks, {"event": "step", **state.history[-1]})):
                state.stopped = "callback"
            # 10) evaluate every eval_every steps: best checkpoint, early stopping
            if job.evaluate is not None and config.eval_every and step % config.eval_every == 0:
                evaluate()
            # 11) write ``last`` every save_every steps
            if config.save_every and step % config.save_every == 0:
                save("last", training=True)
        # 12) a last evaluation if the final step had none, then the ``last`` checkpoint
        if job.evaluate is not None and (not state.evals or state.evals[-1]["step"] != state.step):
            evaluate()
        save("last", training=True)
        ranks.finish(state.step)
    except KeyboardInterrupt:
        # ranks may be anywhere: a data-parallel run cannot gather a checkpoint now
        if run_dir is not None and not ranks.parallel:
            save("last", training=True)
            bar.message(f"interrupted: checkpoint of step {state.step} in {run_dir / 'last'}")
        raise
    except Exception as err:
        if ranks.parallel and is_peer_failure(err):
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PeerError(
                f"{ranks.world}: lost the other ranks at step {state.step + 1}: one of them "
                f"failed (its own error says why) or did not answer in time ({first})"
            ) from err
        raise
    finally:
        bar.close()
    # 13) the loss curve
    if main and run_dir is not None and config.plot and state.history:
        try:
            plot_loss_curve(state.history, state.evals, run_dir / "loss.png",
                            smoothing=config.label_smoothing)  # fmt: skip
        except ImportError as err:
            bar.message(f"no loss.png: {err}")
    return TrainResult(
        steps=state.step, history=state.history, evals=state.evals,
        best_metric=state.best, best_step=state.best_step, stopped=state.stopped or "steps",
        run_dir=run_dir, seconds=time.perf_counter() - start,
        tokens_per_second=train_tokens / train_seconds if train_seconds else 0.0,
    )  # fmt: skip


def _mean_ce(history: list[dict[str, Any]]) -> dict[str, float]:
    """``{"ce": mean}`` of the steps' unsmoothed cross-entropy; ``{}`` when a step lacks it
    (a run resumed from a checkpoint written before ``ce`` was recorded)."""
    ces = [h["ce"] for h in history if "ce" in h]
    return {"ce": sum(ces) / len(ces)} if ces and len(ces) == len(history) else {}


def _autocast(config: TrainConfig):
    if not config.bf16:
        return nullcontext()
    return torch.autocast(device_type=torch.device(config.device).type, dtype=torch.bfloat16)


def _evaluate(job: Job, model: nn.Module, autocast, metric: str) -> dict[str, float]:
    """``job.evaluate()`` in eval mode, without gradients, on a forked RNG."""
    assert job.evaluate is not None
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), autocast:
            metrics = {k: float(v) for k, v in job.evaluate().items()}
    finally:
        model.train()
    if metric == "bleu" and "bleu_ref_tokens" in metrics:
        raise ValueError(
            f"config.metric='bleu': the validation targets average "
            f"{metrics['bleu_ref_tokens']:.1f} tokens, too short for BLEU (it needs 4-grams); "
            "watch 'exact_match' or 'chrf' instead"
        )
    if metric not in metrics:
        raise ValueError(
            f"config.metric={metric!r} is not among the evaluation's metrics {sorted(metrics)}"
        )
    return metrics


def _call(callbacks: Sequence[Callback] | None, event: dict[str, Any]) -> bool:
    stop = False
    for callback in callbacks or ():
        stop = bool(callback(dict(event))) or stop
    return stop


def _resume_path(resume: bool | str | Path, run_dir: Path | None) -> Path:
    if resume is True:
        if run_dir is None:
            raise ValueError("resume=True needs config.run_dir (the run to continue), got None")
        path = run_dir / "last"
    else:
        path = Path(resume)
    if not path.exists() and not any(path.parent.glob(f".{path.name}.old-*")):
        raise FileNotFoundError(f"resume: no checkpoint at {path}")
    return path


def _restore(path: Path, ranks: Ranks) -> _State:
    """Load ``path`` into the module and optimizer (every rank reads it) and restore the
    random states: rank 0's for all, then each other rank's own when saved."""
    ckpt = load_checkpoint(path, ranks.model, optimizer=ranks.optimizer)
    saved = ckpt.train_state
    if saved is None:
        raise ValueError(f"{path}: a model-only checkpoint (no training state) cannot resume")
    names = {f for f in _State.__dataclass_fields__}
    state = _State(**{k: v for k, v in saved.items() if k in names})
    state.stopped = None  # resuming a run that stopped (callback, early stopping) continues it
    set_rng(saved.get("rng", {}), ckpt.train_tensors, str(path / "train_state.json"))
    ranks.restore_rank_rng(ckpt.train_tensors, ranks.config.seed, state.step)
    return state
