"""Normalisation layers: torch's own LayerNorm and RMSNorm, chosen by name.

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) · w + b     (Ba et al., 2016)
    RMSNorm(x)   = x / sqrt(mean(x²) + eps) · w                    (Zhang and Sennrich, 2019)

both over the last dimension ``E``, with the biased variance. qkv does not re-implement them:
``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` are used as they are, so state-dict keys
(``weight``, ``bias``) and numerics are torch's. ``torch.nn.RMSNorm`` needs torch >= 2.4.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["NORMS", "make_norm"]

NORMS = ("layernorm", "rmsnorm")


def make_norm(kind: str, d_model: int, *, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """Build the normalisation layer a model config names.

    Args:
        kind: ``"layernorm"`` (``torch.nn.LayerNorm``) or ``"rmsnorm"`` (``torch.nn.RMSNorm``).
        d_model: model width ``E`` (normalised over the last dimension).
        eps: added to the variance / mean square (LayerNorm 1e-5 in torch, BERT 1e-12;
            Llama's RMSNorm 1e-5 or 1e-6).
        bias: LayerNorm only: whether it has an additive ``bias`` (GPT-2 yes; some models no).
            RMSNorm has no bias, so the flag is ignored for it.

    Returns:
        The module, mapping ``(..., E) -> (..., E)`` with weight ones (and bias zeros).

    Raises:
        ValueError: unknown ``kind`` (the message lists the known ones), ``d_model`` not a
            positive int, ``eps`` not positive.
        RuntimeError: ``"rmsnorm"`` with a torch older than 2.4 (no ``torch.nn.RMSNorm``).
    """
    if kind not in NORMS:
        raise ValueError(f"norm kind must be one of {NORMS}, got {kind!r}")
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
        raise ValueError(f"d_model must be a positive int, got {d_model!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    if kind == "layernorm":
        return nn.LayerNorm(d_model, eps=eps, bias=bias)
    rms_norm = getattr(torch.nn, "RMSNorm", None)
    if rms_norm is None:
        raise RuntimeError(
            f"norm kind 'rmsnorm' needs torch.nn.RMSNorm (torch >= 2.4); this is torch "
            f"{torch.__version__}"
        )
    return rms_norm(d_model, eps=float(eps))
