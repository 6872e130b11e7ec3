"""The HTTP application of ``qkv serve``: OpenAI's completions and chat API on qkv's
continuous-batching engine (:class:`~qkv.generate.batching.BatchingEngine`).

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions``, with and without ``"stream": true`` (server-sent events, then
``data: [DONE]``). Requests are checked in :mod:`qkv.serve.requests`, their text
streamed by :class:`~qkv.pretrained.stop_text.TextStream`, answered in the objects of
:mod:`qkv.serve.replies`.

How a request flows:

1. The body is read (at most ``max_request_bytes``) and checked into a ``Job``, and the job
   into the request's :class:`~qkv.generate.engine.SamplingParams` by
   :func:`~qkv.generate.engine.decoding_params` (the one way ``qkv generate``, ``qkv chat`` and
   the Python API build it too).
2. The prompt is tokenized (a chat through the model's template) in a worker thread.
3. The engine gets the ids; a thread per request moves its tokens from the engine's
   blocking iterator onto an asyncio queue, which the handler awaits.
4. Between tokens (and every :data:`POLL_S` while none comes) the handler asks whether the
   client is still there; when it left, the request is cancelled and its blocks freed.

The app owns the engine's run time: started with the app, shut down when the server stops
(uvicorn first stops accepting and lets the responses in flight finish).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from qkv.generate.args import ParamError
from qkv.generate.engine import Request, ShuttingDownError, decoding_params
from qkv.pretrained.stop_text import TextStream
from qkv.serve.replies import Reply, sse
from qkv.serve.requests import ApiError, Job, parse_job, read_json

__all__ = ["make_app"]

POLL_S = 0.25  # how often a request waiting for tokens checks that its client is still there
ENGINE_STOP_S = 30.0  # how long the engine may take to finish its requests at shutdown
_END = object()  # a request's last item on its queue
# The library's names of the options whose API field is named otherwise.
API_FIELDS = {"max_new_tokens": "max_tokens"}


def make_app(
    bundle: Any, engine: Any, *, max_tokens_limit: int = 1024,
    max_request_bytes: int = 1_000_000, model_name: str | None = None,
) -> FastAPI:  # fmt: skip
    """An OpenAI-compatible app serving ``bundle``'s model through ``engine``.

    Args:
        bundle: a :class:`~qkv.pretrained.DecoderBundle` (its tokenizer and chat template).
        engine: a :class:`~qkv.generate.batching.BatchingEngine` on ``bundle.model``; started
            with the app's lifespan (if not already) and shut down with it.
        max_tokens_limit: the most ``max_tokens`` a request may ask for.
        max_request_bytes: the longest request body (longer: 413).
        model_name: the model's name in the API (default: ``bundle.name``).

    Returns:
        The FastAPI app, for uvicorn (or any ASGI server).
    """
    server = _Server(bundle, engine, model_name or bundle.name, max_tokens_limit,
                     max_request_bytes)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await anyio.to_thread.run_sync(functools.partial(engine.shutdown, timeout=ENGINE_STOP_S))

    app = FastAPI(title="qkv serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.get("/health")(server.health)
    app.get("/v1/models")(server.models)

    @app.post("/v1/completions", response_model=None)
    async def completions(http_request: HttpRequest) -> Any:
        return await server.answer(http_request, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(http_request: HttpRequest) -> Any:
        return await server.answer(http_request, chat=True)

    return app


async def _api_error(_: HttpRequest, err: Exception) -> JSONResponse:
    assert isinstance(err, ApiError)
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(_: HttpRequest, err: Exception) -> JSONResponse:
    """Starlette's own errors (an unknown route, a wrong method) in OpenAI's error format."""
    assert isinstance(err, HTTPException)
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return JSONResponse(ApiError(err.status_code, str(err.detail), None, kind).body(),
                        status_code=err.status_code, headers=err.headers)  # fmt: skip


class _Server:
    """The handlers, over one bundle and engine."""

    def __init__(self, bundle: Any, engine: Any, name: str, max_tokens_limit: int,
                 max_request_bytes: int) -> None:  # fmt: skip
        self.bundle, self.engine, self.name = bundle, engine, name
        self.max_tokens_limit, self.max_request_bytes = max_tokens_limit, max_request_bytes
        self.created = int(time.time())

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def models(self) -> dict[str, Any]:
        model = {"id": self.name, "object": "model", "created": self.created, "owned_by": "qkv"}
        return {"object": "list", "data": [model]}

    async def answer(self, http_request: HttpRequest, *, chat: bool) -> Any:
        """A completion or chat completion, whole or streamed."""
        body = await read_json(http_request, self.max_request_bytes)
        job = parse_job(body, chat=chat, max_tokens_limit=self.max_tokens_limit)
        if job.model is not None and job.model != self.name:
            raise ApiError(404, f"'model' must be {self.name!r} (the model served here), got "
                           f"{job.model!r}", "model", kind="not_found_error")  # fmt: skip
        params = _refused(lambda: decoding_params(
            job.max_tokens, temperature=job.temperature, top_k=job.top_k, top_p=job.top_p,
            seed=job.seed, stop=job.stop))  # fmt: skip
        ids = await anyio.to_thread.run_sync(self._prompt_ids, job, chat)
        request = _refused(lambda: self.engine.submit(ids, params))
        reply = Reply(chat, self.name, len(ids))
        tokens = _tokens(request, http_request)
        stream = TextStream(self._decode, params.stop)
        if job.stream:
            events = _events(reply, tokens, stream, request, job.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        async with contextlib.aclosing(tokens):
            async for token in tokens:
                stream.push(token)
                if stream.stopped:
                    break
        stream.close()
        if request.finish_reason == "error":
            raise ApiError(500, f"generation failed: {request.error}", kind="server_error")
        return reply.whole(stream.text, _reason(stream, request), len(stream.ids))

    def _decode(self, ids: list[int]) -> str:
        return self.bundle.tokenizer.decode(ids, skip_special_tokens=True)

    def _prompt_ids(self, job: Job, chat: bool) -> list[int]:
        """The prompt's token ids (runs in a worker thread: a long prompt takes a while)."""
        tokenizer, param = self.bundle.tokenizer, "messages" if chat else "prompt"
        if isinstance(job.prompt, list) and not chat:
            ids = job.prompt
        elif tokenizer is None:
            raise ApiError(400, f"{self.name} has no tokenizer: send 'prompt' as token ids", param)
        elif chat:
            try:
                ids = tokenizer.encode_chat(job.prompt)
            except (ValueError, TypeError) as err:
                raise ApiError(400, f"'messages' do not fit the chat template: {err}",
                               param) from None  # fmt: skip
        else:
            ids = tokenizer.encode(job.prompt)
        vocab = self.bundle.model.config.vocab_size
        if not ids or not all(0 <= t < vocab for t in ids):
            raise ApiError(400, f"'{param}' must give token ids in [0, {vocab}), got "
                           f"{ids[:8]!r}{' ...' if len(ids) > 8 else ''}", param)  # fmt: skip
        return ids


def _refused(make: Any) -> Any:
    """``make()``, a refusal turned into the API's error: a bad option is a 400 naming the
    API's field (the library's name mapped by the error's ``param``, :data:`API_FIELDS`), an
    engine shutting down a 503, any other refusal a 400 about the request as a whole."""
    try:
        return make()
    except ShuttingDownError:
        raise ApiError(503, "the server is shutting down", kind="server_error") from None
    except ParamError as err:
        field = API_FIELDS.get(err.param, err.param)
        raise ApiError(400, err.named(f"'{field}'"), field) from None
    except ValueError as err:
        raise ApiError(400, str(err)) from None


def _reason(stream: TextStream, request: Request) -> str | None:
    return "stop" if stream.stopped else request.finish_reason


async def _events(reply: Reply, tokens: AsyncIterator[int], stream: TextStream,
                  request: Request, include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
    """The server-sent events of a streamed answer."""
    if reply.chat:
        yield reply.chunk(None, first=True)
    async with contextlib.aclosing(tokens):
        try:
            async for token in tokens:
                if piece := stream.push(token):
                    yield reply.chunk(piece)
                if stream.stopped:
                    break
        except RuntimeError as err:  # the engine failed on this request
            error = ApiError(500, f"generation failed: {err}", kind="server_error")
            yield sse(error.body())
            yield sse("[DONE]")
            return
    if piece := stream.close():
        yield reply.chunk(piece)
    yield reply.chunk(None, _reason(stream, request))
    if include_usage:
        yield reply.usage_chunk(len(stream.ids))
    yield sse("[DONE]")


def _feed(request: Request) -> asyncio.Queue:
    """A queue that a thread fills with ``request``'s tokens, then ``_END`` (or the error)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def pump() -> None:
        item: object = _END
        try:
            for token in request.tokens():
                loop.call_soon_threadsafe(queue.put_nowait, token)
        except Exception as err:  # handed to the handler, which reports it
            item = err
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, item)

    threading.Thread(target=pump, name=f"qkv-serve-{request.id}", daemon=True).start()
    return queue


async def _tokens(request: Request, http_request: HttpRequest) -> AsyncIterator[int]:
    """``request``'s tokens as they come; cancels it when the client leaves (checked between
    tokens and every :data:`POLL_S`) or when the caller stops early."""
    queue = _feed(request)
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), POLL_S)
            except asyncio.TimeoutError:
                item = None
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            if item is not None:
                yield item
            if await http_request.is_disconnected():
                return
    finally:
        if request.finish_reason is None:
            request.cancel()
