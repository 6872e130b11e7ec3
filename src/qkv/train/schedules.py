"""Learning-rate schedules and the AdamW optimizer with the usual weight-decay groups.

A schedule here is a pure function of the step, ``lr_at(step, config) -> float``, applied by
the loop before each optimizer step. It has no state of its own, so a resumed run only needs
the step number to continue the schedule exactly.

Steps count from 1 (the first optimizer step). All three schedules warm up linearly,
``lr * step / warmup`` for ``step <= warmup``, then:

* ``"inverse_sqrt"``: ``lr * sqrt(warmup / step)``. This is the schedule of "Attention Is All
  You Need", ``d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``, written with its peak
  ``lr`` (reached at ``step == warmup``) instead of its scale; :func:`paper_peak_lr` gives the
  paper's peak for a model width.
* ``"cosine"``: from ``lr`` down to ``lr * min_lr_ratio`` along half a cosine, reaching the
  floor at ``config.steps``.
* ``"constant"``: ``lr``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qkv.checks import positive_int
from qkv.nn.positions import LearnedPositionalEmbedding
from qkv.train.config import TrainConfig

__all__ = ["lr_at", "make_optimizer", "paper_peak_lr", "parameter_groups"]


def paper_peak_lr(d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The peak of the paper's schedule, ``scale * d_model^-0.5 * warmup^-0.5``.

    With ``TrainConfig(lr=paper_peak_lr(d, w), warmup=w, schedule="inverse_sqrt")`` the
    learning rate at every step equals ``scale * d^-0.5 * min(step^-0.5, step * w^-1.5)``.

    Raises:
        ValueError: ``d_model`` or ``warmup`` not a positive int, ``scale`` not positive.
    """
    positive_int("d_model", d_model)
    positive_int("warmup", warmup)
    if not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    return scale * d_model**-0.5 * warmup**-0.5


def lr_at(step: int, config: TrainConfig) -> float:
    """The learning rate of optimizer step ``step`` (1-based) under ``config``'s schedule.

    Raises:
        ValueError: ``step < 1``.
    """
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (steps count from 1), got {step!r}")
    lr, warmup = config.lr, config.warmup
    # 1) linear warm-up, shared by every schedule
    if step <= warmup:
        return lr * step / warmup
    # 2) after the warm-up, each schedule's own decay
    if config.schedule == "inverse_sqrt":
        return lr * math.sqrt(warmup / step)
    if config.schedule == "cosine":
        span = max(config.steps - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        floor = lr * config.min_lr_ratio
        return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed group and a not-decayed group.

    Weight decay pulls weights toward zero; that regularises matrices, but on a bias, a norm's
    gain or an embedding row it only distorts (an embedding row of a rare token would shrink
    every step it is not used). So matrices decay; parameters with fewer than 2 dimensions
    and parameters of embedding modules do not. A tied weight (output projection = token
    embedding) is one parameter and counts as an embedding.

    Returns:
        ``[{"params": [...], "weight_decay": weight_decay}, {"params": [...],
        "weight_decay": 0.0}]``, in ``model.parameters()`` order.
    """
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding | LearnedPositionalEmbedding):
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    decay, keep = [], []
    for p in model.parameters():  # shared (tied) parameters are yielded once
        if not p.requires_grad:
            continue
        (keep if p.dim() < 2 or id(p) in no_decay else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over :func:`parameter_groups` with ``config``'s betas, eps and weight decay.

    The learning rate is set by the loop at every step (:func:`lr_at`); here it starts at 0.

    Raises:
        ValueError: a model without trainable parameters.
    """
    groups = parameter_groups(model, config.weight_decay)
    if not any(g["params"] for g in groups):
        raise ValueError(f"model has no trainable parameters: {type(model).__name__}")
    # foreach=False: one kernel per tensor, the same arithmetic on every platform and run.
    return torch.optim.AdamW(
        groups, lr=0.0, betas=config.betas, eps=config.eps, foreach=False
    )
