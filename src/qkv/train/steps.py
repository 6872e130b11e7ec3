"""The steps of one training run, named: what :func:`qkv.train.fit` reads top to bottom.

A :class:`Run` holds what a run is made of (the job, its config, the ranks it trains on, the
data cursor, the progress bar and the metrics log, the state a resume restores) and has one
method per step: :meth:`Run.step` (one optimizer step), :meth:`Run.report` (progress,
metrics, callbacks), :meth:`Run.evaluate` (validation, best checkpoint, early stopping),
:meth:`Run.save`, :meth:`Run.finish`, and the distributed hooks :meth:`Run.peer_error`. The
comments number the steps as :func:`~qkv.train.fit` takes them.
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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from qkv.checkpoint import load_checkpoint
from qkv.distributed.data_parallel import PeerError, is_peer_failure
from qkv.train.config import TrainConfig
from qkv.train.metrics import describe_metrics
from qkv.train.parallel import Ranks
from qkv.train.progress import MetricsLog, ProgressBar, plot_loss_curve
from qkv.train.schedules import lr_at
from qkv.train.state import set_rng

if TYPE_CHECKING:
    from qkv.train.loop import Callback, Job

__all__ = ["Run", "seed_everything"]


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


class Run:
    """One call of :func:`~qkv.train.fit`: its parts, its state and its steps."""

    def __init__(self, job: Job, config: TrainConfig, callbacks: Sequence[Callback] | None,
                 resume: bool | str | Path | None) -> None:  # fmt: skip
        self.start = time.perf_counter()
        self.job, self.config, self.callbacks = job, config, callbacks
        self.ranks = Ranks(job.model, config)
        self.run_dir = Path(config.run_dir) if config.run_dir else None
        self.autocast = _autocast(config)
        _check(job, config)
        # 1) start fresh (seeded), or restore a checkpoint: weights, optimizer, data position,
        #    RNG; then, with several ranks, wrap the model (DDP or FSDP2) from rank 0's weights
        self.state = _State()
        if resume:
            self.state = _restore(_resume_path(resume, self.run_dir), self.ranks)
        else:
            seed_everything(config.seed)
            self.ranks.seed_rank(config.seed)
        self.ranks.start()
        self.rng = self.ranks.snapshot()
        self.data = _Cursor(job.epoch_batches, self.state.epoch, self.state.batch)
        self.main = self.ranks.world.is_zero  # rank 0 alone prints and writes
        self.log = MetricsLog(self.run_dir if self.main else None)
        self.bar = ProgressBar(config.steps, initial=self.state.step,
                               enabled=config.progress and self.main,
                               log_every=config.log_every)  # fmt: skip
        if self.ranks.mesh.group is not None:
            self.bar.message(str(self.ranks.mesh))  # context parallel: how the world is split
        self.train_seconds, self.train_tokens = 0.0, 0
        self.window_tokens, self.window_start = 0, time.perf_counter()

    @property
    def running(self) -> bool:
        return self.state.step < self.config.steps and self.state.stopped is None

    def step(self) -> None:
        """Steps 2-11: one optimizer step, its record, and what follows it."""
        step_start = time.perf_counter()
        step, config, ranks = self.state.step + 1, self.config, self.ranks
        # 2) the micro-batches of this step, and the target tokens the loss averages over
        micro = [self.data.next() for _ in range(config.accumulate)]
        tokens = sum(self.job.batch_tokens(b) for b in micro)
        # 3) the learning rate: a pure function of the step, so nothing to restore
        lr = lr_at(step, config)
        for group in ranks.train_optimizer.param_groups:
            group["lr"] = lr
        ranks.release()  # FSDP: the caller's module lends its memory until the next sync
        loss_sum, nll_sum = self._gradients(micro, tokens, step, lr)
        # 5) clip the global gradient norm
        if config.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(ranks.train_model.parameters(), config.clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP
            if not torch.isfinite(norm):
                raise FloatingPointError(f"gradient norm is {float(norm)} at step {step}")
        # 6) update the weights and clear the gradients
        ranks.train_optimizer.step()
        ranks.train_optimizer.zero_grad(set_to_none=True)
        # 7) record the step and snapshot what a resume needs (data position, RNG)
        state = self.state
        state.step, state.epoch, state.batch = step, self.data.epoch, self.data.batch
        state.history.append({"step": step, "loss": loss_sum / tokens, "ce": nll_sum / tokens,
                              "lr": lr, "tokens": tokens})  # fmt: skip
        self.rng = ranks.snapshot()
        self.train_seconds += time.perf_counter() - step_start
        self.train_tokens += tokens
        self.report(step, lr, tokens)
        # 10) evaluate every eval_every steps: best checkpoint, early stopping
        if self.job.evaluate is not None and config.eval_every and step % config.eval_every == 0:
            self.evaluate()
        # 11) write ``last`` every save_every steps
        if config.save_every and step % config.save_every == 0:
            self.save("last", training=True)

    def _gradients(self, micro: list, tokens: int, step: int, lr: float) -> tuple[float, float]:
        """4) forward and backward on this rank's share of each micro-batch (all of it with
        one process); each summed loss is divided by the whole step's tokens (and weighted by
        the world size, as ranks average their gradients), so k micro-batches equal one batch
        k times larger and N ranks equal one process. Returns the step's summed loss and
        unsmoothed cross-entropy over every rank."""
        ranks = self.ranks
        loss_sum = nll_sum = 0.0
        for i, batch in enumerate(micro):
            part, weight = ranks.share(batch, self.job.shard, self.job.sequence_shard)
            # context parallel: the model runs on sequence shards, backward too (a block
            # that recomputes its activations runs attention across the ranks again)
            with ranks.gradient_sync(i == len(micro) - 1), ranks.context():
                with self.autocast:
                    parts = self.job.loss(ranks.train_model, part)
                (parts.loss_sum * weight / tokens).backward()
            if weight:
                loss_sum += float(parts.loss_sum.detach())
                nll_sum += parts.nll_sum  # unsmoothed, from the same logits
        loss_sum, nll_sum = ranks.reduce(loss_sum, nll_sum)
        if not math.isfinite(loss_sum):
            raise FloatingPointError(
                f"training loss is {loss_sum} at step {step}; try a lower lr (now {lr:.3g}), "
                "a longer warm-up or gradient clipping"
            )
        return loss_sum, nll_sum

    def report(self, step: int, lr: float, tokens: int) -> None:
        """8) progress on screen and, every log_every steps, a record in metrics.jsonl;
        9) callbacks: one returning True (on any rank) ends the run after this step."""
        config, last = self.config, self.state.history[-1]
        self.window_tokens += tokens
        speed = self.window_tokens / max(time.perf_counter() - self.window_start, 1e-9)
        smoothed = config.label_smoothing > 0
        self.bar.update(step, loss=last["loss"], lr=lr, tokens_per_s=speed,
                        ce=last["ce"] if smoothed else None)  # fmt: skip
        if step % config.log_every == 0:
            recent = self.state.history[-config.log_every :]
            self.log.append({"split": "train", "step": step, "lr": lr, "tokens_per_s": speed,
                             "loss": sum(h["loss"] for h in recent) / len(recent),
                             **_mean_ce(recent)})  # fmt: skip
            self.window_tokens, self.window_start = 0, time.perf_counter()
        if self.ranks.agree(_call(self.callbacks, {"event": "step", **last})):
            self.state.stopped = "callback"

    def save(self, name: str, training: bool) -> None:
        """Write checkpoint ``name``: ``best`` (weights and tokenizers, for inference) or,
        with ``training``, ``last`` (everything a resume needs)."""
        if self.run_dir is None:
            return
        state = self.state
        info = {"step": state.step, "metrics": state.evals[-1] if state.evals else {}}
        if not training:
            self.ranks.save(self.run_dir / name, state.step, tokenizers=self.job.tokenizers,
                            info=info)  # fmt: skip
            return
        train_state = {**asdict(state), "rng": self.rng[0], "config": self.config.to_dict()}
        self.ranks.save(self.run_dir / name, state.step, tokenizers=self.job.tokenizers,
                        info=info, train_state=train_state, rng=self.rng[1])  # fmt: skip

    def evaluate(self) -> None:
        """Validation metrics; the best checkpoint, early stopping, ``last``, callbacks."""
        config, state = self.config, self.state
        self.ranks.sync(state.step)
        metrics = _evaluate(self.job, self.ranks.model, self.autocast, config.metric)
        record = {"step": state.step, **metrics}
        state.evals.append(record)
        self.log.append({"split": "valid", **record})
        self.bar.message("eval " + describe_metrics(record))  # words, not metric keys
        value, best = metrics[config.metric], state.best
        better = math.isfinite(value) and (
            best is None or (value < best if config.metric_mode == "min" else value > best)
        )
        if better:
            state.best, state.best_step, state.bad_evals = value, state.step, 0
            self.save("best", training=False)
        else:
            state.bad_evals += 1
            if config.patience is not None and state.bad_evals >= config.patience:
                state.stopped = "early_stopping"
        self.save("last", training=True)
        if self.ranks.agree(_call(self.callbacks, {"event": "eval", **record})):
            state.stopped = "callback"

    def finish(self) -> None:
        """12) a last evaluation if the final step had none, then the ``last`` checkpoint."""
        evals = self.state.evals
        if self.job.evaluate is not None and (not evals or evals[-1]["step"] != self.state.step):
            self.evaluate()
        self.save("last", training=True)
        self.ranks.finish(self.state.step)

    def interrupted(self) -> None:
        """Ctrl-C: write ``last`` (one process only: ranks may be anywhere, so a data-parallel
        run cannot gather a checkpoint now)."""
        if self.run_dir is not None and not self.ranks.parallel:
            self.save("last", training=True)
            self.bar.message(f"interrupted: checkpoint of step {self.state.step} in "
                             f"{self.run_dir / 'last'}")  # fmt: skip

    def peer_error(self, err: Exception) -> PeerError | None:
        """Data-parallel: the error to raise when another rank failed or timed out."""
        if not (self.ranks.parallel and is_peer_failure(err)):
            return None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return PeerError(
            f"{self.ranks.world}: lost the other ranks at step {self.state.step + 1}: one of "
            f"them failed (its own error says why) or did not answer in time ({first})"
        )

    def plot(self) -> None:
        """13) the loss curve."""
        state = self.state
        if self.main and self.run_dir is not None and self.config.plot and state.history:
            try:
                plot_loss_curve(state.history, state.evals, self.run_dir / "loss.png",
                                smoothing=self.config.label_smoothing)  # fmt: skip
            except ImportError as err:
                self.bar.message(f"no loss.png: {err}")

    def summary(self) -> dict[str, Any]:
        """The fields of :class:`~qkv.train.TrainResult`."""
        s = self.state
        return dict(
            steps=s.step, history=s.history, evals=s.evals, best_metric=s.best,
            best_step=s.best_step, stopped=s.stopped or "steps", run_dir=self.run_dir,
            seconds=time.perf_counter() - self.start,
            tokens_per_second=self.train_tokens / self.train_seconds
            if self.train_seconds else 0.0,
        )  # fmt: skip


def _check(job: Job, config: TrainConfig) -> None:
    if config.context_parallel > 1 and job.sequence_shard is None:
        raise ValueError(
            f"--context-parallel {config.context_parallel}: this run cannot cut its sequences "
            "across processes; context parallelism trains decoder-only language models on a "
            "token stream (train_lm, qkv train --text)"
        )
    if config.patience is not None and job.evaluate is None:
        raise ValueError(f"patience={config.patience} needs validation data, got none")
    if job.evaluate is not None and job.metrics and config.metric not in job.metrics:
        raise ValueError(
            f"config.metric={config.metric!r} is not measured here; choose one of {job.metrics}"
        )


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
