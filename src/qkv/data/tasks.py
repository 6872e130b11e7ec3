"""Synthetic sequence-to-sequence tasks, generated from a seed, with disjoint splits.

=============  ====================  ==============  ==========================================
 name           source                target          options (defaults)
=============  ====================  ==============  ==========================================
 ``copy``       ``"52719"``           ``"52719"``     ``min_len=1, max_len=10`` (digits)
 ``reverse``    ``"52719"``           ``"91725"``     ``min_len=1, max_len=10``
 ``sort``       ``"52719"``           ``"12579"``     ``min_len=1, max_len=10``
 ``addition``   ``"123+45"``          ``"168"``       ``min_digits=1, max_digits=3`` (operands)
 ``dates``      ``"MAR 3, 2015"``     ``"2015-03-03"``  none (see :mod:`qkv.data.dates`)
=============  ====================  ==============  ==========================================

Examples are drawn one at a time from a ``random.Random`` seeded by the task name and seed;
a source string already drawn is drawn again, so no source appears twice in the task and the
train, validation and test splits are disjoint (for ``dates`` the same *day* may still appear
in two splits written two different ways). The same ``(name, seed, sizes, options)`` always
gives the same pairs. String lengths are uniform in ``[min_len, max_len]``, then the digits
uniform; operands of ``addition`` likewise by number of digits (no leading zeros).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from qkv.data.dates import date_pair

__all__ = ["SPLITS", "TASKS", "Task", "make_task"]

SPLITS = ("train", "valid", "test")
Pair = tuple[str, str]


@dataclass(frozen=True)
class Task:
    """A generated task: three disjoint lists of ``(source, target)`` string pairs.

    Attributes:
        name: one of :data:`TASKS`.
        seed: the seed it was generated from.
        train, valid, test: the splits.
    """

    name: str
    seed: int
    train: tuple[Pair, ...]
    valid: tuple[Pair, ...]
    test: tuple[Pair, ...]

    def pairs(self, split: str) -> list[Pair]:
        """The ``(source, target)`` pairs of ``split`` (``"train"``, ``"valid"`` or ``"test"``).

        Raises:
            ValueError: an unknown split.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return list(getattr(self, split))

    def texts(self) -> list[str]:
        """Every source and target string of every split (to fit a tokenizer on)."""
        return [s for split in SPLITS for pair in getattr(self, split) for s in pair]


@dataclass(frozen=True)
class _Generator:
    """How to draw one pair, and (for small spaces) how many there are and how to list them."""

    draw: Callable[[random.Random], Pair]
    capacity: int | None = None  # number of distinct sources; None = too many to matter
    enumerate: Callable[[], Iterable[Pair]] | None = None


def _check_range(lo_name: str, lo: int, hi_name: str, hi: int, top: int) -> None:
    for name, v in ((lo_name, lo), (hi_name, hi)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
            raise ValueError(f"{name} must be an int in [1, {top}], got {v!r}")
    if lo > hi:
        raise ValueError(f"{lo_name} must be <= {hi_name}, got {lo_name}={lo} > {hi_name}={hi}")


def _digit_task(transform: Callable[[str], str]) -> Callable[..., _Generator]:
    """A generator factory for tasks whose source is a digit string."""

    def build(*, min_len: int = 1, max_len: int = 10) -> _Generator:
        _check_range("min_len", min_len, "max_len", max_len, 1000)

        def draw(rng: random.Random) -> Pair:
            length = rng.randint(min_len, max_len)
            s = "".join(rng.choices("0123456789", k=length))
            return s, transform(s)

        def every() -> Iterable[Pair]:
            for length in range(min_len, max_len + 1):
                for digits in itertools.product("0123456789", repeat=length):
                    s = "".join(digits)
                    yield s, transform(s)

        capacity = sum(10**n for n in range(min_len, max_len + 1))
        return _Generator(draw, capacity, every)

    return build


def _lowest(n_digits: int) -> int:
    """The smallest non-negative integer written with ``n_digits`` digits (0 has one digit)."""
    return 0 if n_digits == 1 else 10 ** (n_digits - 1)


def _addition(*, min_digits: int = 1, max_digits: int = 3) -> _Generator:
    _check_range("min_digits", min_digits, "max_digits", max_digits, 100)

    def operand(rng: random.Random) -> int:
        n_digits = rng.randint(min_digits, max_digits)
        return rng.randrange(_lowest(n_digits), 10**n_digits)

    def draw(rng: random.Random) -> Pair:
        a, b = operand(rng), operand(rng)
        return f"{a}+{b}", str(a + b)

    def every() -> Iterable[Pair]:
        values = range(_lowest(min_digits), 10**max_digits)
        return ((f"{a}+{b}", str(a + b)) for a in values for b in values)

    per_operand = 10**max_digits - _lowest(min_digits)
    return _Generator(draw, per_operand**2, every)


def _dates() -> _Generator:
    return _Generator(date_pair)


_FACTORIES: dict[str, Callable[..., _Generator]] = {
    "copy": _digit_task(lambda s: s),
    "reverse": _digit_task(lambda s: s[::-1]),
    "sort": _digit_task(lambda s: "".join(sorted(s))),
    "addition": _addition,
    "dates": _dates,
}
TASKS = tuple(_FACTORIES)


def _distinct_pairs(gen: _Generator, total: int, rng: random.Random, name: str) -> list[Pair]:
    """``total`` pairs with distinct sources, in the order they were drawn."""
    if gen.capacity is not None and total > gen.capacity:
        raise ValueError(
            f"task {name!r} has only {gen.capacity} distinct sources with these options, "
            f"but n_train + n_valid + n_test = {total}; ask for fewer or widen the options"
        )
    if gen.capacity is not None and gen.enumerate is not None and 2 * total > gen.capacity:
        # A dense draw would mostly hit sources already taken: sample the full list instead.
        return rng.sample(list(gen.enumerate()), total)
    found: dict[str, str] = {}
    attempts = 0
    max_attempts = 100 * total + 10_000
    while len(found) < total:
        source, target = gen.draw(rng)
        found.setdefault(source, target)
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"task {name!r}: found only {len(found)} distinct sources in {attempts} draws, "
                f"but n_train + n_valid + n_test = {total}; ask for fewer"
            )
    return list(found.items())


def make_task(
    name: str,
    *,
    seed: int = 0,
    n_train: int = 10_000,
    n_valid: int = 1_000,
    n_test: int = 1_000,
    **options: int,
) -> Task:
    """Generate the task ``name`` with disjoint splits of the given sizes.

    Args:
        name: one of :data:`TASKS`: ``"copy"``, ``"reverse"``, ``"sort"``, ``"addition"``,
            ``"dates"``.
        seed: an int; the same seed gives the same pairs, different seeds different ones.
        n_train, n_valid, n_test: split sizes (each >= 0).
        **options: the task's own options (see the module table), e.g. ``max_len=20``.

    Returns:
        a :class:`Task`.

    Raises:
        ValueError: an unknown name, a negative size, bad options, or more pairs asked for
            than the task has distinct sources.
        TypeError: an option the task does not take.
    """
    if name not in _FACTORIES:
        raise ValueError(f"name must be one of {TASKS}, got {name!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    sizes = {"n_train": n_train, "n_valid": n_valid, "n_test": n_test}
    for key, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{key} must be a non-negative int, got {n!r}")
    try:
        gen = _FACTORIES[name](**options)
    except TypeError as err:
        raise TypeError(f"task {name!r}: {err}") from None
    # A string seed is hashed with SHA-512 by random.Random: stable across runs and machines.
    rng = random.Random(f"qkv.data.tasks:{name}:{seed}")
    pairs = _distinct_pairs(gen, n_train + n_valid + n_test, rng, name)
    return Task(
        name=name,
        seed=seed,
        train=tuple(pairs[:n_train]),
        valid=tuple(pairs[n_train : n_train + n_valid]),
        test=tuple(pairs[n_train + n_valid :]),
    )
