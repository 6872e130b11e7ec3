"""Tour stops on the transformer block, and one token's journey through it.

    post-norm block:  h = LayerNorm(x + MultiHead(x)),  y = LayerNorm(h + FFN(h))
    FFN(h) = ReLU(h·W_1ᵀ + b_1)·W_2ᵀ + b_2

The block stop redoes :class:`qkv.nn.TransformerBlock`'s forward from its own weights and
checks it against ``torch.nn.TransformerEncoderLayer`` loaded with the same weights. The
journey follows "sat" in "The cat sat on the mat" through every step of that block by hand,
and checks the result is the block's own output row and the weights are what
:func:`qkv.inspect.capture` records.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import qkv
from qkv.cli.tour.page import Context, Section, shape_text

__all__ = ["block_stop", "journey_stop"]

B, T, E, H, FF = 2, 6, 16, 4, 64  # batch, tokens, width, heads, feed-forward width


def _block(ctx: Context, stream: int):
    ctx.seeded(stream)
    block = qkv.nn.TransformerBlock(E, H, FF, norm="post", activation="relu")
    return block.to(ctx.work_dtype).eval()


def _layer_norm(z: Tensor, norm) -> Tensor:
    """LayerNorm by its formula: ``(z - mean) / sqrt(var + eps) · γ + β`` per token."""
    mean = z.mean(-1, keepdim=True)  # (..., 1)
    var = z.var(-1, unbiased=False, keepdim=True)  # (..., 1)
    return (z - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def _torch_layer(block, dtype: torch.dtype) -> torch.nn.TransformerEncoderLayer:
    """``torch.nn.TransformerEncoderLayer`` with ``block``'s weights (packed in_proj)."""
    ref = torch.nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, dtype=dtype)
    a = block.self_attn
    with torch.no_grad():
        ref.self_attn.in_proj_weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight,
                                                      a.v_proj.weight]))  # (3E, E)  # fmt: skip
        ref.self_attn.in_proj_bias.copy_(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        ref.self_attn.out_proj.load_state_dict(a.out_proj.state_dict())
        ref.linear1.load_state_dict(block.ffn.linear1.state_dict())
        ref.linear2.load_state_dict(block.ffn.linear2.state_dict())
        ref.norm1.load_state_dict(block.attn_norm.state_dict())
        ref.norm2.load_state_dict(block.ffn_norm.state_dict())
    return ref.eval()


def block_stop(ctx: Context, s: Section) -> None:
    """A post-norm block by hand = qkv's block = torch's encoder layer."""
    block = _block(ctx, 40)
    x = ctx.randn(B, T, E, gen=ctx.generator(40))  # (B, T, E)
    with torch.no_grad():
        y = block(x)  # (B, T, E)
        attn, _ = block.self_attn(x)  # (B, T, E)
        h = _layer_norm(x + attn, block.attn_norm)  # (B, T, E): residual, then norm
        f1 = block.ffn.linear1
        hidden = torch.relu(h @ f1.weight.T + f1.bias)  # (B, T, FF)
        ffn = hidden @ block.ffn.linear2.weight.T + block.ffn.linear2.bias  # (B, T, E)
        manual = _layer_norm(h + ffn, block.ffn_norm)  # (B, T, E)
        ref = _torch_layer(block, ctx.work_dtype)(x)  # (B, T, E)
    s.text(
        f"qkv.nn.TransformerBlock({E}, {H}, d_ff={FF}, norm='post', activation='relu'): "
        "attention gathers information from the other tokens, the feed-forward network "
        "processes each token on its own, and each sublayer sits in a residual branch "
        "(x + f(x), a direct path for gradients) followed by LayerNorm."
    )
    s.grid("through the block", ("step", "shape"), [
        ("x", shape_text(x.shape)),
        ("a = MultiHead(x)", shape_text(attn.shape)),
        ("h = LayerNorm(x + a)", shape_text(h.shape)),
        ("ReLU(h·W_1ᵀ + b_1)", shape_text(hidden.shape)),
        ("FFN(h) = ... ·W_2ᵀ + b_2", shape_text(ffn.shape)),
        ("y = LayerNorm(h + FFN(h))", shape_text(y.shape)),
    ])  # fmt: skip
    s.heatmaps(
        "the residual stream of sequence 0 (token x width)",
        [("x", x[0]), ("h = LN(x + attention)", h[0]), ("y = LN(h + FFN)", y[0])],
    )
    s.close("block output = LayerNorm(h + FFN(h)) written out", y, manual, ctx.tol)
    s.at_most("after LayerNorm (initial γ=1, β=0) every token has mean 0: max |mean|",
              float(h.mean(-1).abs().max()), ctx.tol)  # fmt: skip
    s.close("block output = torch.nn.TransformerEncoderLayer with the same weights", y, ref,
            ctx.tol)  # fmt: skip
    s.holds("the block preserves the shape (B, T, E), so blocks stack", y.shape == x.shape)


WORDS = ("The", "cat", "sat", "on", "the", "mat")
FOLLOW = 2  # "sat"


def _preview(v: Tensor) -> str:
    return "[" + ", ".join(f"{float(a):+.2f}" for a in v[:4]) + ", ...]"


def journey_stop(ctx: Context, s: Section) -> None:
    """Follow "sat" through embedding, positions, each head, concat, residuals and norms."""
    vocab = {w: i for i, w in enumerate(sorted(set(WORDS)))}
    ids = torch.tensor([[vocab[w] for w in WORDS]])  # (1, T)
    ctx.seeded(41)
    embed = torch.nn.Embedding(len(vocab), E).to(ctx.work_dtype)
    block = _block(ctx, 42)
    a, D = block.self_attn, E // H
    with torch.no_grad():
        e = embed(ids)  # (1, T, E)
        x = e + qkv.nn.sinusoidal_table(T, E, dtype=ctx.work_dtype)  # (1, T, E)
        with qkv.inspect.capture(block, rows=FOLLOW) as cap:
            y = block(x)  # (1, T, E)
        xs = x[0, FOLLOW]  # (E,)
        q = a.q_proj(xs).view(H, D)  # (H, D): the query of "sat" in each head
        k = a.k_proj(x[0]).view(T, H, D).transpose(0, 1)  # (H, T, D): keys of every token
        v = a.v_proj(x[0]).view(T, H, D).transpose(0, 1)  # (H, T, D)
        scores = (k @ q[:, :, None])[..., 0] / math.sqrt(D)  # (H, T)
        weights = torch.softmax(scores, dim=-1)  # (H, T)
        heads = (weights[:, None, :] @ v)[:, 0]  # (H, D)
        concat = heads.reshape(E)  # (E,)  [head_1 | head_2 | ... | head_H]
        out = a.out_proj(concat)  # (E,)
        h = _layer_norm(xs + out, block.attn_norm)  # (E,)
        ffn = block.ffn(h)  # (E,)
        final = _layer_norm(h + ffn, block.ffn_norm)  # (E,)
    s.text(
        f"'{WORDS[FOLLOW]}' (position {FOLLOW}) in \"{' '.join(WORDS)}\" through one post-norm "
        f"layer (E={E}, H={H} heads of width D={D}), every step by hand from the layer's "
        "weights. It leaves as the same word, enriched with what the other words carry."
    )
    s.grid(f"the journey of '{WORDS[FOLLOW]}'", ("step", "vector (first 4)", "norm"), [
        (name, _preview(vec), f"{float(vec.norm()):.3f}") for name, vec in (
            ("1. embedding lookup", e[0, FOLLOW]), (f"2. + PE(pos={FOLLOW})", xs),
            ("3. per head: q = x·W_Q,h (4 heads, concatenated)", q.reshape(E)),
            ("4. head_h = softmax(q·kᵀ/√D)·v, concatenated", concat),
            ("5. output projection concat·W_Oᵀ", out), ("6. h = LayerNorm(x + attention)", h),
            ("7. FFN(h) = ReLU(h·W_1ᵀ + b_1)·W_2ᵀ + b_2", ffn),
            ("8. y = LayerNorm(h + FFN(h))", final),
        )
    ])  # fmt: skip
    s.matrix(f"how much '{WORDS[FOLLOW]}' attends to each word, per head", weights,
             rows=tuple(f"head {i}" for i in range(H)), cols=WORDS)  # fmt: skip
    s.heatmaps(f"'{WORDS[FOLLOW]}' over the sentence, one row per head",
               [("weights (H, T)", weights)], rows=tuple(f"head {i}" for i in range(H)),
               cols=WORDS)  # fmt: skip
    s.close("by-hand weights = what qkv.inspect.capture records for this row", weights,
            cap[0][0, :, 0], ctx.tol)  # fmt: skip
    s.close(f"by-hand final vector = the layer's output for '{WORDS[FOLLOW]}'", final,
            y[0, FOLLOW], ctx.tol)  # fmt: skip
