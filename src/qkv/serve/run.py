"""The serving app under uvicorn: listening, a graceful stop, the engine shut down after.

Stopping: SIGTERM or Ctrl-C makes uvicorn stop accepting connections and wait (up to
:data:`GRACE_S`) for the responses in flight to finish; then the app's lifespan shuts the
engine down. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.generate.batching import BatchingEngine
    from qkv.pretrained.bundle import DecoderBundle

__all__ = ["GRACE_S", "run", "web_stack"]

GRACE_S = 60  # how long the responses in flight may take to finish after SIGTERM / Ctrl-C


def web_stack() -> tuple[object, object]:
    """fastapi's app factory and uvicorn, or an ImportError saying what to install (call it
    before loading a model, to fail in one line first)."""
    try:
        import uvicorn

        from qkv.serve.app import make_app
    except ImportError as err:
        raise ImportError(f"qkv serve needs fastapi and uvicorn ({err.name!r} is missing): "
                          "pip install 'qkv[serve]'") from None  # fmt: skip
    return make_app, uvicorn


def run(bundle: DecoderBundle, engine: BatchingEngine, *, host: str = "127.0.0.1",
        port: int = 8000, max_tokens_limit: int = 1024,
        announce: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Serve ``bundle`` through ``engine`` on ``host:port`` until SIGTERM / Ctrl-C.

    ``announce`` (default: nothing) gets one line saying where it serves, once the app is
    built. The engine is shut down when the server stops, whatever stopped it.

    Raises:
        ImportError: fastapi or uvicorn missing.
    """
    make_app, uvicorn = web_stack()
    app = make_app(bundle, engine, max_tokens_limit=max_tokens_limit)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACE_S,
                            lifespan="on", log_level="info")  # fmt: skip
    if announce is not None:
        announce(f"serving {bundle.name} on http://{host}:{port}/v1 (at most "
                 f"{engine.max_batch} requests together, {engine.cache.num_blocks} cache "
                 f"blocks of {engine.cache.block_size}); Ctrl-C stops")  # fmt: skip
    try:
        # uvicorn re-raises the Ctrl-C it handled once it has stopped: nothing is left to do.
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.Server(config).run()
    finally:  # (the lifespan already stopped it, unless a second Ctrl-C forced the exit)
        engine.shutdown(cancel=True, timeout=5)
