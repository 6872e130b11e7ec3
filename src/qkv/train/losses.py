"""Token-level cross-entropy with label smoothing, summed so that batches can be combined.

Label smoothing (Szegedy et al. 2016; used by "Attention Is All You Need" with epsilon 0.1)
trains against ``(1 - eps) * one_hot(target) + eps / V`` instead of the one-hot target: the
model is penalised for becoming over-confident, which costs a little perplexity and buys
accuracy and BLEU. It is :func:`torch.nn.functional.cross_entropy` with ``label_smoothing``;
padded positions (``ignore_index = pad_id``) contribute nothing.

The loss is returned as a *sum* over real tokens together with the token count, so a step
that accumulates several micro-batches divides once by the tokens of the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LossParts", "token_loss"]


@dataclass(frozen=True)
class LossParts:
    """A summed loss and the counts needed to average it.

    Attributes:
        loss_sum: scalar tensor, the (smoothed) cross-entropy summed over real tokens.
        nll_sum: float, the unsmoothed negative log-likelihood summed over real tokens (for
            perplexity; equals ``loss_sum`` when there is no smoothing).
        tokens: number of real (non-pad) target tokens.
        correct: how many of them the argmax predicts.
    """

    loss_sum: Tensor
    nll_sum: float
    tokens: int
    correct: int


def token_loss(
    logits: Tensor, targets: Tensor, *, pad_id: int | None = 0, label_smoothing: float = 0.0
) -> LossParts:
    """Cross-entropy of next-token ``logits`` against ``targets``, summed over real tokens.

    Args:
        logits: ``(B, T, V)`` unnormalised scores.
        targets: ``(B, T)`` token ids; positions equal to ``pad_id`` are ignored.
        pad_id: the padding id, or None when every position is real (language modelling).
        label_smoothing: epsilon in ``[0, 1)``.

    Returns:
        :class:`LossParts`.

    Raises:
        ValueError: shapes that do not match ``(B, T, V)`` / ``(B, T)``, a bad epsilon.
        TypeError: integer logits or floating-point targets.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be (B, T, V) and targets (B, T), got logits {tuple(logits.shape)} "
            f"and targets {tuple(targets.shape)}"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got dtype {logits.dtype}")
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing!r}")
    V = logits.shape[-1]
    flat_logits = logits.reshape(-1, V).float()  # (B*T, V); fp32 loss even under autocast
    flat_targets = targets.reshape(-1)  # (B*T,)
    ignore = -100 if pad_id is None else pad_id
    loss_sum = F.cross_entropy(
        flat_logits, flat_targets, ignore_index=ignore, label_smoothing=label_smoothing,
        reduction="sum",
    )  # fmt: skip
    real = flat_targets != ignore  # (B*T,)
    if label_smoothing == 0.0:
        nll_sum = float(loss_sum.detach())
    else:
        nll = F.cross_entropy(
            flat_logits.detach(), flat_targets, ignore_index=ignore, reduction="sum"
        )
        nll_sum = float(nll)
    correct = int(((flat_logits.detach().argmax(-1) == flat_targets) & real).sum())
    return LossParts(loss_sum, nll_sum, int(real.sum()), correct)
