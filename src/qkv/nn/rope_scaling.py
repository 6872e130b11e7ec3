"""RoPE frequency scaling: running a rotary model past the length it was trained at.

Plain RoPE turns pair ``i`` of a ``d``-wide rotated slice at ``θ_i = base^(-2i/d)``. The
scalings change those frequencies (and, for YaRN, the size of the rotated vectors):

* ``"linear"`` (position interpolation; Chen et al., 2023): ``θ_i / factor``.
* ``"dynamic"`` (dynamic NTK scaling; bloc97 and emozilla, 2023): the base grows with the
  current length ``L = max(position) + 1`` once it passes ``original_max_len``:
  ``base' = base · (factor·L / original_max_len - (factor - 1))^(d / (d - 2))``.
* ``"llama3"`` (Llama 3.1, Meta 2024): wavelengths ``λ_i = 2π/θ_i`` longer than
  ``original_max_len / low_freq_factor`` are divided by ``factor``, shorter than
  ``original_max_len / high_freq_factor`` are kept, and the ones between are blended with
  ``s = (original_max_len/λ_i - low_freq_factor) / (high_freq_factor - low_freq_factor)``:
  ``θ'_i = (1 - s)·θ_i/factor + s·θ_i``.
* ``"yarn"`` (Peng et al., 2023): each frequency blends interpolation ``θ_i / factor`` and
  extrapolation ``θ_i`` by a linear ramp over the pairs between the ones turning
  ``beta_fast`` and ``beta_slow`` times within ``original_max_len``; cos and sin are multiplied
  by ``attention_factor`` (default ``0.1·ln(factor) + 1``), so the scores by its square.

The formulas follow the papers as Hugging Face's ``modeling_rope_utils`` implements them, so
checkpoints that name these scalings in ``config.json`` load with equal outputs.
:class:`RopeScaling` is a frozen, validated record; :func:`inverse_frequencies` computes
``θ`` in float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

from qkv.checks import is_int, is_number

__all__ = ["ROPE_SCALINGS", "RopeScaling", "inverse_frequencies"]

ROPE_SCALINGS = ("linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling and its parameters (see the module docstring for the formulas).

    Attributes:
        kind: ``"linear"``, ``"dynamic"``, ``"llama3"`` or ``"yarn"``.
        factor: the length multiplier (> 0; ``>= 1`` in practice).
        original_max_len: the training length (needed by ``dynamic``, ``llama3``, ``yarn``).
        low_freq_factor, high_freq_factor: ``llama3``'s band edges (1 and 4 in Llama 3.1).
        beta_fast, beta_slow: ``yarn``'s ramp edges in rotations (32 and 1).
        attention_factor: ``yarn``'s factor on cos and sin; None = ``0.1·ln(factor) + 1``
            (1 when ``factor <= 1``).
        truncate: ``yarn``: round the ramp's edges to whole pairs (floor / ceil).

    Raises:
        ValueError: an unknown kind, a non-positive or non-finite number, a missing
            ``original_max_len``, ``high_freq_factor <= low_freq_factor``.
    """

    kind: str
    factor: float = 1.0
    original_max_len: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RopeScaling.kind must be one of {ROPE_SCALINGS}, got {self.kind!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if not is_number(value) or not value > 0:
                raise ValueError(f"RopeScaling.{name} must be a finite number > 0, got {value!r}")
        if self.attention_factor is not None and not (
            is_number(self.attention_factor) and self.attention_factor > 0
        ):
            raise ValueError(
                "RopeScaling.attention_factor must be None or a finite number > 0, got "
                f"{self.attention_factor!r}"
            )
        n = self.original_max_len
        if n is not None and (not is_int(n) or n < 1):
            raise ValueError(f"RopeScaling.original_max_len must be a positive int, got {n!r}")
        if n is None and self.kind != "linear":
            raise ValueError(f"RopeScaling kind {self.kind!r} needs original_max_len")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        if not isinstance(self.truncate, bool):
            raise ValueError(f"RopeScaling.truncate must be a bool, got {self.truncate!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RopeScaling:
        """Build from :meth:`to_dict`'s form.

        Raises:
            ValueError: not a mapping, unknown keys, no ``kind``, or invalid values.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"rope_scaling must be a mapping or None, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown or "kind" not in d:
            raise ValueError(
                f"rope_scaling: unknown keys {unknown} or no 'kind'; known: {sorted(known)}"
            )
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-able."""
        return asdict(self)

    @property
    def cos_sin_factor(self) -> float:
        """The factor on cos and sin: YaRN's attention factor, 1 for the others."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def depends_on_length(self) -> bool:
        """Whether the frequencies change with the current length (``dynamic``)."""
        return self.kind == "dynamic"


def _plain(dim: int, base: float) -> Tensor:
    even = torch.arange(0, dim, 2, dtype=torch.float64)  # (d/2,)
    return base ** (-even / dim)  # (d/2,)


def inverse_frequencies(
    dim: int, base: float, scaling: RopeScaling | None = None, length: int | None = None
) -> Tensor:
    """The rotation frequencies ``θ (d/2,)`` in float64 for a ``dim``-wide rotated slice.

    Args:
        dim: rotated width ``d`` (even).
        base: frequency base.
        scaling: None (plain RoPE) or a :class:`RopeScaling`.
        length: the current length ``max(position) + 1`` (read by ``dynamic`` only; None or
            at most ``original_max_len`` gives the unscaled frequencies).

    Returns:
        ``(d/2,)`` float64 on the CPU.
    """
    if scaling is None:
        return _plain(dim, base)
    factor, n = scaling.factor, scaling.original_max_len
    if scaling.kind == "linear":
        return _plain(dim, base) / factor
    assert n is not None
    if scaling.kind == "dynamic":
        L = max(length or n, n)
        return _plain(dim, base * (factor * L / n - (factor - 1)) ** (dim / (dim - 2)))
    if scaling.kind == "llama3":
        theta = _plain(dim, base)
        wavelen = 2 * math.pi / theta  # (d/2,)
        low, high = n / scaling.low_freq_factor, n / scaling.high_freq_factor
        smooth = (n / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        scaled = torch.where(wavelen > low, theta / factor, theta)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high) & (wavelen <= low)
        return torch.where(medium, blended, scaled)
    # YaRN: a ramp over the pairs between beta_fast and beta_slow rotations in n positions.
    def pair_of(rotations: float) -> float:
        return dim * math.log(n / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = pair_of(scaling.beta_fast), pair_of(scaling.beta_slow)
    if scaling.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # a one-pair ramp: avoid dividing by zero (as the reference does)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep θ_i (fast pairs), 0: interpolate θ_i / factor
    theta = _plain(dim, base)
    return theta / factor * (1 - extrapolate) + theta * extrapolate
