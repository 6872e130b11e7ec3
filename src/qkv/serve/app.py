"""The HTTP application of ``qkv serve``: OpenAI's completions and chat API on qkv's
continuous-batching engine (:class:`~qkv.generate.batching.BatchingEngine`).

Routes: ``GET /health``, ``GET /metrics`` (Prometheus, :mod:`qkv.serve.metrics`),
``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``, with and
without ``"stream": true`` (server-sent events, then ``data: [DONE]``). With an API key, the
``/v1`` routes need ``Authorization: Bearer <key>`` (compared in constant time; 401 without).

How a request flows:

1. The body is read (at most ``max_request_bytes``) and checked into a
   :class:`~qkv.serve.requests.Job`, and the job into one
   :class:`~qkv.generate.engine.SamplingParams` per choice by
   :func:`~qkv.generate.engine.decoding_params` (the one way ``qkv generate``, ``qkv chat``
   and the Python API build it too).
2. The prompt is tokenized (a chat through the model's template) in a worker thread.
3. The engine gets one request per choice; :mod:`qkv.serve.flow` merges their tokens onto
   one asyncio queue, turns them into text and answers whole or streamed, cancelling every
   request of an answer whose client left.
4. The answer's numbers go to the metrics.

The app owns the engine's run time: started with the app, shut down when the server stops
(uvicorn first stops accepting and lets the responses in flight finish).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from qkv.generate.args import SEED_RANGE, ParamError
from qkv.generate.engine import ShuttingDownError, decoding_params
from qkv.pretrained.stop_text import TextStream
from qkv.serve import flow
from qkv.serve.logprobs import TokenBytes
from qkv.serve.metrics import ServeMetrics
from qkv.serve.replies import Reply
from qkv.serve.requests import ApiError, Job, parse_job, read_json

__all__ = ["make_app"]

ENGINE_STOP_S = 30.0  # how long the engine may take to finish its requests at shutdown
# The library's names of the options whose API field is named otherwise.
API_FIELDS = {"max_new_tokens": "max_tokens", "grammar": "response_format"}


def make_app(
    bundle: Any, engine: Any, *, max_tokens_limit: int = 1024,
    max_request_bytes: int = 1_000_000, model_name: str | None = None,
    api_key: str | None = None,
) -> FastAPI:  # fmt: skip
    """An OpenAI-compatible app serving ``bundle``'s model through ``engine``.

    Args:
        bundle: a :class:`~qkv.pretrained.DecoderBundle` (its tokenizer and chat template).
        engine: a :class:`~qkv.generate.batching.BatchingEngine` on ``bundle.model``; started
            with the app's lifespan (if not already) and shut down with it.
        max_tokens_limit: the most ``max_tokens`` a request may ask for.
        max_request_bytes: the longest request body (longer: 413).
        model_name: the model's name in the API (default: ``bundle.name``).
        api_key: the key the ``/v1`` routes ask for (None: none asked).

    Returns:
        The FastAPI app, for uvicorn (or any ASGI server).
    """
    server = _Server(bundle, engine, model_name or bundle.name, max_tokens_limit,
                     max_request_bytes, api_key)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await anyio.to_thread.run_sync(functools.partial(engine.shutdown, timeout=ENGINE_STOP_S))

    app = FastAPI(title="qkv serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_exception_handler(ApiError, server.api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_text)

    @app.get("/v1/models")
    async def models(http_request: HttpRequest) -> Any:
        server.authorize(http_request)
        return server.models()

    @app.post("/v1/completions", response_model=None)
    async def completions(http_request: HttpRequest) -> Any:
        return await server.answer(http_request, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(http_request: HttpRequest) -> Any:
        return await server.answer(http_request, chat=True)

    return app


async def _http_error(_: HttpRequest, err: Exception) -> JSONResponse:
    """Starlette's own errors (an unknown route, a wrong method) in OpenAI's error format."""
    assert isinstance(err, HTTPException)
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return JSONResponse(ApiError(err.status_code, str(err.detail), None, kind).body(),
                        status_code=err.status_code, headers=err.headers)  # fmt: skip


class _Server:
    """The handlers, over one bundle and engine."""

    def __init__(self, bundle: Any, engine: Any, name: str, max_tokens_limit: int,
                 max_request_bytes: int, api_key: str | None) -> None:  # fmt: skip
        self.bundle, self.engine, self.name = bundle, engine, name
        self.max_tokens_limit, self.max_request_bytes = max_tokens_limit, max_request_bytes
        self.key = None if api_key is None else f"Bearer {api_key}".encode()
        self.created = int(time.time())
        self.metrics = ServeMetrics(engine)
        self.token_bytes = TokenBytes(bundle.tokenizer) if bundle.tokenizer is not None else None

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def metrics_text(self) -> Response:
        text, media = self.metrics.render()
        return Response(text, media_type=media)

    async def api_error(self, _: HttpRequest, err: Exception) -> JSONResponse:
        assert isinstance(err, ApiError)
        self.metrics.refused(err.status)
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def authorize(self, http_request: HttpRequest) -> None:
        """Raises ApiError 401 unless the request carries the API key (when one is set)."""
        if self.key is None:
            return
        given = http_request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self.key):
            what = "no Authorization header" if not given else "a wrong key"
            raise ApiError(401, f"this server needs an API key ('Authorization: Bearer <key>'), "
                           f"got {what}", kind="invalid_request_error",
                           code="invalid_api_key")  # fmt: skip

    def models(self) -> dict[str, Any]:
        model = {"id": self.name, "object": "model", "created": self.created, "owned_by": "qkv"}
        return {"object": "list", "data": [model]}

    async def answer(self, http_request: HttpRequest, *, chat: bool) -> Any:
        """A completion or chat completion, whole or streamed, with its choices."""
        arrived = time.monotonic()
        self.authorize(http_request)
        body = await read_json(http_request, self.max_request_bytes)
        job = parse_job(body, chat=chat, max_tokens_limit=self.max_tokens_limit)
        if job.model is not None and job.model != self.name:
            raise ApiError(404, f"'model' must be {self.name!r} (the model served here), got "
                           f"{job.model!r}", "model", kind="not_found_error")  # fmt: skip
        params = [_refused(lambda i=i: decoding_params(job.max_tokens, seed=_seed(job.seed, i),
                                                       **job.decoding()))
                  for i in range(job.n)]  # fmt: skip
        ids = await anyio.to_thread.run_sync(self._prompt_ids, job, chat)
        requests = self._submit(ids, params)
        asked = self.token_bytes if job.logprobs is not None else None
        reply = Reply(chat, self.name, len(ids), asked)
        prefix = self._echo(job, ids)
        choices = [flow.Choice(i, r, TextStream(self._decode, p.stop), prefix)
                   for i, (r, p) in enumerate(zip(requests, params, strict=True))]  # fmt: skip
        tokens = flow.tokens(requests, http_request)
        if job.stream:
            events = self._recorded(flow.events(reply, choices, tokens, job.include_usage),
                                    arrived, len(ids), choices)  # fmt: skip
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            await flow.collect(choices, tokens)
        finally:
            self.metrics.answered(arrived, len(ids), choices)
        out = [reply.choice(c.index, c.prefix + c.stream.text, c.reason, c.new_logprobs(reply))
               for c in choices]  # fmt: skip
        return reply.whole(out, sum(len(c.stream.ids) for c in choices))

    async def _recorded(self, events: AsyncIterator[str], arrived: float, prompt_tokens: int,
                        choices: list[flow.Choice]) -> AsyncIterator[str]:  # fmt: skip
        """``events``, with the answer's numbers recorded when they end."""
        try:
            async for event in events:
                yield event
        finally:
            self.metrics.answered(arrived, prompt_tokens, choices)

    def _submit(self, ids: list[int], params: list[Any]) -> list[Any]:
        """One engine request per choice (all or none: a refusal cancels those submitted)."""
        requests: list[Any] = []
        try:
            for p in params:
                requests.append(_refused(lambda p=p: self.engine.submit(ids, p)))
        except ApiError:
            for r in requests:
                r.cancel()
            raise
        return requests

    def _echo(self, job: Job, ids: list[int]) -> str:
        """The text a completion echoes first: its prompt (``echo``), else nothing."""
        if not job.echo:
            return ""
        return job.prompt if isinstance(job.prompt, str) else self._decode(ids)

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


def _seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: ``seed + index``, wrapped into the range seeds take."""
    if seed is None:
        return None
    low, high = SEED_RANGE
    return low + (seed - low + index) % (high - low + 1)
