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
from typing import Any

from qkv.checks import is_int
from qkv.generate.args import SEED_RANGE, ParamError, check_sampling, check_stops, positive_param
from qkv.generate.controls import GenerationControls
from qkv.generate.grammar import Grammar

__all__ = ["Request", "SamplingParams", "ShuttingDownError", "TokenLogprob", "decoding_params"]

_DONE = object()  # the end of a request's token stream
_OFF = GenerationControls()  # no controls: nothing edits the logits


class ShuttingDownError(ValueError):
    """A request submitted to an engine that is shutting down."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: the one record every way in builds
    (:func:`decoding_params`) and every decoder reads.

    Attributes:
        max_new_tokens: the most tokens generated.
        temperature: 0 greedy, else sampled (with ``top_k`` / ``top_p`` / ``controls.min_p``).
        top_k, top_p: sampling filters (None: off).
        seed: the request's own generator seed (None: drawn).
        stop_ids: token ids that end the request besides the model's EOS (the batching
            engine's; :func:`qkv.generate.generate` stops at EOS only).
        stop: stop strings, matched on the decoded text by whoever decodes it
            (:class:`qkv.pretrained.stop_text.TextStream`: a bundle's ``generate`` /
            ``stream``, ``qkv serve``); the engine, which sees ids only, does not read them.
        controls: a :class:`~qkv.generate.controls.GenerationControls` (repetition penalty,
            no-repeat n-grams, bad words, minimum length, min-p, forced EOS), applied to each
            step's ``(V,)`` logits from the request's own tokens (prompt + output); None or
            the default: off, and nothing is paid for them.
        logprobs: None (off), or ``k >= 0``: the batching engine reports each new token's
            log-probability and the ``k`` most probable tokens' (a :class:`TokenLogprob` per
            token, ``Request.logprobs``), from the distribution the token was chosen from:
            the logits after the controls, divided by the temperature when sampling (before
            top-k, top-p and min-p cut them).
        grammar: a :class:`~qkv.generate.grammar.Grammar` the text must match (the
            batching engine masks each step's logits to the tokens it allows; the engine
            needs the model's tokenizer for it); None: free text.

    Raises:
        ParamError: (a ``ValueError``) a field out of range; ``err.param`` names it.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    controls: GenerationControls = _OFF
    logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        positive_param("max_new_tokens", self.max_new_tokens)
        check_sampling(self.temperature, self.top_k, self.top_p)
        low, high = SEED_RANGE
        if self.seed is not None and not is_int(self.seed):
            raise ParamError("seed", f" must be an int or None, got {self.seed!r:.80}")
        if self.seed is not None and not low <= self.seed <= high:
            raise ParamError("seed", f" must lie in [-2**63, 2**64 - 1], got {self.seed}")
        ids = self.stop_ids
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence) or not all(
                is_int(t) and t >= 0 for t in ids):  # fmt: skip
            raise ParamError("stop_ids", f" must be token ids, got {ids!r:.80}")
        object.__setattr__(self, "stop_ids", tuple(ids))
        object.__setattr__(self, "stop", check_stops(self.stop))
        controls = _OFF if self.controls is None else self.controls
        if not isinstance(controls, GenerationControls):
            raise ParamError("controls", f" must be a GenerationControls or None, got "
                             f"{type(controls).__name__}")  # fmt: skip
        object.__setattr__(self, "controls", controls)
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ParamError("grammar", f" must be a qkv.generate.grammar.Grammar or None, got "
                             f"{type(self.grammar).__name__}")  # fmt: skip
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ParamError("logprobs", f" must be None or an int >= 0 (how many of the most "
                             f"probable tokens to report), got {self.logprobs!r:.80}")  # fmt: skip

    @property
    def edits_logits(self) -> bool:
        """Whether the controls change a step's logits (min-p acts in the sampler)."""
        return self.controls.edits_logits

    def keywords(self) -> dict[str, Any]:
        """The record as the decoding keywords of :func:`qkv.generate.generate` /
        :func:`~qkv.generate.stream` and a bundle's ``generate`` / ``stream``:
        ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, then ``controls``
        and ``stop`` only when set (stop strings are for the text layer: the token-level
        methods take none).

        Raises:
            ParamError: ``stop_ids`` given (only the batching engine reads them).
        """
        if self.stop_ids:
            raise ParamError("stop_ids", f" are read by the batching engine only; qkv.generate's "
                             f"methods stop at eos_id, got {self.stop_ids!r:.80}")  # fmt: skip
        if self.logprobs is not None:
            raise ParamError("logprobs", f" are reported by the batching engine only, got "
                             f"{self.logprobs!r}")  # fmt: skip
        if self.grammar is not None:
            raise ParamError("grammar", f" is applied by the batching engine only, got "
                             f"{self.grammar!r:.80}")  # fmt: skip
        out: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens,
                                   temperature=self.temperature, top_k=self.top_k,
                                   top_p=self.top_p, seed=self.seed)  # fmt: skip
        if self.controls != _OFF:
            out["controls"] = self.controls
        if self.stop:
            out["stop"] = list(self.stop)
        return out


def decoding_params(
    max_new_tokens: int = 128, *, temperature: float = 0.0, top_k: int | None = None,
    top_p: float | None = None, seed: int | None = None, stop: str | Sequence[str] | None = (),
    stop_ids: Sequence[int] = (), controls: GenerationControls | None = None,
    logprobs: int | None = None, grammar: Grammar | None = None, **fields: Any,
) -> SamplingParams:  # fmt: skip
    """The :class:`SamplingParams` of these options: the one way a command, the server and
    the Python API turn what they were given into the record.

    Args:
        max_new_tokens, temperature, top_k, top_p, seed, stop_ids, logprobs, grammar: as
            :class:`SamplingParams`.
        stop: a stop string, several, or None / ``()``: none.
        controls: a :class:`~qkv.generate.controls.GenerationControls`, or None.
        **fields: the controls' fields one by one instead (``repetition_penalty=1.3``,
            ``min_p=0.05``, ...); None = not given, the field's default.

    Raises:
        ParamError: a value out of range (``err.param`` names it); ``controls`` together with
            control fields.
        TypeError: a keyword that is no control field.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    unknown = sorted(set(given) - set(GenerationControls.__dataclass_fields__))
    if unknown:
        raise TypeError(f"decoding_params() got unknown options {unknown}; the control fields "
                        f"are {sorted(GenerationControls.__dataclass_fields__)}")  # fmt: skip
    if given and controls is not None:
        raise ParamError("controls", f" or its fields one by one ({sorted(given)}): give one")
    if given:
        controls = GenerationControls(**given)
    return SamplingParams(max_new_tokens, temperature, top_k, top_p, seed, tuple(stop_ids),
                          () if stop is None else stop, controls, logprobs, grammar)  # fmt: skip


@dataclass(frozen=True)
class TokenLogprob:
    """One new token's log-probability (natural log), and the most probable tokens' at its
    step (:attr:`SamplingParams.logprobs` of them, most probable first; ``-inf`` ones, banned
    by the controls, left out).

    Attributes:
        token: the token chosen.
        logprob: its log-probability.
        top: ``(token id, log-probability)`` pairs.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One submitted request: its prompt, parameters and the stream of its new tokens.

    Attributes:
        prompt: the prompt's token ids.
        params: its :class:`SamplingParams`.
        output: the new token ids so far (EOS / stop ids left out).
        logprobs: a :class:`TokenLogprob` per new token when ``params.logprobs`` asks for
            them (else empty).
        finish_reason: None while running, then ``"stop"`` (EOS or a stop id), ``"length"``
            (``max_new_tokens``), ``"cancelled"`` or ``"error"``.
        error: the exception that ended it, for ``"error"``.
    """

    prompt: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
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

    def emit(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """(Engine side) one more new token (and its log-probability, when asked for)."""
        self.output.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
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
        ParamError: empty, not ints, or out of the vocabulary.
    """
    ids = list(prompt)
    if not ids or not all(is_int(t) and 0 <= t < (vocab or 2**62) for t in ids):
        raise ParamError("prompt", f" must be a non-empty list of token ids in [0, {vocab}), "
                         f"got {ids!r:.80}")  # fmt: skip
    return ids
