"""Tour stops on attention modules: one self-attention head and multi-head attention.

    SelfAttention:  Q = x·W_Qᵀ, K = x·W_Kᵀ, V = x·W_Vᵀ, out = softmax(Q·Kᵀ/√D)·V
    MultiHead(x) = Concat(head_1, ..., head_H)·W_Oᵀ,  head_h = Attention(Q_h, K_h, V_h)

Each stop takes qkv's module with its random initial weights, redoes its forward by hand
from those weights (projections, split, per-head attention, concat) and checks both agree;
multi-head attention is also checked against ``torch.nn.MultiheadAttention`` loaded with the
same ``state_dict`` (qkv's is a drop-in).
"""

from __future__ import annotations

import math

import torch

import qkv
from qkv.cli.tour.page import Context, Section, shape_text

__all__ = ["multihead_stop", "self_attention_stop"]

B, T, E, H = 2, 6, 16, 4  # two sequences of six tokens of width 16; four heads of width 4


def _softmax_attention(q, k, v):
    """The formula on ``(..., T, D)`` tensors: ``(out (..., T, Dv), weights (..., T, S))``."""
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights  # (..., T, Dv), (..., T, S)


def self_attention_stop(ctx: Context, s: Section) -> None:
    """A single-head self-attention module: three projections, then the attention function."""
    ctx.seeded(10)
    gen = ctx.generator(10)
    attn = qkv.nn.SelfAttention(E).to(ctx.work_dtype).eval()
    x = ctx.randn(B, T, E, gen=gen)  # (B, T, E)
    with torch.no_grad():
        out, weights = attn(x)  # (B, T, E), (B, T, T)
        q = x @ attn.q_proj.weight.T  # (B, T, E)
        k = x @ attn.k_proj.weight.T  # (B, T, E)
        v = x @ attn.v_proj.weight.T  # (B, T, E)
        manual_out, manual_weights = _softmax_attention(q, k, v)
    s.text(
        "qkv.nn.SelfAttention owns three learned projections, q_proj, k_proj and v_proj "
        "(nn.Linear(E, E), no bias); its forward projects the input and calls the attention "
        f"function. Here B={B} sequences of T={T} tokens of width E={E}."
    )
    s.grid("the module's tensors", ("tensor", "shape"), [
        ("x", shape_text(x.shape)),
        *((f"{n}.weight", shape_text(getattr(attn, n).weight.shape))
          for n in ("q_proj", "k_proj", "v_proj")),
        ("Q = x·W_Qᵀ, K, V", shape_text(q.shape)),
        ("weights", shape_text(weights.shape)),
        ("out", shape_text(out.shape)),
    ])  # fmt: skip
    s.heatmaps("self-attention weights of each sequence (T, T)",
               [(f"sequence {b}", weights[b]) for b in range(B)])  # fmt: skip
    s.at_most("every row sums to one: max |row sum - 1|",
              float((weights.double().sum(-1) - 1).abs().max()), ctx.tol)  # fmt: skip
    s.close("weights = softmax(Q·Kᵀ/√D) from the module's own projections", weights,
            manual_weights, ctx.tol)  # fmt: skip
    s.close("output = weights·V", out, manual_out, ctx.tol)
    s.holds("the output has the input's shape (B, T, E)", out.shape == x.shape,
            f"({shape_text(out.shape)})")  # fmt: skip


def multihead_stop(ctx: Context, s: Section) -> None:
    """Multi-head attention by hand (packed in_proj, split, per head, concat) = qkv = torch."""
    ctx.seeded(11)
    gen = ctx.generator(11)
    D = E // H
    mha = qkv.nn.MultiheadAttention(E, H, batch_first=True, dtype=ctx.work_dtype).eval()
    x = ctx.randn(B, T, E, gen=gen)  # (B, T, E)
    with torch.no_grad():
        out, weights = mha(x, x, x, average_attn_weights=False)  # (B, T, E), (B, H, T, T)
        # 1) One packed matmul for Q, K and V, then chunk: torch's in_proj.
        packed = x @ mha.in_proj_weight.T + mha.in_proj_bias  # (B, T, 3E)
        q, k, v = packed.chunk(3, dim=-1)  # (B, T, E) each
        w_q = mha.in_proj_weight[:E]  # (E, E): the first third is W_Q
        separate = x @ w_q.T + mha.in_proj_bias[:E]  # (B, T, E)
        # 2) Split: head h owns columns h·D .. (h+1)·D - 1.
        qh, kh, vh = (t.reshape(B, T, H, D).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        # 3) Each head attends on its own (qkv's function, one head at a time).
        heads = [qkv.scaled_dot_product_attention(qh[:, h], kh[:, h], vh[:, h], need_weights=True)
                 for h in range(H)]  # fmt: skip
        head_weights = torch.stack([w for _, w in heads], dim=1)  # (B, H, T, T)
        # 4) Concat the heads and mix them with W_O.
        concat = torch.cat([o for o, _ in heads], dim=-1)  # (B, T, H·D)
        manual = mha.out_proj(concat)  # (B, T, E)
        # 5) torch's module with the same state_dict.
        ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=ctx.work_dtype).eval()
        missing = ref.load_state_dict(mha.state_dict(), strict=True)
        ref_out, ref_weights = ref(x, x, x, average_attn_weights=False)  # (B, T, E), (B, H, T, T)
        _, ref_mean = ref(x, x, x)  # (B, T, T): torch averages the heads by default
        _, mean = mha(x, x, x)  # (B, T, T)
    s.text(
        f"qkv.nn.MultiheadAttention(embed_dim={E}, num_heads={H}, batch_first=True): H={H} "
        f"heads of width D = E/H = {D}. Q, K and V come from one packed in_proj_weight "
        f"(3E, E) = {shape_text(mha.in_proj_weight.shape)}; the result is split into heads, "
        "each head attends on its own, the heads are concatenated and out_proj mixes them."
    )
    s.grid("multi-head attention step by step", ("step", "shape"), [
        ("x", shape_text(x.shape)),
        ("packed = x·in_proj_weightᵀ + in_proj_bias", shape_text(packed.shape)),
        ("q, k, v = packed.chunk(3)", shape_text(q.shape)),
        ("split heads: (B, T, E) -> (B, H, T, D)", shape_text(qh.shape)),
        ("per-head weights", shape_text(head_weights.shape)),
        ("concat heads", shape_text(concat.shape)),
        ("out = out_proj(concat)", shape_text(manual.shape)),
    ])  # fmt: skip
    s.heatmaps("each head's weights for sequence 0: every head looks elsewhere",
               [(f"head {h}", head_weights[0, h]) for h in range(H)])  # fmt: skip
    s.close("packed chunk 0 = x·W_Qᵀ + b_Q (three matmuls in one)", q, separate, ctx.tol)
    s.close("per-head weights (by hand) = the module's", head_weights, weights, ctx.tol)
    s.close("concat + out_proj (by hand) = the module's output", manual, out, ctx.tol)
    s.holds("torch.nn.MultiheadAttention loads qkv's state_dict unchanged (same keys)",
            not missing.missing_keys and not missing.unexpected_keys)  # fmt: skip
    s.close("output = torch.nn.MultiheadAttention's", out, ref_out, ctx.tol)
    s.close("per-head weights = torch's", weights, ref_weights, ctx.tol)
    s.close("head-averaged weights = torch's", mean, ref_mean, ctx.tol)
