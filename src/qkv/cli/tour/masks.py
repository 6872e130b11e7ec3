"""Tour stop on masks: causal (a decoder may not look ahead), padding (pad tokens are not
keys) and cross-attention (queries from one sequence, keys from another: ``T != S``).

Masks follow SDPA polarity: True = may attend. A hidden key's score becomes ``-inf``, so its
weight after the softmax is exactly zero and the visible keys share the whole row.
"""

from __future__ import annotations

import torch

import qkv
from qkv.cli.tour.basics import T_TOUR
from qkv.cli.tour.page import Context, Section, shape_text

__all__ = ["masks_stop"]


def _causal(ctx: Context, s: Section) -> None:
    t = ctx.basics
    s.text(
        f"1) causal: token i sees tokens 0..i (qkv.masks.causal({T_TOUR})), so a decoder "
        "trained on a whole sentence at once cannot peek at the word it must predict."
    )
    s.matrix(f"causal({T_TOUR}): 1 = may attend", t.causal_mask.int(), fmt="d")
    s.matrix("causal weights (T, T)", t.causal_weights)
    upper = t.causal_upper_max
    s.holds(f"upper triangle: max |weight| = {upper:g}"
            + (" (exactly zero)" if upper == 0.0 else " (NOT zero)"), upper == 0.0)  # fmt: skip
    err = float((t.causal_weights.double().sum(-1) - 1).abs().max())
    s.at_most("causal rows still sum to one: max |row sum - 1|", err,
              8 * torch.finfo(ctx.dtype).eps)  # fmt: skip


def _padding(ctx: Context, s: Section, gen: torch.Generator) -> torch.Tensor:
    """Two sequences padded to 6 tokens, 6 and 4 of them real; returns the weights."""
    lengths, S, D = (6, 4), 6, 8
    q, k, v = (ctx.randn(2, 1, S, D, gen=gen) for _ in range(3))  # (B, H, S, D)
    keep = qkv.masks.padding(list(lengths), S)  # (B, 1, 1, S)
    out, weights = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, need_weights=True)
    n = lengths[1]
    alone = qkv.scaled_dot_product_attention(q[1:, :, :n], k[1:, :, :n], v[1:, :, :n])
    s.text(f"2) padding: a batch of sequences of lengths {list(lengths)} padded to S={S}; "
           f"qkv.masks.padding gives a keep mask {shape_text(keep.shape)} that hides the pad "
           "keys of each sequence.")  # fmt: skip
    s.matrix("weights of the short sequence (pad keys k4, k5 hidden)", weights[1, 0])
    s.holds("pad keys get weight exactly 0", bool((weights[1, 0, :, n:] == 0).all()),
            f"(max {float(weights[1, 0, :, n:].abs().max()):g})")  # fmt: skip
    s.close("real tokens' outputs = the short sequence run alone, unpadded",
            out[1, 0, :n], alone[0, 0], ctx.tol)  # fmt: skip
    return weights[1, 0]


def _cross(ctx: Context, s: Section, gen: torch.Generator) -> torch.Tensor:
    """Decoder queries (T=3) over encoder keys (S=7); returns one head's weights."""
    t = ctx.basics
    s.text(
        "3) self- vs cross-attention: the math is the same, only the inputs differ. In "
        "cross-attention the queries come from the decoder (T of them) and the keys and "
        "values from the encoder (S of them), so the weights are (T, S), not square."
    )
    headers = ("kind", "query", "key/value", "weights", "output")
    s.grid(
        "self- vs cross-attention shapes",
        headers,
        [(kind, *(shape_text(x) for x in rest)) for kind, *rest in t.flows],
    )
    s.text("(B, H, T, D) x (B, H, S, D) -> weights (B, H, T, S) -> out (B, H, T, D)")
    T, S, D = 3, 7, 8
    dec = ctx.randn(1, 2, T, D, gen=gen)  # (B, H, T, D)
    enc_k, enc_v = ctx.randn(1, 2, S, D, gen=gen), ctx.randn(1, 2, S, D, gen=gen)  # (B, H, S, D)
    _, weights = qkv.scaled_dot_product_attention(dec, enc_k, enc_v, need_weights=True)
    s.holds(f"cross weights are (B, H, T, S) with T={T} != S={S}",
            tuple(weights.shape) == (1, 2, T, S), f"({shape_text(weights.shape)})")  # fmt: skip
    s.at_most("each decoder query's weights over the encoder sum to one: max |row sum - 1|",
              float((weights.double().sum(-1) - 1).abs().max()), ctx.tol)  # fmt: skip
    formula = torch.softmax(dec @ enc_k.transpose(-2, -1) / D**0.5, dim=-1)  # (B, H, T, S)
    s.close("cross weights = softmax(q_dec·k_encᵀ/√D)", weights, formula, ctx.tol)
    return weights[0, 0]


def masks_stop(ctx: Context, s: Section) -> None:
    """Causal, padding and cross-attention masks on live tensors."""
    gen = ctx.generator(20)
    _causal(ctx, s)
    padded = _padding(ctx, s, gen)
    cross = _cross(ctx, s, gen)
    t = ctx.basics
    s.heatmaps("the three patterns: causal, padded (keys 4, 5 hidden), cross (T=3, S=7)", [
        ("causal weights (5, 5)", t.causal_weights), ("padding weights (6, 6)", padded),
        ("cross weights (3, 7)", cross),
    ])  # fmt: skip
