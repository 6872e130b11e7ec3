"""What every model config shares: validation helpers and the JSON round trip.

Configs are frozen dataclasses (tinygrad, nanoGPT) that validate themselves in
``__post_init__``: a bad value raises ``ValueError`` naming the class, the field and the value
received, before any module is built. ``to_dict`` / ``from_dict`` give the JSON-able form that
checkpoints store.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Mapping
from typing import Any, TypeVar

from qkv.nn.block import NORM_PLACEMENTS
from qkv.nn.feedforward import FEEDFORWARD_KINDS
from qkv.nn.norms import NORMS

__all__ = [
    "ACTIVATIONS",
    "NORM_KINDS",
    "NORM_PLACEMENTS",
    "POSITIONS",
    "ConfigBase",
]

ACTIVATIONS = FEEDFORWARD_KINDS  # every feed-forward kind make_feedforward builds
NORM_KINDS = NORMS
# "relative": T5's bucketed relative position bias (models.parts.make_positions).
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "relative", None)

C = TypeVar("C", bound="ConfigBase")


class ConfigBase:
    """Mixin for the frozen config dataclasses: checks, ``to_dict``, ``from_dict``, summary."""

    # --- validation helpers, used from each config's __post_init__ -----------------------

    def _fail(self, name: str, expected: str, value: object) -> None:
        raise ValueError(f"{type(self).__name__}.{name} must be {expected}, got {value!r}")

    def _int(self, name: str, *, minimum: int = 1, optional: bool = False) -> None:
        value = getattr(self, name)
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
            self._fail(name, what + (" or None" if optional else ""), value)

    def _float(self, name: str, *, low: float, high: float | None = None) -> None:
        """A finite number in ``[low, high)`` (``low < value`` when ``high`` is None)."""
        value = getattr(self, name)
        ok = not isinstance(value, bool) and isinstance(value, (int, float))
        ok = ok and math.isfinite(value)
        if high is None:
            ok = ok and value > low
            what = f"a finite number > {low:g}"
        else:
            ok = ok and low <= value < high
            what = f"a number in [{low:g}, {high:g})"
        if not ok:
            self._fail(name, what, value)

    def _choice(self, name: str, options: tuple) -> None:
        value = getattr(self, name)
        if value not in options or isinstance(value, bool):
            self._fail(name, f"one of {options}", value)

    def _flag(self, name: str) -> None:
        if not isinstance(getattr(self, name), bool):
            self._fail(name, "a bool", getattr(self, name))

    def _token(self, name: str, vocab_size: int) -> None:
        """``None`` or a token id in ``[0, vocab_size)``."""
        value = getattr(self, name)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            self._fail(name, f"None or a token id in [0, {vocab_size})", value)

    def _heads(self, d_model: int, num_heads: int, num_kv_heads: int | None = None,
               d_head: int | None = None) -> None:
        """Head geometry: ``E % H == 0`` without ``d_head``; ``H % Hkv == 0``."""
        name = type(self).__name__
        if d_head is None and d_model % num_heads:
            raise ValueError(
                f"{name}.d_model ({d_model}) must be a multiple of num_heads ({num_heads}), "
                "or set d_head explicitly"
            )
        if num_kv_heads is not None and num_heads % num_kv_heads:
            raise ValueError(
                f"{name}.num_heads ({num_heads}) must be a multiple of num_kv_heads "
                f"({num_kv_heads}) for grouped-query attention"
            )

    def _relative(self) -> None:
        """``relative_buckets`` (>= 4) and ``relative_max_distance`` (> buckets // 2) of T5's
        relative bias (checked whatever ``positions`` is, so a saved config stays valid)."""
        self._int("relative_buckets", minimum=4)
        self._int("relative_max_distance")
        half = self.relative_buckets // 2  # type: ignore[attr-defined]
        if self.relative_max_distance <= half:  # type: ignore[attr-defined]
            self._fail("relative_max_distance", f"an int > relative_buckets // 2 = {half}",
                       self.relative_max_distance)  # type: ignore[attr-defined]  # fmt: skip

    def _rope_even(self, positions: str | None, head_width: int) -> None:
        if positions == "rope" and head_width % 2:
            raise ValueError(
                f"{type(self).__name__}.positions='rope' needs an even head width, but "
                f"d_model / num_heads (or d_head) = {head_width}"
            )

    # --- serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field as a JSON-able dict (ints, floats, strings, bools, None)."""
        assert dataclasses.is_dataclass(self)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls: type[C], d: Mapping[str, Any]) -> C:
        """Build (and validate) a config from :meth:`to_dict`'s output.

        Raises:
            TypeError: ``d`` is not a mapping.
            ValueError: unknown keys, missing required fields, or invalid values.
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict needs a mapping, got {type(d).__name__}")
        assert dataclasses.is_dataclass(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ValueError(
                f"{cls.__name__}.from_dict: unknown keys {unknown}; known: {sorted(fields)}"
            )
        missing = sorted(
            name for name, f in fields.items()
            if name not in d
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"{cls.__name__}.from_dict: missing required keys {missing}")
        return cls(**dict(d))

    def summary(self, width: int = 96) -> str:
        """``Name(field=value, ...)`` for every field, wrapped at ``width`` columns (the
        models' repr shows it)."""
        body = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return textwrap.fill(
            f"{type(self).__name__}({body})", width=width, subsequent_indent="    ",
            break_long_words=False, break_on_hyphens=False,
        )
