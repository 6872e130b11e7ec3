"""Stop strings: generation ends where the decoded text first contains one of them.

A stop string is matched on the *text*, not on token ids, so it is found however the
tokenizer cut it (``"\\n\\n"`` may be one token, or the end of one and the start of the next).
While streaming, the end of the text that could still become a stop string is held back: a
caller never sees text that a later token turns into the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_stops", "cut_at_stop", "held_back"]


def check_stops(stop: object) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string is one stop string).

    Raises:
        ValueError: not a string or a list of non-empty strings.
    """
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r:.80}")
    return tuple(stops)


def cut_at_stop(text: str, stops: Sequence[str]) -> int:
    """Where ``text`` must end: the index of the earliest stop string in it, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
