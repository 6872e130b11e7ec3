"""A generation engine for many callers: requests are submitted from any thread, decoded by one
background thread, and their tokens handed back as they are chosen.

:class:`Engine` is what a server talks to: ``submit(prompt_ids, ...)`` returns a
:class:`Request` at once; ``request.tokens()`` yields the new token ids as they come (blocking
between them), ``request.cancel()`` stops it (a client that went away), and
``engine.shutdown()`` lets the requests in flight finish (or cancels them) and stops the
thread. How the requests are scheduled is the engine's business: see
:mod:`qkv.generate.batching` for continuous batching over a paged KV cache.

Shapes: ``V`` vocabulary.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from qkv.checks import is_int, positive_int
from qkv.generate.args import check_sampling

__all__ = ["Request", "SamplingParams"]

_DONE = object()  # the end of a request's token stream


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Attributes:
        max_new_tokens: the most tokens generated.
        temperature: 0 greedy, else sampled (with ``top_k`` / ``top_p``).
        top_k, top_p: sampling filters (None: off).
        seed: the request's own generator seed (None: drawn).
        stop_ids: token ids that end the request (besides the model's EOS).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        positive_int("max_new_tokens", self.max_new_tokens)
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not all(is_int(t) and t >= 0 for t in self.stop_ids):
            raise ValueError(f"stop_ids must be token ids, got {self.stop_ids!r:.80}")


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One submitted request: its prompt, parameters and the stream of its new tokens.

    Attributes:
        prompt: the prompt's token ids.
        params: its :class:`SamplingParams`.
        output: the new token ids so far (EOS / stop ids left out).
        finish_reason: None while running, then ``"stop"`` (EOS or a stop id), ``"length"``
            (``max_new_tokens``), ``"cancelled"`` or ``"error"``.
        error: the exception that ended it, for ``"error"``.
    """

    prompt: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    _queue: queue.Queue = field(default_factory=queue.Queue, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Ask the engine to stop this request (it ends with ``"cancelled"``)."""
        self._cancel.set()

    def emit(self, token: int) -> None:
        """(Engine side) one more new token."""
        self.output.append(token)
        self._queue.put(token)

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        """(Engine side) the request is over."""
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error
            self._queue.put(_DONE)

    def tokens(self, timeout: float | None = None) -> Iterator[int]:
        """The new token ids as they are chosen (blocking between them), until the end.

        Raises:
            TimeoutError: no token within ``timeout`` seconds.
            RuntimeError: the engine failed on this request (its error chained).
        """
        while True:
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no token in {timeout} s") from None
            if item is _DONE:
                if self.finish_reason == "error":
                    raise RuntimeError(f"request {self.id} failed: {self.error}") from self.error
                return
            yield item


def check_prompt(prompt: Sequence[int], vocab: int | None) -> list[int]:
    """``prompt`` as a non-empty list of ids in ``[0, vocab)``.

    Raises:
        ValueError: empty, not ints, or out of the vocabulary.
    """
    ids = list(prompt)
    if not ids or not all(is_int(t) and 0 <= t < (vocab or 2**62) for t in ids):
        raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab}), got "
                         f"{ids!r:.80}")  # fmt: skip
    return ids
