"""One answer's tokens, from the engine to the client: a request per choice, their tokens
merged onto one asyncio queue, turned into text by a :class:`~qkv.pretrained.stop_text.
TextStream` each, and sent whole or as server-sent events.

The engine's token iterators block, so a thread per request moves its tokens onto the
answer's queue. Between tokens (and every :data:`POLL_S` while none comes) the answer asks
whether the client is still there; when it left, every unfinished request is cancelled and
its blocks freed. A choice that meets a stop string is cancelled at once, the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from qkv.generate.engine import Request
from qkv.pretrained.stop_text import TextStream
from qkv.serve.fields import ApiError
from qkv.serve.replies import Reply, sse

__all__ = ["POLL_S", "Choice", "collect", "events", "tokens"]

POLL_S = 0.25  # how often an answer waiting for tokens checks that its client is still there
_END = object()  # a request's last item on the queue


@dataclass(eq=False)
class Choice:
    """One choice of an answer: its engine request and its text.

    Attributes:
        index: its place in ``choices``.
        request: the engine's request.
        stream: its text, stop strings applied.
        prefix: text the answer starts with (completions' ``echo``: the prompt).
        shown: how many of its tokens' log-probabilities were sent, ``shown_bytes`` their
            bytes (for completions' ``text_offset``).
        times: when each token arrived (``time.monotonic()``), for the metrics.
    """

    index: int
    request: Request
    stream: TextStream
    prefix: str = ""
    shown: int = 0
    shown_bytes: bytes = b""
    times: list[float] = field(default_factory=list)  # when each token arrived

    @property
    def reason(self) -> str | None:
        return "stop" if self.stream.stopped else self.request.finish_reason

    def new_logprobs(self, reply: Reply) -> dict[str, Any] | None:
        """The log-probabilities of the tokens not yet sent (None: none asked for)."""
        if reply.token_bytes is None:
            return None
        upto = len(self.stream.ids)
        entries, self.shown = self.request.logprobs[self.shown : upto], upto
        offset = len(self.prefix) + len(self.shown_bytes.decode("utf-8", errors="ignore"))
        self.shown_bytes += b"".join(reply.token_bytes(e.token) for e in entries)
        return reply.logprobs(entries, offset)

    def push(self, token: int) -> str:
        """One more token: the text now safe to send; a stop string cancels the request."""
        if self.stream.stopped:  # (tokens the engine chose before it saw the cancel)
            return ""
        self.times.append(time.monotonic())
        piece = self.stream.push(token)
        if self.stream.stopped:
            self.request.cancel()
        return piece


def _feed(requests: list[Request]) -> asyncio.Queue:
    """A queue that a thread per request fills with ``(index, token)``, then ``(index,
    _END)`` (or the error)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def pump(index: int, request: Request) -> None:
        item: object = _END
        try:
            for token in request.tokens():
                loop.call_soon_threadsafe(queue.put_nowait, (index, token))
        except Exception as err:  # handed to the handler, which reports it
            item = err
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, (index, item))

    for index, request in enumerate(requests):
        threading.Thread(target=pump, args=(index, request), daemon=True,
                         name=f"qkv-serve-{request.id}").start()  # fmt: skip
    return queue


async def tokens(requests: list[Request],
                 http_request: Any) -> AsyncIterator[tuple[int, int | None]]:  # fmt: skip
    """``(index, token)`` of ``requests`` as they come, and ``(index, None)`` when one ends,
    until all ended; cancels the unfinished ones when the client leaves or the caller stops
    early.

    Raises:
        RuntimeError: the engine failed on one of them.
    """
    queue, open_ = _feed(requests), len(requests)
    try:
        while open_:
            try:
                item = await asyncio.wait_for(queue.get(), POLL_S)
            except asyncio.TimeoutError:
                item = None
            if item is not None:
                index, value = item
                if isinstance(value, Exception):
                    raise value
                open_ -= value is _END
                yield index, None if value is _END else value
            if await http_request.is_disconnected():
                return
    finally:
        for request in requests:
            if request.finish_reason is None:
                request.cancel()


async def collect(choices: list[Choice],
                  stream: AsyncIterator[tuple[int, int | None]]) -> None:  # fmt: skip
    """Read ``stream`` to its end into the choices' texts.

    Raises:
        ApiError: 500 when the engine failed on a choice.
    """
    async with contextlib.aclosing(stream):
        async for index, token in stream:
            if token is not None:
                choices[index].push(token)
    for choice in choices:
        choice.stream.close()
        if choice.request.finish_reason == "error":
            raise ApiError(500, f"generation failed: {choice.request.error}", kind="server_error")


async def events(reply: Reply, choices: list[Choice],
                 stream: AsyncIterator[tuple[int, int | None]],
                 include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
    """The server-sent events of a streamed answer: per choice its opening (chat's role, or
    the echoed prompt), its pieces with their log-probabilities, its end as soon as its
    request ends; then the usage (when asked) and ``[DONE]``."""
    for c in choices:
        if reply.chat or c.prefix:
            yield reply.chunk(c.index, c.prefix or None, first=reply.chat)
    async with contextlib.aclosing(stream):
        try:
            async for index, token in stream:
                choice = choices[index]
                piece = choice.push(token) if token is not None else choice.stream.close()
                if piece:
                    yield reply.chunk(index, piece, logprobs=choice.new_logprobs(reply))
                if token is None:
                    yield reply.chunk(index, None, choice.reason)
        except RuntimeError as err:  # the engine failed on a request
            error = ApiError(500, f"generation failed: {err}", kind="server_error")
            yield sse(error.body())
            yield sse("[DONE]")
            return
    if include_usage:
        yield reply.usage_chunk(sum(len(c.stream.ids) for c in choices))
    yield sse("[DONE]")
