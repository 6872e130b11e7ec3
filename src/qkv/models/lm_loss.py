"""The language-modelling loss a model returns when given ``labels``, as transformers does.

``DecoderLM(input_ids, labels=labels)`` returns :class:`CausalLMOutput` (``.loss``,
``.logits``) instead of the bare logits: ``loss`` is the mean cross-entropy of each
position's logits against the *next* label (``logits[:, :-1]`` against ``labels[:, 1:]``:
pass the input ids themselves as labels), positions labelled ``-100`` ignored, computed in
float32 at least (float64 stays float64). This is transformers' ``labels=`` contract, so code
written for ``AutoModelForCausalLM`` reads ``.loss`` and ``.logits`` unchanged. Training
loops that need sums over tokens (qkv's own, :func:`qkv.train.token_loss`) take the logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["IGNORE_INDEX", "CausalLMOutput", "causal_lm_loss"]

IGNORE_INDEX = -100  # a label that takes no part in the loss (transformers' and torch's)


class CausalLMOutput(NamedTuple):
    """``loss``: a scalar tensor; ``logits``: ``(B, T, V)``."""

    loss: Tensor
    logits: Tensor


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy of ``logits (B, T, V)`` against ``labels (B, T)``.

    Raises:
        TypeError: labels that are not an integer tensor.
        ValueError: labels of another shape or device, outside ``[0, V)`` (other than
            ``-100``), or with no position left to predict (all ignored: the mean would be
            NaN).
    """
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        got = labels.dtype if isinstance(labels, Tensor) else type(labels).__name__
        raise TypeError(f"labels must be an integer tensor (B, T), got {got}")
    B, T, V = logits.shape
    if tuple(labels.shape) != (B, T) or labels.device != logits.device:
        raise ValueError(f"labels must have the shape of input_ids {(B, T)} on "
                         f"{logits.device}, got {tuple(labels.shape)} on {labels.device}")
    targets = labels[:, 1:]  # (B, T-1): position t predicts label t+1
    used = targets != IGNORE_INDEX
    bad = used & ((targets < 0) | (targets >= V))
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"labels[{b}, {t + 1}] = {int(targets[b, t])} is outside the "
                         f"vocabulary [0, {V}) (use {IGNORE_INDEX} to leave a position out)")
    if not bool(used.any()):
        raise ValueError(f"labels leave no position to predict (after the first, every one "
                         f"is {IGNORE_INDEX}, or T = 1): the mean loss would be NaN")
    wide = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))  # (B, T-1, V)
    return F.cross_entropy(wide.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX)
