"""The mask linter: say what is wrong with a mask without raising (see :func:`check`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["MaskReport", "check"]


@dataclass(frozen=True)
class MaskReport:
    """What :func:`check` found. ``ok`` is True when there is nothing to report.

    Attributes:
        problems: errors that make the mask unusable (wrong dtype or shape, NaN).
        warnings: legal but probably unintended (rows with no visible key, +inf).
        dead_rows: number of query rows (over all broadcast positions) with no visible key.
    """

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    dead_rows: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.warnings

    def __str__(self) -> str:
        if self.ok:
            return "mask ok"
        lines = [f"error: {p}" for p in self.problems]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def check(
    mask: object,
    T: int,
    S: int,
    *,
    batch_shape: Sequence[int] = (),
    num_heads: int | None = None,
) -> MaskReport:
    """Say what is wrong with ``mask`` for scores of shape ``(*batch_shape, H, T, S)``.

    Checks the type and dtype (bool keep mask or float additive mask), that the shape
    broadcasts without enlarging the scores, NaN and +inf in float masks, and query rows with
    no visible key (which attention turns into zero rows). Never raises on a bad mask.
    """
    problems: list[str] = []
    warnings: list[str] = []
    if not isinstance(mask, Tensor):
        return MaskReport(problems=[f"mask must be a torch.Tensor, got {type(mask).__name__}"])
    if mask.dtype != torch.bool and not mask.is_floating_point():
        problems.append(
            f"dtype {mask.dtype} is neither bool (True = may attend) nor float (added to the "
            "scores); integer 0/1 masks are ambiguous, convert with mask.bool()"
        )
    heads = () if num_heads is None else (num_heads,)
    full = (*batch_shape, *heads, T, S)
    try:
        fits = torch.broadcast_shapes(mask.shape, full) == torch.Size(full)
    except RuntimeError:
        fits = False
    if not fits or mask.dim() > len(full):
        problems.append(
            f"shape {tuple(mask.shape)} does not broadcast to the scores {full} "
            "(expected trailing dimensions (T, S) or 1s)"
        )
    if problems:
        return MaskReport(problems=problems)
    dead = 0
    if mask.dtype == torch.bool:
        if S > 0:
            dead = int((~mask.any(dim=-1)).sum())
    else:
        if torch.isnan(mask).any():
            problems.append(f"{int(torch.isnan(mask).sum())} NaN entries; use -inf to hide")
        if torch.isposinf(mask).any():
            warnings.append("+inf entries give NaN weights; use large finite values")
        if S > 0:
            dead = int(torch.isneginf(mask).all(dim=-1).sum())
    if dead:
        warnings.append(
            f"{dead} query row(s) see no key; attention gives them zero output and weights"
        )
    if mask.dtype == torch.bool and _inverted_causal(mask, T, S):
        warnings.append(
            "this looks like an inverted causal mask (True above the diagonal): qkv's bool "
            "masks say True = may attend, torch.nn.MultiheadAttention's True = hide; pass "
            "~mask, or convert with qkv.masks.from_mha"
        )
    return MaskReport(problems=problems, warnings=warnings, dead_rows=dead)


def _inverted_causal(mask: Tensor, T: int, S: int) -> bool:
    """Whether a bool mask keeps exactly the keys after each query (top-left or bottom-right
    diagonal): the torch.nn.MultiheadAttention polarity of a causal mask."""
    if T < 2 or S < 2 or mask.shape[-2:] != (T, S):
        return False
    i = torch.arange(T, device=mask.device)[:, None]
    j = torch.arange(S, device=mask.device)[None, :]
    return any(bool((mask == (j > i + shift)).all()) for shift in {0, S - T})
