"""``qkv serve``: a language model behind OpenAI's HTTP API, many requests decoded together.

The command loads the model (:func:`qkv.pretrained.load`), puts it in a continuous-batching
engine (:class:`~qkv.generate.batching.BatchingEngine`: requests join and leave the running
batch at every step, a request that finds the KV-cache pool full waits for blocks), and runs
the app of :mod:`qkv.cli.serve_app` under uvicorn. fastapi and uvicorn (the ``serve`` extra)
are imported here, when the command runs, never by ``qkv --help``.

Stopping: SIGTERM or Ctrl-C makes uvicorn stop accepting connections and wait (up to
:data:`GRACE_S`) for the responses in flight to finish; then the app's lifespan shuts the
engine down. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer
from rich.console import Console

from qkv.cli.common import ModelDevice, status

__all__ = ["command", "serve"]

NAME = "serve"
GRACE_S = 60  # how long the responses in flight may take to finish after SIGTERM / Ctrl-C


def _web_stack() -> tuple[object, object]:
    """fastapi's app factory and uvicorn, or an ImportError saying what to install."""
    try:
        import uvicorn

        from qkv.cli.serve_app import make_app
    except ImportError as err:
        raise ImportError(f"qkv serve needs fastapi and uvicorn ({err.name!r} is missing): "
                          "pip install 'qkv[serve]'") from None  # fmt: skip
    return make_app, uvicorn


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 16,
          max_tokens: int = 1024, num_blocks: int | None = None,
          device: str | None = None) -> None:  # fmt: skip
    """Load ``model`` and serve it until SIGTERM / Ctrl-C (arguments as the command's options).

    Raises:
        ValueError: not a language model, or one the paged KV cache cannot serve.
        ImportError: fastapi or uvicorn missing.
    """
    make_app, uvicorn = _web_stack()
    from qkv import pretrained
    from qkv.generate.batching import BatchingEngine

    console = Console(stderr=True, highlight=False)
    with status(console, f"loading {model} ..."):
        bundle = pretrained.load(model, device=device)
    if not isinstance(bundle, pretrained.DecoderBundle):
        raise ValueError(f"{model!r} is a sentence encoder, not a language model")
    engine = BatchingEngine(bundle.model, eos_id=bundle.eos_id, max_batch=max_batch,
                            num_blocks=num_blocks)  # fmt: skip
    app = make_app(bundle, engine, max_tokens_limit=max_tokens)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACE_S,
                            lifespan="on", log_level="info")  # fmt: skip
    console.print(f"serving {bundle.name} on http://{host}:{port}/v1 (at most {max_batch} "
                  f"requests together, {engine.cache.num_blocks} cache blocks of "
                  f"{engine.cache.block_size}); Ctrl-C stops", markup=False)  # fmt: skip
    try:
        uvicorn.Server(config).run()
    finally:  # (the lifespan already stopped it, unless a second Ctrl-C forced the exit)
        engine.shutdown(cancel=True, timeout=5)


def command(
    model: Annotated[str, typer.Argument(
        help="A language model: packaged name, Hugging Face-format folder or .gguf.",
    )] = "SmolLM2-135M-Instruct",
    host: Annotated[str, typer.Option(
        "--host", help="The address to listen on (127.0.0.1: this machine only; 0.0.0.0 "
        "opens it to the network, with no authentication).",
    )] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="The TCP port.")] = 8000,
    max_batch: Annotated[int, typer.Option(
        "--max-batch", min=1, help="The most requests decoded together; more wait their turn.",
    )] = 16,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", min=1, help="The most new tokens a request may ask for (max_tokens).",
    )] = 1024,
    num_blocks: Annotated[int | None, typer.Option(
        "--num-blocks", min=1, show_default=False, help="KV-cache blocks of 16 positions in "
        "the pool \\[default: --max-batch sequences of 1024 positions]; a request waits until "
        "its blocks are free.",
    )] = None,
    device: ModelDevice = None,
) -> None:
    """Serve a language model over HTTP with OpenAI's API (completions and chat), requests
    batched together.

    POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models and
    /health. Ctrl-C or SIGTERM stops taking requests and lets those in flight finish.

    [bold]Example:[/bold] qkv serve SmolLM2-135M-Instruct --port 8000 --max-batch 16
    """
    # uvicorn re-raises the Ctrl-C it handled once it has stopped: nothing is left to do.
    with contextlib.suppress(KeyboardInterrupt):
        serve(model, host=host, port=port, max_batch=max_batch, max_tokens=max_tokens,
              num_blocks=num_blocks, device=device)  # fmt: skip
