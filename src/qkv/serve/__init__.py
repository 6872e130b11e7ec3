"""Serving: a language model behind OpenAI's HTTP API, many requests decoded together.

    from qkv import pretrained
    from qkv.generate.batching import BatchingEngine
    from qkv.serve import make_app

    bundle = pretrained.load("SmolLM2-135M-Instruct")
    engine = BatchingEngine(bundle.model, eos_id=bundle.eos_id, max_batch=16)
    app = make_app(bundle, engine)        # a FastAPI app: run it under any ASGI server

Module map: :mod:`~qkv.serve.app` (:func:`make_app`: the routes, the API key, the engine's
lifetime), :mod:`~qkv.serve.requests` (a request's JSON body checked once: every field used,
a no-op or refused), :mod:`~qkv.serve.fields` (one field's checks; :class:`ApiError`, the 400
naming the field), :mod:`~qkv.serve.formats` (structured output's fields into a grammar),
:mod:`~qkv.serve.flow` (an answer's choices: tokens merged, streamed, cancelled when the client
leaves), :mod:`~qkv.serve.replies` and :mod:`~qkv.serve.logprobs` (OpenAI's response objects),
:mod:`~qkv.serve.metrics` (``/metrics``), :mod:`~qkv.serve.run` (:func:`run`: the port taken
first, the engine's loop on the calling thread, uvicorn beside it, a graceful stop).
``qkv serve`` only parses flags and calls these. fastapi and uvicorn (the ``serve`` extra) are
imported when the app is made.
"""

from __future__ import annotations

from typing import Any

__all__ = ["make_app", "run"]


def __getattr__(name: str) -> Any:
    # fastapi is imported with the app, not with ``qkv.serve`` (its requests need none).
    if name == "make_app":
        from qkv.serve.app import make_app

        return make_app
    if name == "run":
        from qkv.serve.run import run

        return run
    raise AttributeError(f"module 'qkv.serve' has no attribute {name!r}")
