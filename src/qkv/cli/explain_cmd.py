"""``qkv explain``: which attention backend a call of a given shape runs on, and why.

The tensors are zero-strided views of one scalar, so asking about ``T = S = 65536`` costs no
memory: :func:`qkv.explain` validates shapes and flags but computes nothing.
"""

from __future__ import annotations

from typing import Annotated

import torch
import typer
from rich.console import Console

import qkv
from qkv.cli.common import FLAG, DTypeName, fail, human_bytes

__all__ = ["build_inputs", "command"]

NAME = "explain"


def build_inputs(
    batch: int, heads: int, kv_heads: int, T: int, S: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query ``(B, H, T, D)``, key and value ``(B, Hkv, S, D)``, all views of one zero.

    Raises:
        ValueError: a size that is not a positive int (zero lengths are allowed).
    """
    for name, n, low in (
        ("--batch", batch, 1),
        ("--heads", heads, 1),
        ("--kv-heads", kv_heads, 1),
        ("--T", T, 0),
        ("--S", S, 0),
        ("--dim", dim, 1),
    ):
        if n < low:
            raise ValueError(f"{name} must be >= {low}, got {n}")
    zero = torch.zeros((), dtype=dtype)
    q = zero.expand(batch, heads, T, dim)  # (B, H, T, D)
    kv = zero.expand(batch, kv_heads, S, dim)  # (B, Hkv, S, D)
    return q, kv, kv


def command(
    T: Annotated[int, typer.Option("--T", help="Query length T.")] = 1024,
    S: Annotated[int, typer.Option("--S", help="Key/value length S.")] = 1024,
    heads: Annotated[int, typer.Option("--heads", help="Query heads H.")] = 8,
    kv_heads: Annotated[
        int, typer.Option("--kv-heads", help="Key/value heads Hkv (< H: grouped-query).")
    ] = 8,
    dim: Annotated[int, typer.Option("--dim", help="Head width D.")] = 64,
    batch: Annotated[int, typer.Option("--batch", help="Batch size B.")] = 1,
    causal: Annotated[bool, typer.Option(
        "--causal/--no-causal", metavar=FLAG, help="Causal masking (is_causal) or none.",
    )] = False,
    need_weights: Annotated[bool, typer.Option(
        "--need-weights/--no-need-weights", metavar=FLAG,
        help="Ask for the (B, H, T, S) attention weights too, or only the output.",
    )] = False,
    dtype: Annotated[DTypeName, typer.Option("--dtype", help="Dtype of the inputs.")] = (
        DTypeName.float32
    ),
    backend: Annotated[
        str, typer.Option("--backend", help="auto, or a backend name to check.")
    ] = "auto",
    world_size: Annotated[
        int, typer.Option("--world-size", help="Ranks of context-parallel attention (> 1: "
                          "say whether ring or all-to-all serves it and what each rank sends).")
    ] = 1,
    cp_method: Annotated[
        str, typer.Option("--cp-method", help="Context-parallel method: auto, ring or "
                          "all_to_all.")
    ] = "auto",
) -> None:
    """Say which attention backend runs for a call of this shape, and why not the others.

    [bold]Example:[/bold] qkv explain --T 1024 --S 1024 --heads 8 --kv-heads 8 --dim 64
    --causal --need-weights --dtype float32

    [bold]Across processes:[/bold] qkv explain --T 131072 --S 131072 --causal --world-size 4
    """
    console = Console(highlight=False)
    torch_dtype = dtype.to_torch()
    try:
        q, k, v = build_inputs(batch, heads, kv_heads, T, S, dim, torch_dtype)
        explanation = qkv.explain(
            q,
            k,
            v,
            is_causal=causal,
            enable_gqa=kv_heads != heads,
            need_weights=need_weights,
            backend=backend,
        )
        parallel = None
        if world_size != 1:
            parallel = _context_parallel(
                batch, heads, kv_heads, T, S, dim, torch_dtype, world_size, cp_method
            )
    except (ValueError, TypeError) as err:
        raise fail(err) from None
    # soft_wrap: a line is never broken, however long its numbers (T = S = 10⁹ works too).
    console.print(str(explanation), markup=False, soft_wrap=True)
    size = torch.finfo(torch_dtype).bits // 8
    console.print(
        f"one full score matrix (B, H, T, S) in {dtype.value}: "
        f"{human_bytes(batch * heads * T * S * size)}",
        soft_wrap=True,
    )
    if parallel is not None:
        console.print(str(parallel), markup=False, soft_wrap=True)


def _context_parallel(batch, heads, kv_heads, T, S, dim, dtype, world_size, method):
    """``qkv.distributed.explain_parallel`` for the same call over ``world_size`` ranks."""
    from qkv.distributed import explain_parallel
    from qkv.distributed.context import METHODS

    if method not in METHODS:
        raise ValueError(f"--cp-method must be one of {', '.join(METHODS)}, got {method!r}")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    if T != S:
        raise ValueError(
            f"--world-size shards one sequence (self-attention): --T ({T}) must equal --S ({S})"
        )
    return explain_parallel(
        B=batch, H=heads, Hkv=kv_heads, T=T, D=dim, world_size=world_size, dtype=dtype,
        method=method,
    )
