"""Tour stops on whole models and other attention: the encoder-decoder's cross-attention,
Bahdanau's additive attention, and ViT's patches.

    cross-attention:  Q from the decoder stream, K and V from the encoder's memory
    Bahdanau:         e[t, i] = vᵀ tanh(W_q s_t + b + W_k h_i),  α = softmax(e),  c = Σ α h
    ViT:              image (C, H, W) -> N = (H/P)·(W/P) patches of C·P·P pixels -> tokens
"""

from __future__ import annotations

import math

import torch

import qkv
from qkv.cli.tour.page import Context, Section, shape_text

__all__ = ["additive_stop", "encoder_decoder_stop", "vit_stop"]


def encoder_decoder_stop(ctx: Context, s: Section) -> None:
    """A tiny Seq2SeqTransformer: cross-attention weights (T, S) rebuilt by hand; causality."""
    from qkv.models import Seq2SeqConfig, Seq2SeqTransformer

    cfg = Seq2SeqConfig(src_vocab_size=12, tgt_vocab_size=10, d_model=16, num_heads=2,
                        num_encoder_layers=1, num_decoder_layers=1, d_ff=32, dropout=0.0,
                        pad_id=None)  # fmt: skip
    ctx.seeded(50)
    model = Seq2SeqTransformer(cfg).to(ctx.work_dtype).eval()
    src = torch.tensor([[3, 7, 4, 9, 5, 11, 6]])  # (1, S)
    tgt = torch.tensor([[1, 4, 8, 5]])  # (1, T): BOS first (shifted right)
    (_, S), (_, T), H = src.shape, tgt.shape, cfg.num_heads
    D = cfg.d_model // H
    mid = "decoder_blocks.0.hook_resid_mid"  # the decoder stream entering cross-attention
    with torch.no_grad(), qkv.inspect.capture(model, record=mid) as cap:
        memory = model.encode(src)  # (1, S, E)
        logits = model.decode(tgt, memory)  # (1, T, V)
    kinds = dict(cap.kinds)
    cross_name = next(name for name, kind in kinds.items() if kind == "cross")
    cross = cap[cross_name]  # (1, H, T, S)
    block = model.decoder_blocks[0]
    with torch.no_grad():
        h = cap.values[mid][0]  # (1, T, E)
        q = block.cross_attn.q_proj(h).view(1, T, H, D).transpose(1, 2)  # (1, H, T, D)
        k = block.cross_attn.k_proj(memory).view(1, S, H, D).transpose(1, 2)  # (1, H, S, D)
        manual = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1)  # (1, H, T, S)
        changed = tgt.clone()
        changed[0, -1] = 9  # another last target token
        logits2 = model.decode(changed, memory)  # (1, T, V)
    s.text(
        "The encoder reads the source with bidirectional self-attention into a memory; the "
        "decoder runs masked (causal) self-attention over the target so far, then "
        "cross-attention: its queries come from the decoder stream, its keys and values from "
        f"the encoder's memory. Here a 1+1-layer Seq2SeqTransformer (E={cfg.d_model}, H={H})."
    )
    s.grid("shapes", ("tensor", "shape"), [
        ("source ids", shape_text(src.shape)),
        ("memory = encode(source)", shape_text(memory.shape)),
        ("target ids (BOS first)", shape_text(tgt.shape)),
        ("cross-attention weights (B, H, T, S)", shape_text(cross.shape)),
        ("logits (B, T, V)", shape_text(logits.shape)),
    ])  # fmt: skip
    s.grid("the attention layers, as qkv.inspect.capture labels them", ("layer", "kind"),
           list(kinds.items()))  # fmt: skip
    s.heatmaps(
        "cross-attention: each target position (row) over the source (column)",
        [(f"head {i}", cross[0, i]) for i in range(H)],
        rows=tuple(f"t{i}" for i in range(T)),
        cols=tuple(f"s{j}" for j in range(S)),
    )
    s.holds("encoder self-attention is bidirectional, decoder self-attention causal, and the "
            "third is cross", sorted(kinds.values()) == ["causal self", "cross", "self"],
            f"({', '.join(kinds.values())})")  # fmt: skip
    s.at_most("cross weights: each target row sums to one over the source: max |row sum - 1|",
              float((cross.double().sum(-1) - 1).abs().max()), ctx.tol)  # fmt: skip
    s.close("cross weights = softmax(q_dec·k_memᵀ/√D) from the decoder stream and the memory",
            cross, manual, ctx.tol)  # fmt: skip
    s.close("changing the last target token leaves earlier positions' logits unchanged",
            logits2[:, :-1], logits[:, :-1], 0.0)  # fmt: skip


def additive_stop(ctx: Context, s: Section) -> None:
    """Bahdanau attention (qkv.nn.BahdanauAttention) = its formula = qkv.reference (NumPy)."""
    Dq, Dk, A, S, B = 6, 8, 10, 5, 2
    ctx.seeded(60)
    att = qkv.nn.BahdanauAttention(Dq, Dk, A).double()
    gen = ctx.generator(60)
    state = torch.randn(B, Dq, generator=gen, dtype=torch.float64)  # (B, Dq): s_{t-1}
    enc = torch.randn(B, S, Dk, generator=gen, dtype=torch.float64)  # (B, S, Dk): h_i
    with torch.no_grad():
        context, weights = att(state, enc)  # (B, Dk), (B, S)
        e = torch.tanh(att.w_query(state)[:, None, :] + att.w_key(enc)) @ att.v  # (B, S)
        alpha = torch.softmax(e, dim=-1)  # (B, S)
        c = (alpha[:, :, None] * enc).sum(1)  # (B, Dk)
    ref_c, ref_w = qkv.reference.additive_attention(
        state[:, None].numpy(),
        enc.numpy(),
        enc.numpy(),
        att.w_query.weight.detach().T.numpy(),
        att.w_key.weight.detach().T.numpy(),
        att.v.detach().numpy(),
        att.w_query.bias.detach().numpy(),
    )  # (B, 1, Dk), (B, 1, S)
    s.text(
        "Before the transformer, Bahdanau et al. (2014) let an RNN decoder look back at every "
        "encoder state: a small feed-forward network scores how well the previous decoder "
        "state s matches each encoder state h_i (alignment), a softmax turns the scores into "
        "weights, and the context vector is the weighted average of the encoder states. "
        f"Here B={B} decoder states (Dq={Dq}) over S={S} encoder states (Dk={Dk}), A={A}."
    )
    s.matrix("alignment weights α (B, S)", weights, rows=("state 0", "state 1"),
             cols=tuple(f"h{i}" for i in range(S)))  # fmt: skip
    s.heatmaps(
        "where each decoder state looks",
        [("α (B, S)", weights)],
        rows=("state 0", "state 1"),
        cols=tuple(f"h{i}" for i in range(S)),
    )
    s.at_most("weights sum to one over the encoder states: max |row sum - 1|",
              float((weights.sum(-1) - 1).abs().max()), 1e-12)  # fmt: skip
    s.close("weights = softmax(vᵀ tanh(W_q s + b + W_k h_i)) written out", weights, alpha,
            1e-12)  # fmt: skip
    s.close("context = Σ_i α_i h_i", context, c, 1e-12)
    s.close("weights = qkv.reference.additive_attention (NumPy)", weights,
            torch.from_numpy(ref_w)[:, 0], 1e-12)  # fmt: skip
    s.close("context = qkv.reference's", context, torch.from_numpy(ref_c)[:, 0], 1e-12)


def _picture(size: int) -> torch.Tensor:
    """A recognisable ``(1, 3, size, size)`` image: red rises down, green rises right, and a
    blue diagonal."""
    r = torch.linspace(0, 1, size)[:, None].expand(size, size)
    g = torch.linspace(0, 1, size)[None, :].expand(size, size)
    b = torch.eye(size).flip(1) * 0.8 + 0.1
    return torch.stack([r, g, b])[None]  # (1, 3, size, size)


def vit_stop(ctx: Context, s: Section) -> None:
    """ViT's patchify and patch embedding (a strided conv = a linear map of each patch)."""
    from qkv.models import ViT, ViTConfig

    cfg = ViTConfig(image_size=8, patch_size=4, channels=3, num_classes=3, d_model=16,
                    num_layers=1, num_heads=2, d_ff=32)  # fmt: skip
    ctx.seeded(70)
    vit = ViT(cfg).to(ctx.work_dtype).eval()
    img = _picture(cfg.image_size).to(ctx.work_dtype)  # (1, C, H, W)
    P, E = cfg.patch_size, cfg.d_model
    with torch.no_grad(), qkv.inspect.capture(vit) as cap:
        patches = vit.patchify(img)  # (1, N, C·P·P)
        tokens = vit.embed_patches(img)  # (1, N, E)
        logits = vit(img)  # (1, classes)
        w = vit.patch_embed.weight.reshape(E, -1)  # (E, C·P·P)
        manual = patches @ w.T + vit.patch_embed.bias  # (1, N, E)
    weights = cap[0]  # (1, H, N + 1, N + 1)
    N = cfg.num_patches
    s.text(
        f"A ViT cuts an image of {cfg.image_size}x{cfg.image_size} pixels "
        f"({cfg.channels} channels) into "
        f"N = ({cfg.image_size}/{P})² = {N} patches of {P}x{P} pixels, flattens each to "
        f"C·P·P = {patches.shape[-1]} numbers and projects it to width E={E}; with a class "
        f"token in front, the transformer sees N + 1 = {N + 1} tokens and every patch can "
        "attend to every other one, however far apart."
    )
    s.image(f"the image and its {N} patches (grid every {P} pixels)",
            img[0].permute(1, 2, 0), P)  # fmt: skip
    s.grid("shapes", ("tensor", "shape"), [
        ("image (B, C, H, W)", shape_text(img.shape)),
        ("patchify: (B, N, C·P·P)", shape_text(patches.shape)),
        ("embed_patches: (B, N, E)", shape_text(tokens.shape)),
        ("attention weights, class token + patches", shape_text(weights.shape)),
        ("logits", shape_text(logits.shape)),
    ])  # fmt: skip
    s.heatmaps(
        "block 0's attention among [class, patch 0..3]",
        [(f"head {i}", weights[0, i]) for i in range(cfg.num_heads)],
        rows=("cls", *(f"p{j}" for j in range(N))),
        cols=("cls", *(f"p{j}" for j in range(N))),
    )
    s.holds(f"patch 1 is the top-right {P}x{P} crop, flattened as (C, P, P)",
            torch.equal(patches[0, 1], img[0, :, :P, P:2 * P].reshape(-1)))  # fmt: skip
    s.close("the strided Conv2d = patch·W_patchᵀ + b (a linear map of each flattened patch)",
            tokens, manual, ctx.tol)  # fmt: skip
    s.holds(
        f"N + 1 = {N + 1} tokens attend to each other",
        tuple(weights.shape[-2:]) == (N + 1, N + 1),
        f"({shape_text(weights.shape)})",
    )
    s.at_most("attention rows sum to one: max |row sum - 1|",
              float((weights.double().sum(-1) - 1).abs().max()), ctx.tol)  # fmt: skip
