"""``qkv serve``: a language model behind OpenAI's HTTP API, many requests decoded together.

The command parses its flags, loads the model (:func:`qkv.pretrained.load`), puts it in a
continuous-batching engine (:class:`~qkv.generate.batching.BatchingEngine`: requests join and
leave the running batch at every step, a request that finds the KV-cache pool full waits for
blocks) and hands both to :func:`qkv.serve.run` (the app of :mod:`qkv.serve.app` under
uvicorn). fastapi and uvicorn (the ``serve`` extra) are imported when the command runs, never
by ``qkv --help``. Ctrl-C or SIGTERM stops taking requests and lets those in flight finish.
"""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer
from rich.console import Console

from qkv.cli.common import FLAG, ModelDevice, status

__all__ = ["command", "serve"]

NAME = "serve"


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 16,
          max_tokens: int = 1024, num_blocks: int | None = None, device: str | None = None,
          api_key: str | None = None, access_log: bool = True, prefix_cache: bool = True,
          prefill_chunk: int = 256) -> None:  # fmt: skip
    """Load ``model`` and serve it until SIGTERM / Ctrl-C (arguments as the command's options).

    Raises:
        ValueError: not a language model, or one the paged KV cache cannot serve; an empty
            API key.
        ImportError: fastapi or uvicorn missing.
        OSError: the port cannot be taken (checked before the model loads).
    """
    from qkv import pretrained
    from qkv.generate.batching import BatchingEngine
    from qkv.serve.run import bind, run, web_stack

    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key (or QKV_API_KEY) must not be empty; leave it unset for none")
    web_stack()  # fastapi and uvicorn there, before the model loads
    sock = bind(host, port)  # the port taken before the model loads
    with contextlib.closing(sock):
        console = Console(stderr=True, highlight=False)
        with status(console, f"loading {model} ..."):
            bundle = pretrained.load(model, device=device)
        if not isinstance(bundle, pretrained.DecoderBundle):
            raise ValueError(f"{model!r} is a sentence encoder, not a language model")
        engine = BatchingEngine(bundle.model, eos_id=bundle.eos_id, max_batch=max_batch,
                                num_blocks=num_blocks, prefix_cache=prefix_cache,
                                prefill_chunk=prefill_chunk,
                                tokenizer=bundle.tokenizer)  # fmt: skip
        run(bundle, engine, host=host, port=port, max_tokens_limit=max_tokens,
            api_key=api_key, access_log=access_log, sock=sock,
            announce=lambda line: console.print(line, markup=False, soft_wrap=True))  # fmt: skip


def command(
    model: Annotated[str, typer.Argument(
        help="A language model: packaged name, Hugging Face-format folder or .gguf.",
    )] = "SmolLM2-135M-Instruct",
    host: Annotated[str, typer.Option(
        "--host", help="The address to listen on (127.0.0.1: this machine only; 0.0.0.0 "
        "opens it to the network: set --api-key).",
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
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="QKV_API_KEY", show_default=False, help="A key the /v1 routes "
        "ask for ('Authorization: Bearer <key>'; 401 without it) \\[default: none; also read "
        "from QKV_API_KEY].",
    )] = None,
    access_log: Annotated[bool, typer.Option(
        "--access-log/--no-access-log", metavar=FLAG, help="A log line per request.",
    )] = True,
    prefix_cache: Annotated[bool, typer.Option(
        "--prefix-cache/--no-prefix-cache", metavar=FLAG, help="Share the KV-cache blocks of "
        "prompts that start alike (a system prompt, a chat's earlier turns) between requests.",
    )] = True,
    prefill_chunk: Annotated[int, typer.Option(
        "--prefill-chunk", min=1, help="The most prompt tokens read per decoding step: a long "
        "prompt is read in chunks while the other requests keep streaming.",
    )] = 256,
) -> None:
    """Serve a language model over HTTP with OpenAI's API (completions and chat), requests
    batched together.

    POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models,
    /health and /metrics (Prometheus). Ctrl-C or SIGTERM stops taking requests and lets those
    in flight finish.

    [bold]Example:[/bold] qkv serve SmolLM2-135M-Instruct --port 8000 --max-batch 16
    """
    serve(model, host=host, port=port, max_batch=max_batch, max_tokens=max_tokens,
          num_blocks=num_blocks, device=device, api_key=api_key, access_log=access_log,
          prefix_cache=prefix_cache, prefill_chunk=prefill_chunk)
