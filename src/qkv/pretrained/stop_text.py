"""Token ids in, text out, piece by piece, with stop strings: what a stream shows.

Two things make streaming text harder than decoding each token alone:

1. A byte-level token can hold part of a character (half of an emoji): decoding the ids so
   far then ends in U+FFFD. Such a piece is held back until the character is complete, so
   every piece sent is valid text and the pieces join to the decoded whole.
2. A stop string (``"\\n\\n"``) can span tokens. The text is searched as decoded, and a tail
   that could still become a stop string is held back: a reader never sees text that a later
   token reveals to be the start of a stop. At a stop the text is cut before it.

:class:`TextStream` does both, on the whole decoded text each step (decoding the ids so far
costs far less than the model's step). ``DecoderBundle.stream`` and ``qkv serve`` use it, on
the stop strings of the request's :class:`~qkv.generate.engine.SamplingParams` (checked there
by :func:`check_stops`, re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qkv.generate.args import check_stops

__all__ = ["TextStream", "check_stops"]


INCOMPLETE = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class TextStream:
    """Incremental text of a token stream, with stop strings.

    Args:
        decode: token ids -> text (e.g. the tokenizer's decode, special tokens skipped).
        stops: strings that end the text; it is cut before the first one found.

    Attributes:
        ids: the token ids pushed so far.
        text: the text sent so far (the pieces joined).
        stopped: a stop string was found; later pushes add nothing.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stops must be non-empty strings, got {list(stops)!r:.80}")
        self.decode, self.stops = decode, tuple(stops)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """One more token id; returns the new text that is safe to send ("" when held)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith(INCOMPLETE) or not text.startswith(self.text):
            return ""  # an incomplete character, or a decoding that is not final yet
        return self._advance(text, hold=True)

    def close(self) -> str:
        """The tokens have ended: the rest of the text (up to a stop string), held or not."""
        if self.stopped:
            return ""
        text = self.decode(self.ids)
        if not text.startswith(self.text):  # decoding changed sent text: send what is past it
            text = self.text + text[len(self.text) :]
        return self._advance(text, hold=False)

    def _advance(self, text: str, hold: bool) -> str:
        """Send ``text`` past what was sent, cut at a stop, less a tail that may start one."""
        start = len(self.text)
        found = [i for s in self.stops if (i := text.find(s, start)) >= 0]
        if found:
            end, self.stopped = min(found), True
        else:
            end = len(text) - (self._stop_prefix(text, start) if hold else 0)
        piece = text[start:end]
        self.text += piece
        return piece

    def _stop_prefix(self, text: str, start: int) -> int:
        """The length of the longest tail of ``text[start:]`` that begins a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text) - start), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
