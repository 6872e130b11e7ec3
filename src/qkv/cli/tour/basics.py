"""The numbers of the tour's attention-function stops, computed once as plain data.

:func:`compute_tour` runs scaled dot-product attention on live tensors and returns a
:class:`Tour` (tensors and numbers), so tests can check every figure the tour shows:
(a) self-attention weights, (b) the four steps, (c) NumPy and torch agree, (d) the causal
mask, (e) self- versus cross-attention shapes, (f) the O(T·S) memory of the score matrix.
The stops in :mod:`qkv.cli.tour.attention`, :mod:`qkv.cli.tour.masks` and
:mod:`qkv.cli.tour.memory` show these numbers and check them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

import qkv

__all__ = ["COST_HEADS", "COST_LENGTHS", "E_TOUR", "T_TOUR", "CostRow", "Tour", "compute_tour"]

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
        q, k, v: its queries, keys and values ``(T, D)``.
        weights: ``(T, T)`` self-attention weights from ``qkv.scaled_dot_product_attention``.
        row_sums: ``(T,)`` float64 sums of the rows of ``weights``.
        steps: ``(name, shape)`` of each intermediate of the four steps, in order.
        steps_max_diff: max ``|manual steps - qkv output|``.
        numpy_out_diff, numpy_weights_diff: max ``|qkv.reference - qkv torch|`` in float64.
        numpy_shape: ``(B, H, T, D)`` of the float64 comparison.
        numpy_pair: the ``(T, T)`` weights of its first head: NumPy's, then qkv's.
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
    q: Tensor
    k: Tensor
    v: Tensor
    weights: Tensor
    row_sums: Tensor
    steps: tuple[tuple[str, tuple[int, ...]], ...]
    steps_max_diff: float
    numpy_out_diff: float
    numpy_weights_diff: float
    numpy_shape: tuple[int, ...]
    numpy_pair: tuple[Tensor, Tensor]
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


def _self_attention(gen: torch.Generator, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """Stop (a): five tokens attend to each other: project to queries, keys, values, ask for
    the weights. Returns ``(x, q, k, v, weights, row_sums)``."""
    T, E = T_TOUR, E_TOUR
    D = E
    x = torch.randn(T, E, generator=gen).to(dtype)  # (T, E)
    w_q, w_k, w_v = ((torch.randn(E, D, generator=gen) / math.sqrt(E)).to(dtype) for _ in range(3))
    q, k, v = x @ w_q, x @ w_k, x @ w_v  # (T, D) each
    _, weights = qkv.scaled_dot_product_attention(q, k, v, need_weights=True)  # (T, T)
    row_sums = weights.double().sum(dim=-1)  # (T,)
    return x, q, k, v, weights, row_sums


def _four_steps(x: Tensor, q: Tensor, k: Tensor,
                v: Tensor) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], float]:  # fmt: skip
    """Stop (b): the same by hand, one torch op per step, against qkv's default (fused) path.
    Returns ``(steps, steps_max_diff)``: each intermediate's name and shape, in order, and
    the max ``|manual steps - qkv output|``."""
    D = q.shape[-1]
    scores = q @ k.transpose(-2, -1)  # (T, T)
    scaled = scores / math.sqrt(D)  # (T, T)
    probs = torch.softmax(scaled, dim=-1)  # (T, T)
    out = probs @ v  # (T, D)
    named = (("input x", x), ("q = x·W_q", q), ("k = x·W_k", k), ("v = x·W_v", v),
             ("scores = q·kᵀ", scores), ("scaled = scores/√D", scaled),
             ("weights = softmax(scaled)", probs), ("out = weights·v", out))  # fmt: skip
    steps = tuple((name, tuple(t.shape)) for name, t in named)
    return steps, _max_diff(out, qkv.scaled_dot_product_attention(q, k, v))


def _numpy_agreement(
    gen: torch.Generator,
) -> tuple[float, float, tuple[int, ...], tuple[Tensor, Tensor]]:
    """Stop (c): ``qkv.reference`` (NumPy) against qkv's torch path, both float64."""
    from qkv import reference  # imported here: the tour's other stops do not need it

    shape = (2, 3, T_TOUR, E_TOUR)  # (B, H, T, D)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    out_np, weights_np = reference.attention(q.numpy(), k.numpy(), v.numpy())
    out = qkv.scaled_dot_product_attention(q, k, v)  # (B, H, T, D), the auto backend
    _, weights = qkv.scaled_dot_product_attention(q, k, v, need_weights=True)  # (B, H, T, T)
    out_diff = _max_diff(out, torch.from_numpy(out_np))
    weights_diff = _max_diff(weights, torch.from_numpy(weights_np))
    return out_diff, weights_diff, shape, (torch.from_numpy(weights_np)[0, 0], weights[0, 0])


def _causal(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, float]:
    """Stop (d): a causal mask: token i sees tokens 0..i, so the weights are lower triangular.
    Returns ``(mask, weights, max |weight| strictly above the diagonal)``."""
    mask = qkv.masks.causal(q.shape[-2])  # (T, T) bool, True = may attend
    _, weights = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, need_weights=True
    )  # (T, T)
    return mask, weights, float(weights.triu(diagonal=1).abs().max())


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
    # One generator, drawn from in stop order: (a), then (c), then (e).
    gen = torch.Generator().manual_seed(seed)
    x, q, k, v, weights, row_sums = _self_attention(gen, dtype)  # a) five tokens' weights
    steps, steps_max_diff = _four_steps(x, q, k, v)  # b) the four steps by hand
    numpy_out_diff, numpy_weights_diff, numpy_shape, numpy_pair = _numpy_agreement(gen)  # c)
    causal_mask, causal_weights, causal_upper_max = _causal(q, k, v)  # d) the causal mask
    flows = _shape_flows(gen, dtype)  # e) self- and cross-attention shapes
    size, cost, explain_fast, explain_weights = _cost(dtype)  # f) the score matrix's memory
    return Tour(
        dtype=dtype, x_shape=tuple(x.shape), q=q, k=k, v=v, weights=weights,
        row_sums=row_sums, steps=steps, steps_max_diff=steps_max_diff,
        numpy_out_diff=numpy_out_diff, numpy_weights_diff=numpy_weights_diff,
        numpy_shape=numpy_shape, numpy_pair=numpy_pair, causal_mask=causal_mask,
        causal_weights=causal_weights, causal_upper_max=causal_upper_max, flows=flows,
        element_size=size, cost=cost, explain_fast=explain_fast,
        explain_weights=explain_weights,
    )
