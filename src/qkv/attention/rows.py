"""The softmax's edge rows, written once for every backend: rows that see no key, non-finite
query rows, and exps kept out of the subnormal range.

* A row with no visible key ("dead row") gives zero weights, zero output and zero gradient:
  :func:`dead_rows`, :func:`safe_row_max`, :func:`safe_total` and :func:`safe_lse`.
* A non-finite query row gives a NaN output row, dead or not: :func:`poison_rows`.
* :func:`exp_shifted_` / :func:`exp_floored_`: the softmax's exps with weights below
  ``exp(EXP_FLOOR)`` set to exactly 0, at the speed of normal floats.

Re-exported by :mod:`qkv.attention.masks`, where callers find them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkv.checks import values_unknown

__all__ = [
    "EXP_FLOOR",
    "dead_rows",
    "exp_floored_",
    "exp_shifted_",
    "poison_rows",
    "row_abs_max",
    "safe_lse",
    "safe_row_max",
    "safe_total",
]


# --- dead rows: no visible key gives zero weights, zero output, zero gradient ---------------


def dead_rows(mask: Tensor) -> Tensor:
    """Rows of a dense mask ``(..., T|1, S)`` with no visible key: ``(..., T|1, 1)`` bool."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def safe_row_max(row_max: Tensor) -> Tensor:
    """Row maxima with the dead rows' ``-inf`` replaced by 0: ``exp(s - max)`` is then an
    exact 0 on a dead row instead of ``exp(-inf + inf) = NaN``."""
    return row_max.masked_fill(torch.isneginf(row_max), 0.0)


# exp(x) for x below about -87 (float32) gives a subnormal result, which torch's vectorised
# CPU exp takes ~90x longer to make than a normal one, and exp(-inf) ~9x longer; a weight
# near the subnormal range makes the P·V matmul ~60x slower too (measured on AVX-512).
EXP_FLOOR = {torch.float32: -80.0, torch.float64: -700.0}


def exp_shifted_(scores: Tensor, row_max: Tensor) -> Tensor:
    """``exp(scores - row_max)`` in place over ``scores (..., S')``, ``row_max (..., 1)``,
    with weights below ``exp(EXP_FLOOR)`` (1.8e-35 in float32, 1e-304 in float64) set to
    exactly 0, as a flush-to-zero unit would.

    The differences are raised to the floor before the exp and the results at the floor
    zeroed after it, so every exp and every weight stays in the fast, normal range: ALiBi at
    T = 2048 went from 4.5 ms of exp and 5.5 ms of P·V a tile to 0.2 and 1.0. A masked key
    (``-inf``) gets weight 0 exactly, a row that sees no key (``row_max = -inf``) all zeros,
    and NaN stays NaN. Against the exact softmax a row loses at most ``S' · 1.8e-35`` of its
    weight (float32), far below the dtype's precision.
    """
    return exp_floored_(scores.sub_(safe_row_max(row_max)))


def exp_floored_(x: Tensor) -> Tensor:
    """``exp(x)`` in place for ``x <= 0`` (scores minus a row maximum or log-sum-exp), with
    results below ``exp(EXP_FLOOR)`` set to exactly 0 (see :func:`exp_shifted_`)."""
    floor = EXP_FLOOR.get(x.dtype)
    if floor is None:
        return x.exp_()
    p = x.clamp_min_(floor).exp_()
    return torch.nn.functional.threshold_(p, math.exp(floor) * 1.5, 0.0)


def safe_total(total: Tensor) -> Tensor:
    """Softmax denominators with a dead row's 0 replaced by 1 (its numerators are all 0)."""
    return total.masked_fill(total == 0, 1.0)


# --- non-finite inputs: never hidden ------------------------------------------------------


def poison_rows(t: Tensor, query: Tensor) -> Tensor:
    """``t (B, H, T, X)`` with NaN in every row whose query row ``(B, H, T, D)`` holds NaN or
    ``±inf``; every other row unchanged (``+0`` is added to it).

    The rule for non-finite queries on every backend, even on a row that sees no key (a
    mask, or an infinite query whose scores are all ``-inf``, skips its scores: the softmax
    alone would give it zeros). It is ``t + 0 · max_d |q_d|``: two tensor ops over ``q`` and
    ``t``, no host sync, no gradient through the query (the gradient of ``t`` passes
    unchanged).
    """
    if _all_finite_on_cpu(query):
        return t  # the usual case, found with one summing pass over q
    worst = row_abs_max(query.detach(), one_kernel=query.is_cuda)  # (B, H, T, 1)
    return torch.add(t, worst.to(t.dtype), alpha=0)  # 0·(NaN or inf) is NaN, 0·x is 0


def row_abs_max(q: Tensor, one_kernel: bool) -> Tensor:
    """``max_d |q_d|`` of each row of ``q (..., D)``: ``(..., 1)``, NaN where the row holds NaN.

    ``one_kernel``: ``torch.linalg.vector_norm(ord=inf)``, one reduction kernel on CUDA (ATen's
    absolute-maximum reduction, which propagates NaN), where ``abs().amax()`` launches two: a
    kernel fewer in every call on a GPU. Otherwise ``abs().amax()``, which on the CPU is ~10x
    faster than ``vector_norm`` (AMD EPYC, one thread, poisoning included: 6.7 µs against 56
    on ``(4, 32, 1, 128)``, 0.15 ms against 2.05 on ``(1, 8, 1024, 64)``).
    """
    if one_kernel:
        return torch.linalg.vector_norm(q, ord=math.inf, dim=-1, keepdim=True)
    return q.abs().amax(dim=-1, keepdim=True)


# Below this many query entries (a decoding step's few rows) the poisoning's three small ops
# cost less than reading a value back, and a model's layers then read nothing on the host.
FINITE_READ_MIN = 1 << 14


def _all_finite_on_cpu(query: Tensor) -> bool:
    """Whether every entry of a CPU ``query`` is finite, read with one sum (inf or NaN in q
    makes the sum non-finite; a finite q whose sum overflows only sends it the long way).

    On the CPU reading a value costs no device sync, and the sum is one pass over q, where
    the poisoning is three (measured: 5 ms of a 135 ms call at T = 4096, fp32). Never while
    tracing, on other devices or under ``torch.func`` transforms, where the value is not
    readable or would cost a sync.
    """
    if not query.is_cpu or query.numel() < FINITE_READ_MIN or values_unknown(query):
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(query):
        return False
    return math.isfinite(query.detach().sum().item())


def safe_lse(lse: Tensor) -> Tensor:
    """Log-sum-exp with a dead row's ``-inf`` replaced by ``+inf``: ``exp(s - lse) = 0`` for
    every key of the row, so weights rebuilt from it (and their gradients) are zeros."""
    return lse.masked_fill(torch.isneginf(lse), float("inf"))
