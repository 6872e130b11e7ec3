"""Tour stops on the attention function itself: its weights, its four steps, NumPy vs torch.

    Attention(Q, K, V) = softmax(Q·Kᵀ / √D) · V                      (Vaswani et al., 2017)

The numbers come from :func:`qkv.cli.tour.basics.compute_tour` (``ctx.basics``); each stop
shows them and checks them against an independent computation: the formula written with
torch ops, torch's own ``F.scaled_dot_product_attention`` and qkv's NumPy reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import qkv
from qkv.cli.tour.basics import E_TOUR, T_TOUR
from qkv.cli.tour.page import Context, Section, shape_text

__all__ = ["attention_stop", "numpy_stop", "steps_stop"]


def _tol(ctx: Context, scale: float = 1.0) -> float:
    """A few roundings of ``ctx.dtype`` on values of size ``scale``."""
    return 16 * torch.finfo(ctx.dtype).eps * (1.0 + scale)


def attention_stop(ctx: Context, s: Section) -> None:
    """(a) Five tokens attend to each other: the weights, rows summing to one, = torch."""
    t = ctx.basics
    name = str(ctx.dtype).removeprefix("torch.")
    s.text(
        f"{T_TOUR} tokens of width {E_TOUR} ({name}) are projected to queries, keys and values "
        "(q = x·W_q, k = x·W_k, v = x·W_v); qkv.scaled_dot_product_attention(q, k, v, "
        "need_weights=True) returns the output and the (T, T) weights: entry (i, j) is the "
        "share of token j's value that flows into token i's output."
    )
    s.text(f"input x: shape {shape_text(t.x_shape)}  (T={T_TOUR} tokens, E={E_TOUR})")
    s.matrix("attention weights (T, T)", t.weights, extra=("row sum", t.row_sums))
    s.heatmaps("attention weights: row i = query token i, column j = key token j",
               [("weights", t.weights)])  # fmt: skip
    eps = torch.finfo(ctx.dtype).eps
    s.at_most("every row sums to one: max |row sum - 1|", float((t.row_sums - 1).abs().max()),
              8 * eps)  # fmt: skip
    s.holds("every weight is >= 0", bool((t.weights >= 0).all()))
    D = t.q.shape[-1]
    formula = torch.softmax(t.q.double() @ t.k.double().T / math.sqrt(D), dim=-1)  # (T, T)
    s.close("weights = softmax(q·kᵀ/√D) written out in float64", t.weights, formula, 8 * eps)
    out = qkv.scaled_dot_product_attention(t.q, t.k, t.v)  # (T, D)
    torch_out = F.scaled_dot_product_attention(t.q[None], t.k[None], t.v[None])[0]  # (T, D)
    s.close("output = torch.nn.functional.scaled_dot_product_attention", out, torch_out,
            _tol(ctx, float(t.v.abs().max())))  # fmt: skip


def steps_stop(ctx: Context, s: Section) -> None:
    """(b) The four steps with their shapes; done by hand they equal qkv's fused call."""
    t = ctx.basics
    s.text(
        "The same attention one torch op at a time: scores = q·kᵀ, scaled by 1/√D so their "
        "spread does not grow with the width, softmax along each row, then the weighted sum "
        "of the values."
    )
    s.pre("\n".join(f"  {step:<28} {shape_text(shape)}" for step, shape in t.steps))
    D = t.q.shape[-1]
    scores = t.q @ t.k.T  # (T, T)
    probs = torch.softmax(scores / math.sqrt(D), dim=-1)  # (T, T)
    s.heatmaps("the four steps on live tensors", [
        ("1. scores = q·kᵀ", scores), ("2. scaled = scores/√D", scores / math.sqrt(D)),
        ("3. weights = softmax", probs), ("4. out = weights·v  (T, D)", probs @ t.v),
    ])  # fmt: skip
    shapes = dict(t.steps)
    T = t.x_shape[0]
    s.holds("scores and weights are (T, T), the output (T, D)",
            shapes["scores = q·kᵀ"] == shapes["weights = softmax(scaled)"] == (T, T)
            and shapes["out = weights·v"] == (T, D))  # fmt: skip
    scaled = scores.double() / math.sqrt(D)  # (T, T)
    exp = torch.exp(scaled - scaled.max(-1, keepdim=True).values)  # (T, T), max subtracted
    s.close("softmax = exp(s - max) / Σ exp(s - max), written out in float64", probs,
            exp / exp.sum(-1, keepdim=True), 8 * torch.finfo(ctx.dtype).eps)  # fmt: skip
    s.at_most("manual steps vs qkv.scaled_dot_product_attention: max |difference|",
              t.steps_max_diff, _tol(ctx, float(t.v.abs().max())))  # fmt: skip


def numpy_stop(ctx: Context, s: Section) -> None:
    """(c) qkv's NumPy reference (float64) and its torch path agree."""
    t = ctx.basics
    s.text(
        "qkv.reference is the formula in NumPy float64 (no torch); the torch path must agree "
        f"with it to rounding. Inputs (B, H, T, D) = {shape_text(t.numpy_shape)}."
    )
    s.at_most("output:  max abs difference", t.numpy_out_diff, 1e-10)
    s.at_most("weights: max abs difference", t.numpy_weights_diff, 1e-10)
    ref, mine = t.numpy_pair
    s.heatmaps("first head's weights: NumPy, torch, and |difference| x 1e15", [
        ("NumPy (qkv.reference)", ref), ("torch (qkv)", mine),
        ("|difference| x 1e15", (ref - mine).abs() * 1e15),
    ])  # fmt: skip
