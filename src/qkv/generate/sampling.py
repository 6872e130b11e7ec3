"""Choosing the next token from logits: temperature, top-k, top-p (nucleus), min-p, seeded draws.

The order is the usual one (transformers' warpers): divide the logits by the temperature, keep
the ``k`` largest (top-k), then keep the smallest set of tokens whose probability mass reaches
``p`` (top-p, Holtzman et al. 2020), then the tokens at least ``min_p`` times as probable as
the most probable (min-p), renormalise and draw.

Draws are reproducible and independent across rows: row ``b`` has its own
``torch.Generator`` (seeded ``seed + b`` by default) and draws one uniform number per step by
inverse-CDF, so a row samples the same tokens whether it is decoded alone or in a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from qkv.checks import is_number
from qkv.generate.args import check_sampling, check_seed
from qkv.generate.controls import check_min_p

__all__ = ["Sampler", "filter_logits", "min_p_keep", "top_p_keep"]


def top_p_keep(probs: Tensor, p: float) -> Tensor:
    """The nucleus: for each row the smallest set of tokens whose total probability >= ``p``.

    Tokens are taken from the most probable down; a token is kept if the mass of the tokens
    before it is still below ``p`` (so the most probable token is always kept). Equal
    probabilities are taken in index order.

    Args:
        probs: ``(B, V)`` probabilities (rows summing to 1).
        p: in ``(0, 1]``.

    Returns:
        ``(B, V)`` bool, True = kept.

    Raises:
        ValueError: ``p`` outside ``(0, 1]``.
    """
    if not is_number(p) or not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {p!r}")
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # (B, V) each
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # (B, V)
    keep_sorted = mass_before < p  # (B, V)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # (B, V)


def min_p_keep(logits: Tensor, min_p: float) -> Tensor:
    """Min-p: for each row the tokens whose probability is at least ``min_p`` times the
    largest, and the most probable token in any case (transformers' ``MinPLogitsWarper`` with
    ``min_tokens_to_keep=1``).

    Args:
        logits: ``(B, V)``.
        min_p: in ``[0, 1]``.

    Returns:
        ``(B, V)`` bool, True = kept.
    """
    probs = logits.softmax(-1)  # (B, V)
    keep = probs >= min_p * probs.amax(-1, keepdim=True)  # (B, V)
    return keep.scatter(-1, probs.argmax(-1, keepdim=True), True)


def filter_logits(
    logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, min_p: float | None = None,
) -> Tensor:  # fmt: skip
    """Tempered logits with everything outside top-k / top-p / min-p set to ``-inf``.

    Args:
        logits: ``(B, V)``.
        temperature: > 0; below 1 sharpens, above 1 flattens.
        top_k: keep the ``k`` largest logits per row (ties at the k-th value all kept); None
            = all.
        top_p: keep the nucleus of mass ``p`` (:func:`top_p_keep`); None = all.
        min_p: then keep the tokens at least ``min_p`` times as probable as the most probable
            (:func:`min_p_keep`); None = all.

    Returns:
        ``(B, V)`` float logits.

    Raises:
        ValueError: ``temperature`` not a finite number > 0, ``top_k`` not an int >= 1,
            ``top_p`` outside ``(0, 1]``, ``min_p`` outside ``[0, 1]``.
    """
    if not is_number(temperature) or not temperature > 0:
        raise ValueError(f"temperature must be > 0 here (0 means greedy), got {temperature!r}")
    check_sampling(temperature, top_k, top_p)
    check_min_p(min_p)
    out = logits.float() / temperature  # (B, V)
    if top_k is not None:
        kth = out.topk(min(top_k, out.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p is not None:
        keep = top_p_keep(out.softmax(-1), top_p)  # (B, V)
        out = out.masked_fill(~keep, float("-inf"))
    if min_p is not None:
        out = out.masked_fill(~min_p_keep(out, min_p), float("-inf"))
    return out


class Sampler:
    """Draws tokens with one seeded generator per row.

    Args:
        batch: ``B`` rows.
        seed: an int (row ``b`` is seeded ``seed + b``), ``B`` ints (one per row), or None (a
            seed drawn from torch's global generator, so ``torch.manual_seed`` still makes a
            run reproducible).
        temperature, top_k, top_p, min_p: as :func:`filter_logits`.
        device: where the generators live (CPU by default); the draws move to the logits'
            device, so one seed draws the same tokens on any device.

    Raises:
        ValueError: a bad seed (:func:`~qkv.generate.args.check_seed`), bad sampling
            parameters.
    """

    def __init__(
        self,
        batch: int,
        *,
        seed: int | Sequence[int] | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        seeds = check_seed(seed, batch)
        assert seeds is not None
        check_sampling(temperature, top_k, top_p)
        self.options = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        filter_logits(torch.zeros(1, 2), **self.options)
        self.generators = [torch.Generator(device).manual_seed(s) for s in seeds]

    def __call__(self, logits: Tensor) -> Tensor:
        """One token per row of ``logits (B, V)``; returns ``(B,)`` long."""
        probs = filter_logits(logits, **self.options).softmax(-1).double()  # (B, V)
        cdf = probs.cumsum(-1)  # (B, V)
        # Drawn where the generators live (CPU unless asked), so a seed draws the same
        # numbers whatever device the logits are on.
        u = torch.stack([
            torch.rand((), generator=g, device=g.device, dtype=torch.float64)
            for g in self.generators
        ]).to(cdf.device)  # (B,)
        # The first index whose cumulative mass exceeds u * total: a token of probability 0
        # adds nothing to the cumulative mass, so it can never be the first to exceed it.
        target = (u * cdf[:, -1])[:, None]  # (B, 1)
        tokens = torch.searchsorted(cdf, target, right=True)[:, 0]  # (B,)
        # Rounding could put u * total past the end: fall back to the last possible token.
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # (B,)
        return torch.minimum(tokens, last)

    def select(self, rows: Tensor) -> None:
        """Keep the generators of rows ``rows`` (after a session's ``select``)."""
        self.generators = [self.generators[i] for i in rows.tolist()]
