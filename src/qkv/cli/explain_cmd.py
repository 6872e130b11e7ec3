"""``qkv explain``: which attention backend a call of a given shape runs on, and why.

The tensors are zero-strided views of one scalar, so asking about ``T = S = 65536`` costs no
memory: :func:`qkv.explain` validates shapes and flags but computes nothing. The command's
options travel as one :class:`ExplainOptions`, checked once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch
import typer
from rich.console import Console

import qkv
from qkv.cli.common import FLAG, DTypeName, human_bytes

__all__ = ["ExplainOptions", "build_inputs", "command"]

NAME = "explain"

QueryLength = Annotated[int, typer.Option("--T", help="Query length T.")]
KeyLength = Annotated[int, typer.Option("--S", help="Key/value length S.")]
Heads = Annotated[int, typer.Option("--heads", help="Query heads H.")]
KvHeads = Annotated[int, typer.Option(
    "--kv-heads", help="Key/value heads Hkv (< H: grouped-query).",
)]
Dim = Annotated[int, typer.Option("--dim", help="Head width D.")]
Batch = Annotated[int, typer.Option("--batch", help="Batch size B.")]
Causal = Annotated[bool, typer.Option(
    "--causal/--no-causal", metavar=FLAG, help="Causal masking (is_causal) or none.",
)]
NeedWeights = Annotated[bool, typer.Option(
    "--need-weights/--no-need-weights", metavar=FLAG,
    help="Ask for the (B, H, T, S) attention weights too, or only the output.",
)]
Dtype = Annotated[DTypeName, typer.Option("--dtype", help="Dtype of the inputs.")]
Backend = Annotated[str, typer.Option("--backend", help="auto, or a backend name to check.")]
WorldSize = Annotated[int, typer.Option(
    "--world-size", help="Ranks of context-parallel attention (> 1: say whether ring or "
    "all-to-all serves it and what each rank sends).",
)]
CpMethod = Annotated[str, typer.Option(
    "--cp-method", help="Context-parallel method: auto, ring or all_to_all.",
)]


def _check_sizes(batch: int, heads: int, kv_heads: int, T: int, S: int, dim: int) -> None:
    """Raise ValueError naming the first size that is not a positive int (lengths may be 0)."""
    for name, n, low in (("--batch", batch, 1), ("--heads", heads, 1),
                         ("--kv-heads", kv_heads, 1), ("--T", T, 0), ("--S", S, 0),
                         ("--dim", dim, 1)):  # fmt: skip
        if n < low:
            raise ValueError(f"{name} must be >= {low}, got {n}")


def build_inputs(
    batch: int, heads: int, kv_heads: int, T: int, S: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query ``(B, H, T, D)``, key and value ``(B, Hkv, S, D)``, all views of one zero.

    Raises:
        ValueError: a size that is not a positive int (zero lengths are allowed).
    """
    _check_sizes(batch, heads, kv_heads, T, S, dim)
    zero = torch.zeros((), dtype=dtype)
    q = zero.expand(batch, heads, T, dim)  # (B, H, T, D)
    kv = zero.expand(batch, kv_heads, S, dim)  # (B, Hkv, S, D)
    return q, kv, kv


@dataclass(frozen=True)
class ExplainOptions:
    """The call ``qkv explain`` asks about, checked once, when built.

    Raises:
        ValueError: a size that is not a positive int (lengths may be 0); with
            ``world_size != 1``, an unknown ``cp_method``, ``world_size < 1`` or ``T != S``.
    """

    T: int = 1024  # query length
    S: int = 1024  # key/value length
    heads: int = 8
    kv_heads: int = 8  # < heads: grouped-query attention
    dim: int = 64  # head width D
    batch: int = 1
    causal: bool = False
    need_weights: bool = False
    dtype: DTypeName = DTypeName.float32
    backend: str = "auto"
    world_size: int = 1  # 1: one process; > 1: context-parallel over this many ranks
    cp_method: str = "auto"  # read only when world_size != 1

    def __post_init__(self) -> None:
        _check_sizes(self.batch, self.heads, self.kv_heads, self.T, self.S, self.dim)
        if self.world_size == 1:
            return
        from qkv.distributed.context import METHODS

        if self.cp_method not in METHODS:
            raise ValueError(f"--cp-method must be one of {', '.join(METHODS)}, got "
                             f"{self.cp_method!r}")  # fmt: skip
        if self.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {self.world_size}")
        if self.T != self.S:
            raise ValueError(f"--world-size shards one sequence (self-attention): --T ({self.T})"
                             f" must equal --S ({self.S})")  # fmt: skip


def command(
    T: QueryLength = 1024,
    S: KeyLength = 1024,
    heads: Heads = 8,
    kv_heads: KvHeads = 8,
    dim: Dim = 64,
    batch: Batch = 1,
    causal: Causal = False,
    need_weights: NeedWeights = False,
    dtype: Dtype = DTypeName.float32,
    backend: Backend = "auto",
    world_size: WorldSize = 1,
    cp_method: CpMethod = "auto",
) -> None:
    """Say which attention backend runs for a call of this shape, and why not the others.

    [bold]Example:[/bold] qkv explain --T 1024 --S 1024 --heads 8 --kv-heads 8 --dim 64
    --causal --need-weights --dtype float32

    [bold]Across processes:[/bold] qkv explain --T 131072 --S 131072 --causal --world-size 4
    """
    # Expected failures (ValueError, TypeError) become one line in common.guard.
    options = ExplainOptions(
        T=T, S=S, heads=heads, kv_heads=kv_heads, dim=dim, batch=batch, causal=causal,
        need_weights=need_weights, dtype=dtype, backend=backend, world_size=world_size,
        cp_method=cp_method,
    )
    explanation = explain(options)
    parallel = explain_parallel(options) if options.world_size != 1 else None
    # soft_wrap: a line is never broken, however long its numbers (T = S = 10⁹ works too).
    console = Console(highlight=False)
    console.print(str(explanation), markup=False, soft_wrap=True)
    o = options
    size = torch.finfo(o.dtype.to_torch()).bits // 8
    console.print(f"one full score matrix (B, H, T, S) in {o.dtype.value}: "
                  f"{human_bytes(o.batch * o.heads * o.T * o.S * size)}", soft_wrap=True)
    if parallel is not None:
        console.print(str(parallel), markup=False, soft_wrap=True)


def explain(options: ExplainOptions) -> Any:
    """:func:`qkv.explain` of the call ``options`` describes (on zero-strided inputs)."""
    o = options
    q, k, v = build_inputs(o.batch, o.heads, o.kv_heads, o.T, o.S, o.dim, o.dtype.to_torch())
    return qkv.explain(q, k, v, is_causal=o.causal, enable_gqa=o.kv_heads != o.heads,
                       need_weights=o.need_weights, backend=o.backend)  # fmt: skip


def explain_parallel(options: ExplainOptions) -> Any:
    """``qkv.distributed.explain_parallel`` for the same call over ``world_size`` ranks."""
    from qkv.distributed import explain_parallel as explained

    o = options
    return explained(B=o.batch, H=o.heads, Hkv=o.kv_heads, T=o.T, D=o.dim,
                     world_size=o.world_size, dtype=o.dtype.to_torch(),
                     method=o.cp_method)  # fmt: skip
