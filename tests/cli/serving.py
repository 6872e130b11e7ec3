"""What the ``qkv serve`` tests share: SmolLM2 loaded once per process, each request's answer
alone (the reference), and the app under uvicorn on a free port of 127.0.0.1."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import uvicorn

import qkv.pretrained
from qkv.generate.batching import BatchingEngine
from qkv.serve.app import make_app

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 30  # seconds any call, start or stop waits
LIMIT = 600  # the server's --max-tokens
PROMPTS = ["The capital of France is", "Once upon a time, a small robot", "def add(a, b):",
           "Water boils at"]  # fmt: skip


@functools.cache
def smollm2():
    return qkv.pretrained.load(MODEL)


@functools.cache
def alone(prompt: str | tuple, n: int, **options) -> str:
    """The text of one request by itself (a str: raw completion; a tuple: chat messages);
    ``options``: :func:`~qkv.generate.engine.decoding_params`' keywords (default greedy)."""
    from qkv.generate.engine import decoding_params

    bundle = smollm2()
    chat = isinstance(prompt, tuple)
    what = [dict(m) for m in prompt] if chat else prompt
    ids = bundle.generate_ids(what, chat=chat, params=decoding_params(n, **options))
    return bundle.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class Served:
    port: int
    engine: BatchingEngine
    submitted: list  # every engine Request, in order
    key: str = "x"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key,
                             timeout=TIMEOUT, max_retries=0)  # fmt: skip


@contextlib.contextmanager
def serving(api_key: str | None = None, max_batch: int = 4) -> Iterator[Served]:
    """SmolLM2 served on a free port of 127.0.0.1 until the block ends (then checked to stop,
    engine included)."""
    bundle = smollm2()
    engine = BatchingEngine(bundle.model, eos_id=bundle.eos_id, max_batch=max_batch,
                            num_blocks=160, tokenizer=bundle.tokenizer)  # fmt: skip
    submitted, submit = [], engine.submit
    engine.submit = lambda *a, **k: submitted.append(submit(*a, **k)) or submitted[-1]
    web = make_app(bundle, engine, max_tokens_limit=LIMIT, max_request_bytes=100_000,
                   api_key=api_key)  # fmt: skip
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, held from the start (no race)
    server = uvicorn.Server(uvicorn.Config(web, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    out = Served(sock.getsockname()[1], engine, submitted, api_key or "x")
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            if httpx.get(f"{out.url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server did not answer /health"
            time.sleep(0.05)
    try:
        yield out
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
    assert not thread.is_alive(), "the server did not stop"
    assert not engine._thread.is_alive(), "the engine did not stop with the server"
