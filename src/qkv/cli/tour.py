"""``qkv tour``: scaled dot-product attention walked through on live tensors.

:func:`compute_tour` does all the arithmetic and returns plain data (tensors and numbers), so
tests can check every figure the tour shows; :func:`print_tour` only formats that data with
rich; :func:`command` is the typer command. The six stops follow the tutorials qkv was built
from: (a) self-attention weights, (b) the four steps, (c) NumPy and torch agree, (d) the causal
mask, (e) self- versus cross-attention shapes, (f) the O(T·S) memory of the score matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Column, Table
from torch import Tensor

import qkv
from qkv.cli.common import DTypeName, human_bytes

__all__ = ["COST_LENGTHS", "Tour", "command", "compute_tour", "print_tour"]

NAME = "tour"
T_TOUR, E_TOUR = 5, 8  # the 5 tokens of width 8 that stops (a), (b) and (d) look at
COST_LENGTHS: tuple[int, ...] = tuple(2**p for p in range(9, 17))  # 512 .. 65536
COST_HEADS = 8  # the "B=1, H=8" column of stop (f)

# One row of stop (e): kind, then the shapes of query, key/value, weights and output.
Flow = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class CostRow:
    """Memory of the ``(T, S)`` score matrix: one head of one batch element, and ``B=1, H=8``."""

    T: int
    S: int
    per_head_bytes: int
    all_heads_bytes: int


@dataclass(frozen=True)
class Tour:
    """Everything the tour prints, computed once. Tensors are on the CPU, in ``dtype``.

    Attributes:
        dtype: dtype of stops (a), (b), (d), (e) and of the cost table; (c) is float64.
        x_shape: the input ``(T, E)`` of stop (a).
        weights: ``(T, T)`` self-attention weights from ``qkv.scaled_dot_product_attention``.
        row_sums: ``(T,)`` float64 sums of the rows of ``weights``.
        steps: ``(name, shape)`` of each intermediate of the four steps, in order.
        steps_max_diff: max ``|manual steps - qkv output|``.
        numpy_out_diff, numpy_weights_diff: max ``|qkv.reference - qkv torch|`` in float64.
        numpy_shape: ``(B, H, T, D)`` of the float64 comparison.
        causal_mask: ``(T, T)`` keep mask from ``qkv.masks.causal``.
        causal_weights: ``(T, T)`` weights under that mask.
        causal_upper_max: max ``|weight|`` strictly above the diagonal (exactly 0 expected).
        flows: ``(kind, query, key, weights, output)`` shapes for self- and cross-attention.
        element_size: bytes per element of ``dtype``.
        cost: one :class:`CostRow` per length in :data:`COST_LENGTHS`.
        explain_fast, explain_weights: ``str(qkv.explain(...))`` without and with weights.
    """

    dtype: torch.dtype
    x_shape: tuple[int, ...]
    weights: Tensor
    row_sums: Tensor
    steps: tuple[tuple[str, tuple[int, ...]], ...]
    steps_max_diff: float
    numpy_out_diff: float
    numpy_weights_diff: float
    numpy_shape: tuple[int, ...]
    causal_mask: Tensor
    causal_weights: Tensor
    causal_upper_max: float
    flows: tuple[Flow, ...]
    element_size: int
    cost: tuple[CostRow, ...]
    explain_fast: str
    explain_weights: str


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _numpy_agreement(gen: torch.Generator) -> tuple[float, float, tuple[int, ...]]:
    """Stop (c): ``qkv.reference`` (NumPy) against qkv's torch path, both float64."""
    from qkv import reference  # imported here: the tour's other stops do not need it

    shape = (2, 3, T_TOUR, E_TOUR)  # (B, H, T, D)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    out_np, weights_np = reference.attention(q.numpy(), k.numpy(), v.numpy())
    out = qkv.scaled_dot_product_attention(q, k, v)  # (B, H, T, D), the auto backend
    _, weights = qkv.scaled_dot_product_attention(q, k, v, need_weights=True)  # (B, H, T, T)
    out_diff = _max_diff(out, torch.from_numpy(out_np))
    weights_diff = _max_diff(weights, torch.from_numpy(weights_np))
    return out_diff, weights_diff, shape


def _shape_flows(gen: torch.Generator, dtype: torch.dtype) -> tuple[Flow, ...]:
    """Stop (e): decoder queries over themselves, then over an encoder's keys."""
    B, H, T, S, D = 2, 4, 3, 7, 16
    dec = torch.randn(B, H, T, D, generator=gen).to(dtype)  # (B, H, T, D)
    enc = torch.randn(B, H, S, D, generator=gen).to(dtype)  # (B, H, S, D)
    flows = []
    for kind, q, kv in (("self", dec, dec), ("cross", dec, enc)):
        out, w = qkv.scaled_dot_product_attention(q, kv, kv, need_weights=True)
        flows.append((kind, tuple(q.shape), tuple(kv.shape), tuple(w.shape), tuple(out.shape)))
    return tuple(flows)


def _cost(dtype: torch.dtype) -> tuple[int, tuple[CostRow, ...], str, str]:
    """Stop (f): bytes of one score matrix per length, and what ``explain`` says about it."""
    size = torch.finfo(dtype).bits // 8
    rows = tuple(CostRow(n, n, n * n * size, COST_HEADS * n * n * size) for n in COST_LENGTHS)
    q = torch.zeros(1, COST_HEADS, 64, 64, dtype=dtype)  # (B, H, T, D), a real small input
    fast = str(qkv.explain(q, q, q))
    weights = str(qkv.explain(q, q, q, need_weights=True))
    return size, rows, fast, weights


def compute_tour(seed: int = 0, dtype: torch.dtype = torch.float32) -> Tour:
    """Run every stop of the tour and return the numbers it shows.

    Args:
        seed: seeds the ``torch.Generator`` all inputs come from; same seed, same tour.
        dtype: a floating dtype for the live tensors and the memory table.

    Returns:
        A :class:`Tour`.

    Raises:
        TypeError: ``dtype`` is not a floating-point torch dtype.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    gen = torch.Generator().manual_seed(seed)
    T, E = T_TOUR, E_TOUR
    D = E

    # a) Five tokens attend to each other: project to queries, keys, values, ask for weights.
    x = torch.randn(T, E, generator=gen).to(dtype)  # (T, E)
    w_q, w_k, w_v = ((torch.randn(E, D, generator=gen) / math.sqrt(E)).to(dtype) for _ in range(3))
    q, k, v = x @ w_q, x @ w_k, x @ w_v  # (T, D) each
    _, weights = qkv.scaled_dot_product_attention(q, k, v, need_weights=True)  # (T, T)
    row_sums = weights.double().sum(dim=-1)  # (T,)

    # b) The same by hand, one torch op per step, against qkv's default (fused) path.
    scores = q @ k.transpose(-2, -1)  # (T, T)
    scaled = scores / math.sqrt(D)  # (T, T)
    probs = torch.softmax(scaled, dim=-1)  # (T, T)
    out = probs @ v  # (T, D)
    steps = tuple(
        (name, tuple(t.shape))
        for name, t in (
            ("input x", x),
            ("q = x·W_q", q),
            ("k = x·W_k", k),
            ("v = x·W_v", v),
            ("scores = q·kᵀ", scores),
            ("scaled = scores/√D", scaled),
            ("weights = softmax(scaled)", probs),
            ("out = weights·v", out),
        )
    )
    steps_max_diff = _max_diff(out, qkv.scaled_dot_product_attention(q, k, v))

    # c) NumPy reference and torch path agree in float64.
    numpy_out_diff, numpy_weights_diff, numpy_shape = _numpy_agreement(gen)

    # d) A causal mask: token i sees tokens 0..i, so the weights are lower triangular.
    mask = qkv.masks.causal(T)  # (T, T) bool, True = may attend
    _, causal_weights = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, need_weights=True
    )  # (T, T)
    causal_upper_max = float(causal_weights.triu(diagonal=1).abs().max())

    size, cost, explain_fast, explain_weights = _cost(dtype)
    return Tour(
        dtype=dtype,
        x_shape=tuple(x.shape),
        weights=weights,
        row_sums=row_sums,
        steps=steps,
        steps_max_diff=steps_max_diff,
        numpy_out_diff=numpy_out_diff,
        numpy_weights_diff=numpy_weights_diff,
        numpy_shape=numpy_shape,
        causal_mask=mask,
        causal_weights=causal_weights,
        causal_upper_max=causal_upper_max,
        flows=_shape_flows(gen, dtype),
        element_size=size,
        cost=cost,
        explain_fast=explain_fast,
        explain_weights=explain_weights,
    )


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _matrix(
    title: str, m: Tensor, extra: tuple[str, Tensor] | None = None, fmt: str = ".4f"
) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("")
    for j in range(m.shape[1]):
        table.add_column(f"k{j}", justify="right")
    if extra is not None:
        table.add_column(extra[0], justify="right", style="green")
    for i in range(m.shape[0]):
        cells = [format(x.item(), fmt) for x in m[i]]
        if extra is not None:
            cells.append(f"{float(extra[1][i]):.6f}")
        table.add_row(f"q{i}", *cells)
    return table


def print_tour(tour: Tour, console: Console) -> None:
    """Print ``tour`` section by section; formatting only, every number comes from ``tour``."""
    name = str(tour.dtype).removeprefix("torch.")
    console.rule(f"[bold]a. {T_TOUR} tokens attend to each other ({name})")
    console.print(f"input x: shape {_shape(tour.x_shape)}  (T={T_TOUR} tokens, E={E_TOUR})")
    console.print(_matrix("attention weights (T, T)", tour.weights, ("row sum", tour.row_sums)))
    worst = float((tour.row_sums - 1.0).abs().max())
    eps = torch.finfo(tour.dtype).eps
    console.print(
        f"every row sums to one: max |row sum - 1| = {worst:.2e}  ({name} eps = {eps:.2e})"
    )

    console.rule("[bold]b. scores -> scaled -> softmax -> weighted sum")
    for step, shape in tour.steps:
        console.print(f"  {step:<28} {_shape(shape)}")
    console.print(
        "manual steps vs qkv.scaled_dot_product_attention: "
        f"max |difference| = {tour.steps_max_diff:.2e}"
    )

    console.rule("[bold]c. NumPy (qkv.reference) vs torch (qkv), float64")
    console.print(f"inputs (B, H, T, D) = {_shape(tour.numpy_shape)}")
    console.print(f"output:  max abs difference = {tour.numpy_out_diff:.2e}")
    console.print(f"weights: max abs difference = {tour.numpy_weights_diff:.2e}")

    console.rule("[bold]d. causal mask: token i sees tokens 0..i")
    console.print(_matrix("causal(5): 1 = may attend", tour.causal_mask.int(), fmt="d"))
    console.print(_matrix("causal weights (T, T)", tour.causal_weights))
    console.print(
        f"upper triangle: max |weight| = {tour.causal_upper_max:g}"
        + (" (exactly zero)" if tour.causal_upper_max == 0.0 else " (NOT zero)")
    )

    console.rule("[bold]e. self- vs cross-attention shapes")
    table = Table("kind", "query", "key/value", "weights", "output", header_style="bold")
    for kind, q, kv, w, out in tour.flows:
        table.add_row(kind, _shape(q), _shape(kv), _shape(w), _shape(out))
    console.print(table)
    console.print("(B, H, T, D) x (B, H, S, D) -> weights (B, H, T, S) -> out (B, H, T, D)")

    console.rule(f"[bold]f. the O(T·S) cost: one score matrix in {name}")
    table = Table(
        Column("T = S", justify="right"),
        "per head, per batch element",
        f"B=1, H={COST_HEADS}",
        header_style="bold",
        title=f"T·S·{tour.element_size} bytes ({name} is {tour.element_size} bytes)",
    )
    for row in tour.cost:
        table.add_row(
            f"{row.T:,}", human_bytes(row.per_head_bytes), human_bytes(row.all_heads_bytes)
        )
    console.print(table)
    console.print(
        "The math backend materialises these scores; a fused kernel works block by block and "
        "never holds them all. qkv.explain says which backend a call gets "
        f"(B=1, H={COST_HEADS}, T=S=64, D=64):"
    )
    console.print(tour.explain_fast, markup=False, highlight=False)
    console.print("and when the weights themselves are asked for (need_weights=True):")
    console.print(tour.explain_weights, markup=False, highlight=False)


def command(
    seed: Annotated[int, typer.Option("--seed", help="Seed of every random input.")] = 0,
    dtype: Annotated[
        DTypeName, typer.Option("--dtype", help="Dtype of the live tensors and memory table.")
    ] = DTypeName.float32,
) -> None:
    """Walk through scaled dot-product attention on live tensors.

    Six stops: self-attention weights whose rows sum to one; the four steps with their shapes;
    NumPy and torch agreeing in float64; the causal mask; self- vs cross-attention shapes; and
    the O(T·S) memory of the score matrix.

    [bold]Example:[/bold] qkv tour --seed 1 --dtype float64
    """
    print_tour(compute_tour(seed=seed, dtype=dtype.to_torch()), Console())
