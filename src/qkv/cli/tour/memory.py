"""Tour stop on cost: the ``(T, S)`` score matrix grows as ``T·S``, and what flash changes.

The textbook (math) path materialises every score; a blockwise kernel with an online softmax
(FlashAttention, Dao et al., 2022) visits the scores one tile at a time and never holds them
all, computing the same result. The table is the arithmetic ``T·S·bytes``; the peaks are
:mod:`qkv.attention.costs`' predictions as ``qkv.explain`` reports them (no memory is
allocated: the inputs are expanded views); the equality is run on live tensors.
"""

from __future__ import annotations

import torch

import qkv
from qkv.cli.common import human_bytes
from qkv.cli.tour.basics import COST_HEADS, COST_LENGTHS
from qkv.cli.tour.page import Context, Section

__all__ = ["memory_stop"]

D_COST = 64  # head width of the cost table's calls


def _peaks(dtype: torch.dtype) -> dict[str, list[int]]:
    """Predicted peak extra bytes of each backend at ``B=1, H=8, T=S=n, D=64``."""
    peaks: dict[str, list[int]] = {"math": [], "flash": [], "torch": []}
    for n in COST_LENGTHS:
        q = torch.zeros(1, 1, 1, D_COST, dtype=dtype).expand(1, COST_HEADS, n, D_COST)
        costs = qkv.explain(q, q, q).costs  # (B, H, T, D) views: nothing is allocated
        for name in peaks:
            peaks[name].append(costs[name].peak_bytes)
    return peaks


def memory_stop(ctx: Context, s: Section) -> None:
    """The O(T·S) table, each backend's predicted peak, and flash = math on live tensors."""
    t = ctx.basics
    name = str(ctx.dtype).removeprefix("torch.")
    size = t.element_size
    s.text(f"The scores are a (T, S) matrix per head: T·S·{size} bytes in {name}, quadratic "
           "in the sequence length (per head, per layer).")  # fmt: skip
    s.grid(f"T·S·{size} bytes ({name} is {size} bytes)",
           ("T = S", "per head, per batch element", f"B=1, H={COST_HEADS}"),
           [(f"{r.T:,}", human_bytes(r.per_head_bytes), human_bytes(r.all_heads_bytes))
            for r in t.cost])  # fmt: skip
    s.holds("every row is T·S·bytes", all(r.per_head_bytes == r.T * r.S * size
                                            and r.all_heads_bytes == COST_HEADS * r.per_head_bytes
                                            for r in t.cost))  # fmt: skip
    peaks = _peaks(ctx.dtype)
    s.grid(f"predicted peak extra memory of one call (B=1, H={COST_HEADS}, D={D_COST}, {name})",
           ("T = S", "scores (B=1, H=8)", "math", "flash", "torch"),
           [(f"{n:,}", human_bytes(COST_HEADS * n * n * size),
             *(human_bytes(peaks[b][i]) for b in ("math", "flash", "torch")))
            for i, n in enumerate(COST_LENGTHS)])  # fmt: skip
    s.lines("predicted peak memory against sequence length (log-log)", COST_LENGTHS,
            [("scores T·S·H·bytes", [COST_HEADS * n * n * size for n in COST_LENGTHS]),
             *((f"{b} backend", peaks[b]) for b in ("math", "flash", "torch"))],
            "T = S", "bytes")  # fmt: skip
    s.holds("the math backend holds at least every score",
            all(p >= COST_HEADS * n * n * size for p, n in zip(peaks["math"], COST_LENGTHS,
                                                                 strict=True)))  # fmt: skip
    grow = COST_LENGTHS[-1] / COST_LENGTHS[0]
    s.at_most(f"flash grows linearly: peak ratio from T={COST_LENGTHS[0]} to "
              f"T={COST_LENGTHS[-1]} (lengths x{grow:g}, scores x{grow**2:g})",
              peaks["flash"][-1] / peaks["flash"][0], 2 * grow)  # fmt: skip
    s.text(
        "The math backend materialises these scores; a fused kernel works block by block "
        "and never holds them all. qkv.explain says which backend a call gets "
        f"(B=1, H={COST_HEADS}, T=S=64, D=64):"
    )
    s.pre(t.explain_fast)
    s.text("and when the weights themselves are asked for (need_weights=True):")
    s.pre(t.explain_weights)
    gen = ctx.generator(80)
    q, k, v = (ctx.randn(1, 2, 128, 16, gen=gen) for _ in range(3))  # (B, H, T, D)
    math_out, math_w = qkv.scaled_dot_product_attention(q, k, v, backend="math",
                                                         need_weights=True)  # fmt: skip
    flash_out, flash_w = qkv.scaled_dot_product_attention(q, k, v, backend="flash",
                                                           need_weights=True)  # fmt: skip
    s.text("Flash attention does not change the math: on live tensors (B=1, H=2, T=S=128, "
           f"D=16, {str(ctx.work_dtype).removeprefix('torch.')}) its output and the "
           "weights it rebuilds from its log-sum-exp equal the math backend's.")  # fmt: skip
    s.close("flash output = math output", flash_out, math_out, ctx.tol)
    s.close("flash weights = math weights", flash_w, math_w, ctx.tol)
