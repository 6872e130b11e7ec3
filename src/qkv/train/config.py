"""``TrainConfig``: every knob of a training run in one frozen, validated dataclass.

A config is built in code (``TrainConfig(steps=2000, lr=1e-3)``), or read from a small TOML
file with :meth:`TrainConfig.from_toml` whose keys are the field names::

    steps = 2000
    batch_size = 64
    lr = 1e-3
    schedule = "cosine"
    warmup = 100
    run_dir = "runs/copy"

Unknown keys are errors that name the key, so a typo never silently keeps a default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from qkv.checks import is_int, is_number
from qkv.data.files import read_toml

__all__ = ["CONTEXT_METHODS", "METRIC_MODES", "SCHEDULES", "TrainConfig"]

# The most optimizer steps a config accepts (qkv train --steps 10**30 ran with no end).
MAX_STEPS = 10**9

SCHEDULES = ("inverse_sqrt", "cosine", "constant")
# How attention crosses the processes of a context-parallel run: qkv.distributed.context.METHODS
# (not imported here: this module loads with ``qkv train --help``, torch.distributed need not).
CONTEXT_METHODS = ("auto", "ring", "all_to_all")
# Metrics that early stopping and the ``best`` checkpoint may watch, and which way is better.
METRIC_MODES = {
    "loss": "min",
    "perplexity": "min",
    "token_accuracy": "max",
    "exact_match": "max",
    "bleu": "max",
    "chrf": "max",
}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train: optimisation, schedule, batching, evaluation, checkpoints.

    Attributes:
        steps: optimizer steps to run (each may accumulate several micro-batches).
        batch_size: examples (seq2seq) or windows (LM) per micro-batch; None = 32, unless
            ``batch_tokens`` is given.
        batch_tokens: padded tokens per seq2seq micro-batch (length-bucketed), instead of
            ``batch_size``.
        block_size: window length ``T`` for language-model training.
        pack: language models trained on documents (:func:`~qkv.train.train_lm` given a list
            of token-id documents): pack several documents into each row of ``block_size``
            positions, with document ids (no attention across documents, positions restart;
            :mod:`qkv.data.packing`), instead of one document per padded row.
        lr: peak learning rate (reached at the end of the warm-up).
        schedule: ``"inverse_sqrt"`` (the paper's: linear warm-up, then ``lr * sqrt(warmup /
            step)``; see :func:`qkv.train.schedules.paper_peak_lr`), ``"cosine"`` (linear
            warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``steps``) or
            ``"constant"`` (linear warm-up, then flat).
        warmup: warm-up steps (>= 1 for ``"inverse_sqrt"``; 0 means none for the others).
        min_lr_ratio: floor of the cosine schedule as a fraction of ``lr``.
        weight_decay: AdamW decoupled weight decay, applied to matrices only (never to
            biases, norm weights or embeddings).
        betas, eps: AdamW moments; the default is the paper's (0.9, 0.98), 1e-9.
        label_smoothing: epsilon of label smoothing (0 = plain cross-entropy).
        clip: max global gradient norm; None = no clipping.
        accumulate: micro-batches per optimizer step (gradient accumulation); the loss is
            normalised by the target tokens of the whole step, so ``accumulate=k`` equals one
            batch k times larger.
        eval_every: evaluate on the validation data every this many steps (and at the end);
            None = only at the end.
        eval_examples: validation pairs decoded per evaluation (seq2seq; None = all).
        eval_batches: validation windows-batches per evaluation (LM).
        metric: the validation metric that picks the ``best`` checkpoint and drives early
            stopping (a key of :data:`METRIC_MODES`).
        patience: stop after this many evaluations without improvement of ``metric``;
            None = never stop early.
        seed: seeds torch, ``random`` and NumPy at the start, and the data order.
        bf16: run forward passes under ``torch.autocast(dtype=torch.bfloat16)``. Off by
            default: on a CPU without native bfloat16 (no AVX512-BF16/AMX) autocast is
            several times slower than float32 (``benchmarks/train_memory.py``: 3.1-3.6x on
            torch's AVX2 kernels, d_model 256), and saves less memory than
            ``checkpoint_activations``.
        checkpoint_activations: each block of the model (each element of its outermost
            ``nn.ModuleList``) recomputes its activations in backward instead of storing
            them (:mod:`qkv.train.memory`): less memory per step for about a third more
            compute, the same losses and weights. Training only; checkpoints are unchanged.
        device: where to train (``"cpu"``, ``"cuda"``, ...). In a data-parallel run
            ``"cuda"`` means each rank's own GPU, ``cuda:LOCAL_RANK``.
        fsdp: in a data-parallel run (a process group of several ranks, e.g. under
            ``torchrun``), shard parameters, gradients and optimizer state across the ranks
            with FSDP2 instead of keeping a whole replica per rank with DDP; no effect with
            one process.
        context_parallel: language models under ``torchrun``: the processes that share one
            sequence (context parallelism, :mod:`qkv.train.context`). Each of them holds
            about ``block_size / N`` positions of every row of its data-parallel group; the
            world size must be a multiple of ``N``. 1 = off (every process holds whole rows).
            Needs ``block_size >= 2N``; not with ``fsdp`` or ``pack``.
        context_method: how attention crosses those processes: ``"auto"``, ``"ring"`` or
            ``"all_to_all"`` (:func:`qkv.distributed.context.choose_method`).
        run_dir: folder for ``metrics.jsonl``, ``loss.png`` and the ``last``/``best``
            checkpoints; None = write nothing.
        save_every: also write ``last`` every this many steps; None = at evaluations and
            at the end only.
        log_every: steps per progress line / training ``metrics.jsonl`` record.
        progress: show a progress bar (rich when installed and on a terminal, else prints).
        plot: draw ``loss.png`` in ``run_dir`` at the end (needs matplotlib).

    Raises:
        ValueError: a field of the wrong type or out of range, naming the field.
    """

    steps: int = 1000
    batch_size: int | None = None
    batch_tokens: int | None = None
    block_size: int = 128
    pack: bool = False
    lr: float = 1e-3
    schedule: str = "inverse_sqrt"
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    label_smoothing: float = 0.0
    clip: float | None = 1.0
    accumulate: int = 1
    eval_every: int | None = None
    eval_examples: int | None = 500
    eval_batches: int = 20
    metric: str = "loss"
    patience: int | None = None
    seed: int = 0
    bf16: bool = False
    checkpoint_activations: bool = False
    device: str = "cpu"
    fsdp: bool = False
    context_parallel: int = 1
    context_method: str = "auto"
    run_dir: str | None = None
    save_every: int | None = None
    log_every: int = 10
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        self._check_ints()
        self._check_floats()
        if self.batch_size is None and self.batch_tokens is None:
            object.__setattr__(self, "batch_size", 32)
        if self.batch_size is not None and self.batch_tokens is not None:
            raise ValueError(
                f"give batch_size or batch_tokens, not both; got batch_size={self.batch_size}, "
                f"batch_tokens={self.batch_tokens}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "inverse_sqrt" and self.warmup < 1:
            raise ValueError(f"warmup must be >= 1 for schedule 'inverse_sqrt', got {self.warmup}")
        if self.metric not in METRIC_MODES:
            raise ValueError(f"metric must be one of {tuple(METRIC_MODES)}, got {self.metric!r}")
        betas = self.betas
        if not (
            isinstance(betas, tuple | list)
            and len(betas) == 2
            and all(is_number(b) and 0 <= b < 1 for b in betas)
        ):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        for name in ("bf16", "checkpoint_activations", "fsdp", "progress", "plot", "pack"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty str, got {self.device!r}")
        if self.run_dir is not None:
            if not isinstance(self.run_dir, str | os.PathLike):
                raise ValueError(f"run_dir must be a path or None, got {self.run_dir!r}")
            object.__setattr__(self, "run_dir", str(self.run_dir))
        self._check_context()

    def _check_ints(self) -> None:
        # (name, smallest allowed value, may be None)
        spec = [
            ("steps", 1, False), ("batch_size", 1, True), ("batch_tokens", 1, True),
            ("block_size", 1, False), ("warmup", 0, False), ("accumulate", 1, False),
            ("eval_every", 1, True), ("eval_examples", 1, True), ("eval_batches", 1, False),
            ("patience", 1, True), ("save_every", 1, True), ("log_every", 1, False),
        ]  # fmt: skip
        for name, low, optional in spec:
            v = getattr(self, name)
            if v is None and optional:
                continue
            if not is_int(v) or v < low:
                none = " or None" if optional else ""
                raise ValueError(f"{name} must be an int >= {low}{none}, got {v!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.steps > MAX_STEPS:  # a typo, not a plan: refused before anything is built
            raise ValueError(f"steps must be at most {MAX_STEPS:,} (at 1,000 steps a second, "
                             f"11 days of training), got {self.steps:,}")

    def _check_floats(self) -> None:
        checks = [
            ("lr", self.lr, lambda v: v > 0, "> 0"),
            ("min_lr_ratio", self.min_lr_ratio, lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("weight_decay", self.weight_decay, lambda v: v >= 0, ">= 0"),
            ("eps", self.eps, lambda v: v > 0, "> 0"),
            ("label_smoothing", self.label_smoothing, lambda v: 0 <= v < 1, "in [0, 1)"),
        ]
        for name, v, ok, want in checks:
            if not is_number(v) or not ok(v):
                raise ValueError(f"{name} must be a finite number {want}, got {v!r}")
        if self.clip is not None and (not is_number(self.clip) or self.clip <= 0):
            raise ValueError(f"clip must be a finite number > 0 or None, got {self.clip!r}")

    def _check_context(self) -> None:
        """``context_parallel`` and ``context_method`` (the flags are named: the command line
        is where they are usually given)."""
        n, method = self.context_parallel, self.context_method
        if not is_int(n) or n < 1:
            raise ValueError(f"context_parallel (--context-parallel) must be an int >= 1, "
                             f"got {n!r}")  # fmt: skip
        if method not in CONTEXT_METHODS:
            raise ValueError(f"context_method (--context-method) must be one of "
                             f"{CONTEXT_METHODS}, got {method!r}")  # fmt: skip
        if n == 1:
            return
        if self.block_size < 2 * n:
            raise ValueError(
                f"--context-parallel {n} exceeds block_size / 2 = {self.block_size // 2}: each "
                f"of the {n} processes sharing a sequence needs at least 2 of its "
                f"block_size={self.block_size} positions"
            )
        for name, flag in (("fsdp", "--fsdp"), ("pack", "--pack")):
            if getattr(self, name):
                raise ValueError(
                    f"--context-parallel {n} does not combine with {name}=True ({flag}): "
                    "context-parallel training runs under DDP on windows of a token stream"
                )

    @property
    def metric_mode(self) -> str:
        """``"min"`` or ``"max"``: which way :attr:`metric` improves."""
        return METRIC_MODES[self.metric]

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``betas`` as a list)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["betas"] = list(self.betas)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a dict of field values; an unknown key raises ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"a TrainConfig needs a dict of fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown TrainConfig key(s) {unknown}; known keys are {sorted(known)}"
            )
        data = dict(data)
        if isinstance(data.get("betas"), list):
            data["betas"] = tuple(data["betas"])
        return cls(**data)

    @classmethod
    def from_toml(cls, path: str | os.PathLike, **overrides: Any) -> TrainConfig:
        """Read a config from a TOML file of ``field = value`` lines; ``overrides`` win.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: invalid TOML (with the file name), an unknown key, a bad value.
            ImportError: Python 3.10 without the ``tomli`` package.
        """
        file = Path(path)
        data = read_toml(file, what="TrainConfig TOML file")
        data.update(overrides)
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from None

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
