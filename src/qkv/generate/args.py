"""The decoding arguments, checked once at the boundary of every method.

Each public function of :mod:`qkv.generate` (greedy, sample, stream, beam search, generate,
translate, complete) checks its arguments here, before the first token is chosen, so that a
bad value is a ``ValueError`` naming the argument, what was given and what was expected,
never an index error inside an embedding, a NaN distribution or a silently ignored option:

* :func:`check_sampling`: ``temperature`` (a finite number >= 0), ``top_k`` (None or an int
  >= 1), ``top_p`` (None or a number in ``(0, 1]``), checked even when ``temperature=0``
  makes decoding greedy and they go unused.
* :func:`check_seed`: None, an int, or one int per row, each within what
  ``torch.Generator.manual_seed`` takes.
* :func:`special_ids`: ``eos_id``, ``pad_id``, ``bos_id`` (given, or the model config's),
  each inside the vocabulary whose embedding will read it.
* :func:`default_new_tokens`: how many tokens to generate when the caller did not say: a
  default, cut to the room the longest prompt leaves within the model's ``max_len``.

A bad decoding option is a :class:`ParamError`: a ``ValueError`` that also carries the
option's name (``err.param``), so a caller with other names for the options (the HTTP API's
``max_tokens``, the command's ``--top-p``) names its own field with :meth:`ParamError.named`
instead of editing the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from qkv.checks import is_int, is_number, positive_int

__all__ = [
    "SEED_RANGE",
    "ParamError",
    "check_alpha",
    "check_beams",
    "check_sampling",
    "check_seed",
    "check_stops",
    "default_new_tokens",
    "length_limit",
    "output_vocab",
    "positive_param",
    "special_ids",
]

# What torch.Generator.manual_seed accepts: a signed or an unsigned 64-bit int.
SEED_RANGE = (-(2**63), 2**64 - 1)


class ParamError(ValueError):
    """A decoding option the library refuses, with the option's name.

    The message is ``before + param + after``: ``ParamError("top_p", " must lie in (0, 1],
    got 0")`` reads "top_p must lie in (0, 1], got 0".

    Args:
        param: the option's name in the library (``max_new_tokens``, ``top_p``, ...).
        after: the message after the name: what it must be and what was received.
        before: the message before the name ("" when it starts the message).

    Attributes:
        param: as given, for callers that map it to their own names.
    """

    def __init__(self, param: str, after: str, before: str = "") -> None:
        self.param, self.before, self.after = param, before, after
        super().__init__(self.named(param))

    def named(self, name: str) -> str:
        """The message with the option called ``name`` (e.g. an API's field name)."""
        return f"{self.before}{name}{self.after}"


def positive_param(name: str, value: object) -> int:
    """``value`` when it is an int >= 1 (not a bool), else :class:`ParamError` naming ``name``."""
    if not is_int(value) or value < 1:
        raise ParamError(name, f" must be a positive int, got {value!r}")
    return value


def check_sampling(temperature: object, top_k: object, top_p: object) -> None:
    """Check the sampling options (all of them, whether or not they will be used).

    Raises:
        ParamError: ``temperature`` not a finite number >= 0; ``top_k`` not None or an int
            >= 1; ``top_p`` not None or a number in ``(0, 1]`` (bools refused everywhere).
    """
    if not is_number(temperature) or temperature < 0:
        raise ParamError("temperature", f" must be a finite number >= 0 (0 = greedy), got "
                         f"{temperature!r}")  # fmt: skip
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ParamError("top_k", f" must be a positive int or None, got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0.0 < top_p <= 1.0):
        raise ParamError("top_p", f" must lie in (0, 1] (or be None), got {top_p!r}")


def check_stops(stop: object) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string is one stop string; ``()``: none).

    Raises:
        ParamError: not a string or a sequence of non-empty strings.
    """
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
        raise ParamError("stop", f" must be a non-empty string or a list of them, got "
                         f"{stop!r:.80}")  # fmt: skip
    return tuple(stops)


def check_alpha(alpha: object) -> float:
    """``alpha`` when it is a finite number >= 0 (the beam search length penalty).

    Raises:
        ValueError: anything else.
    """
    if not is_number(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a finite number >= 0 (0 = no length penalty), got "
                         f"{alpha!r}")  # fmt: skip
    return float(alpha)


def check_beams(beam_size: object, num_return: object) -> int:
    """``beam_size`` when it and ``num_return`` are positive ints, ``num_return <= beam_size``.

    Raises:
        ValueError: anything else, naming the argument.
    """
    K = positive_int("beam_size", beam_size)
    if positive_int("num_return", num_return) > K:
        raise ValueError(f"num_return={num_return} must be <= beam_size={beam_size}")
    return K


def check_seed(seed: object, batch: int) -> list[int] | None:
    """The seed of each of ``batch`` rows: ``seed + b`` for an int, the list as given.

    Returns:
        ``batch`` ints, or None when ``seed`` is None.

    Raises:
        ValueError: a bool, a float, a list of the wrong length or holding non-ints, or a
            row seed outside :data:`SEED_RANGE`.
    """
    if seed is None:
        return None
    if is_int(seed):
        seeds = [seed + b for b in range(batch)]
    elif isinstance(seed, Sequence) and not isinstance(seed, str | bytes):
        seeds = list(seed)
        if len(seeds) != batch or not all(is_int(s) for s in seeds):
            raise ValueError(f"seed must be an int or {batch} ints (one per row) or None, "
                             f"got {seed!r:.80}")  # fmt: skip
    else:
        raise ValueError(f"seed must be an int or {batch} ints (one per row) or None, got "
                         f"{seed!r:.80}")  # fmt: skip
    low, high = SEED_RANGE
    bad = [s for s in seeds if not low <= s <= high]
    if bad:
        raise ValueError(f"seed must lie in [-2**63, 2**64 - 1] for every row (row b uses "
                         f"seed + b), got {bad[0]}")  # fmt: skip
    return seeds


def _vocab(model: nn.Module, names: tuple[str, ...]) -> int | None:
    config = getattr(model, "config", None)
    for name in names:
        value = getattr(config, name, None)
        if is_int(value):
            return value
    return None


def output_vocab(model: nn.Module) -> int | None:
    """``V``, the vocabulary of the tokens the model generates (and reads back): the config's
    ``tgt_vocab_size`` (encoder-decoder) or ``vocab_size``; None when the config has neither."""
    return _vocab(model, ("tgt_vocab_size", "vocab_size"))


def special_ids(
    model: nn.Module, eos_id: Any, pad_id: Any, bos_id: Any, *, seq2seq: bool
) -> tuple[int | None, int | None, int | None, int]:
    """``(eos, pad, bos, fill)``: the given ids, else the model config's, checked.

    ``fill`` is what a finished row is padded with (and fed back to the model): ``pad``, else
    ``eos``, else 0.

    Raises:
        ValueError: an id that is not None or an int >= 0, or one outside the vocabulary
            that reads it: every id is fed to the decoder (``V`` of :func:`output_vocab`), and
            an encoder-decoder's ``pad_id`` also pads the sources (``src_vocab_size``). The
            message says whether the bad id was given or came from ``model.config``.
    """
    out: dict[str, int | None] = {}
    V = output_vocab(model)
    src_V = _vocab(model, ("src_vocab_size",)) if seq2seq else None
    config = getattr(model, "config", None)
    for name, given in (("eos_id", eos_id), ("pad_id", pad_id), ("bos_id", bos_id)):
        value = given if given is not None else getattr(config, name, None)
        where = "" if given is not None else " (from model.config)"
        if value is None:
            out[name] = None
            continue
        if not is_int(value) or value < 0:
            raise ValueError(f"{name}{where} must be a non-negative int or None, got {value!r}")
        if V is not None and value >= V:
            raise ValueError(f"{name}{where} must be a token of the model's vocabulary "
                             f"[0, {V}), got {value}")  # fmt: skip
        if name == "pad_id" and src_V is not None and value >= src_V:
            raise ValueError(f"pad_id{where} pads the sources, so it must lie in the source "
                             f"vocabulary [0, {src_V}), got {value}")  # fmt: skip
        out[name] = value
    eos, pad, bos = out["eos_id"], out["pad_id"], out["bos_id"]
    fill = pad if pad is not None else (eos if eos is not None else 0)
    return eos, pad, bos, fill


def length_limit(model: Any) -> int | None:
    """The most positions ``model`` takes: a decoder's learned position table
    (``position_limit``; None for rotary, ALiBi or no positions, which take any length, as
    transformers generates past ``max_position_embeddings``), else its config's ``max_len``."""
    if hasattr(model, "position_limit"):
        return model.position_limit
    return getattr(getattr(model, "config", None), "max_len", None)


def default_new_tokens(limit: int | None, longest: int, default: int) -> int:
    """``default`` new tokens, but no more than fit after ``longest`` prompt tokens within
    ``limit`` (the model's ``max_len``; None = no limit).

    Raises:
        ValueError: the prompt alone fills ``limit`` (no room for one new token).
    """
    if limit is None:
        return default
    room = limit - longest
    if room < 1:
        raise ValueError(f"a prompt of {longest} tokens leaves no room for new tokens within "
                         f"the model's max_len={limit}; shorten the prompt")  # fmt: skip
    return min(default, room)

