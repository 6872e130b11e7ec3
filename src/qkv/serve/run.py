"""The serving app under uvicorn: listening, a graceful stop, the engine shut down after.

Listening: :func:`bind` takes the port first, before a model loads, so a port in use is one
clear error at once; uvicorn then serves on that socket.

Threads: the engine's loop runs on the calling thread, the one that loaded the model
(:meth:`~qkv.generate.batching.BatchingEngine.claim` says why), uvicorn on a thread of its own.

Stopping: SIGTERM or Ctrl-C makes uvicorn stop accepting connections and wait (up to
:data:`GRACE_S`) for the responses in flight to finish; then the app's lifespan shuts the
engine down. A second signal stops at once.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.generate.batching import BatchingEngine
    from qkv.pretrained.bundle import DecoderBundle

__all__ = ["GRACE_S", "bind", "run", "web_stack"]

GRACE_S = 60  # how long the responses in flight may take to finish after SIGTERM / Ctrl-C


def web_stack() -> tuple[object, object]:
    """fastapi's app factory and uvicorn, or an ImportError saying what to install (call it
    before loading a model, to fail in one line first)."""
    try:
        import uvicorn

        from qkv.serve.app import make_app
    except ImportError as err:
        raise ImportError(f"qkv serve needs fastapi, uvicorn and prometheus-client ({err.name!r} "
                          "is missing): pip install 'qkv[serve]'") from None  # fmt: skip
    return make_app, uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one), as uvicorn would open it.

    Raises:
        OSError: the address cannot be taken (in use, not this machine's), saying which.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as err:
        raise OSError(f"--host {host!r}: not an address to listen on ({err})") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise OSError(f"--port {port}: cannot listen on {host}:{port} ({err.strerror or err}); "
                      "choose another port, or stop what holds it") from None  # fmt: skip
    return sock


def run(bundle: DecoderBundle, engine: BatchingEngine, *, host: str = "127.0.0.1",
        port: int = 8000, max_tokens_limit: int = 1024, api_key: str | None = None,
        access_log: bool = True, sock: socket.socket | None = None,
        announce: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Serve ``bundle`` through ``engine`` on ``host:port`` until SIGTERM / Ctrl-C.

    ``sock``: a socket already listening there (:func:`bind`; default: bound here).
    ``api_key``: the key the ``/v1`` routes ask for (None: none). ``access_log``: a line per
    request. ``announce`` (default: nothing) gets one line saying where it serves, once the
    app is built. The engine is shut down when the server stops, whatever stopped it.

    Raises:
        ImportError: fastapi or uvicorn missing.
        OSError: the address cannot be taken.
    """
    make_app, uvicorn = web_stack()
    sock = sock if sock is not None else bind(host, port)
    app = make_app(bundle, engine, max_tokens_limit=max_tokens_limit, api_key=api_key)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACE_S,
                            lifespan="on", log_level="info", access_log=access_log)  # fmt: skip
    server = uvicorn.Server(config)
    # The engine's loop runs here, on the thread that loaded the model (one OpenMP pool:
    # BatchingEngine.claim says why), and the web server on a thread of its own.
    engine.claim()
    web = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="qkv-web",
                           daemon=True)  # fmt: skip

    def on_signal(signum: int, frame: object) -> None:
        if server.should_exit:  # the second: stop at once
            server.force_exit = True
            engine.shutdown(cancel=True)
        server.should_exit = True

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    if announce is not None:
        where = sock.getsockname()
        announce(f"serving {bundle.name} on http://{where[0]}:{where[1]}/v1 (at most "
                 f"{engine.max_batch} requests together, {engine.cache.num_blocks} cache "
                 f"blocks of {engine.cache.block_size}; "
                 f"{'an API key' if api_key else 'no API key'}); Ctrl-C stops")  # fmt: skip
    web.start()
    try:
        engine.run(stop_when=lambda: not web.is_alive())
    finally:  # (the lifespan already stopped it, unless a second signal forced the exit)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        server.should_exit = True
        web.join(GRACE_S + 5)
        engine.shutdown(cancel=True, timeout=5)
