"""Trusted references for the model tests: torch's own modules with qkv's weights copied in,
and plain PyTorch GPT-2 and Llama written out here (no qkv code), nanoGPT style.

Copies go from a qkv model into the reference, so the qkv model's own initialisation (after
:func:`perturb_`) is what both compute with.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def perturb_(model: nn.Module, scale: float = 0.05, seed: int = 0) -> nn.Module:
    """Add noise to every parameter, so norms are not all-ones and biases not all-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def attention_to_mha(ours, mha: nn.MultiheadAttention) -> None:
    """qkv Attention (q/k/v/out_proj) -> torch MultiheadAttention (packed in_proj)."""
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight,
                                            ours.v_proj.weight]))
        mha.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        mha.out_proj.weight.copy_(ours.out_proj.weight)
        mha.out_proj.bias.copy_(ours.out_proj.bias)


def _copy(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        if getattr(dst, "bias", None) is not None:
            dst.bias.copy_(src.bias)


def block_to_torch_layer(block, layer) -> None:
    """TransformerBlock -> torch Transformer{Encoder,Decoder}Layer.

    Mapping: self_attn -> self_attn, cross_attn -> multihead_attn, ffn.linear1/2 ->
    linear1/2, attn_norm -> norm1, then cross_norm -> norm2 and ffn_norm -> norm3 (decoder)
    or ffn_norm -> norm2 (encoder).
    """
    attention_to_mha(block.self_attn, layer.self_attn)
    _copy(layer.linear1, block.ffn.linear1)
    _copy(layer.linear2, block.ffn.linear2)
    _copy(layer.norm1, block.attn_norm)
    if block.cross_attn is not None:
        attention_to_mha(block.cross_attn, layer.multihead_attn)
        _copy(layer.norm2, block.cross_norm)
        _copy(layer.norm3, block.ffn_norm)
    else:
        _copy(layer.norm2, block.ffn_norm)


def paper_sinusoids(n: int, d: int, dtype) -> torch.Tensor:
    """PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...), element by element."""
    pe = [[0.0] * d for _ in range(n)]
    for p in range(n):
        for i in range(0, d, 2):
            angle = p / 10000 ** (i / d)
            pe[p][i] = math.sin(angle)
            if i + 1 < d:
                pe[p][i + 1] = math.cos(angle)
    return torch.tensor(pe, dtype=dtype)


def torch_transformer_for(model) -> nn.Transformer:
    """``torch.nn.Transformer`` holding a (post-norm, relu) Seq2SeqTransformer's stacks.

    torch's Transformer ends each stack with a LayerNorm that the paper (and qkv's post-norm
    model) does not have; it is removed (``norm = None``).
    """
    c = model.config
    dtype = model.lm_head.weight.dtype
    ref = nn.Transformer(
        c.d_model, c.num_heads, c.num_encoder_layers, c.num_decoder_layers, c.d_ff,
        dropout=0.0, activation=c.activation, layer_norm_eps=c.norm_eps, batch_first=True,
        dtype=dtype,
    )
    ref.encoder.norm = None
    ref.decoder.norm = None
    for block, layer in zip(model.encoder_blocks, ref.encoder.layers, strict=True):
        block_to_torch_layer(block, layer)
    for block, layer in zip(model.decoder_blocks, ref.decoder.layers, strict=True):
        block_to_torch_layer(block, layer)
    return ref.train()  # dropout is 0; train mode keeps torch off its fused fast paths


def torch_seq2seq_logits(model, ref, src, tgt_in):
    """Embeddings·√E + paper sinusoids, torch's Transformer, then the model's lm_head."""
    c = model.config
    dtype = model.lm_head.weight.dtype
    S, T = src.shape[1], tgt_in.shape[1]
    pe = paper_sinusoids(max(S, T), c.d_model, dtype)
    src_x = model.src_embed.weight[src] * math.sqrt(c.d_model) + pe[:S]
    tgt_x = model.tgt_embed.weight[tgt_in] * math.sqrt(c.d_model) + pe[:T]
    pad = src == c.pad_id  # torch polarity: True = padding
    out = ref(
        src_x, tgt_x, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T, dtype=dtype),
        src_key_padding_mask=pad, memory_key_padding_mask=pad, tgt_is_causal=True,
    )
    return F.linear(out, model.lm_head.weight, model.lm_head.bias)


def torch_bert_hidden(model, input_ids, attention_mask, token_type_ids):
    """BERT embeddings by hand, then a stack of torch TransformerEncoderLayers (post-norm,
    exact GELU) with the Encoder's weights copied in."""
    c = model.config
    dtype = model.embed.weight.dtype
    S = input_ids.shape[1]
    emb = (model.embed.weight[input_ids] + model.pos.weight[:S]
           + model.token_type.weight[token_type_ids])
    emb = F.layer_norm(emb, (c.d_model,), model.embed_norm.weight, model.embed_norm.bias,
                       c.norm_eps)
    layer = nn.TransformerEncoderLayer(
        c.d_model, c.num_heads, c.ffn_dim, dropout=0.0, activation="gelu",
        layer_norm_eps=c.norm_eps, batch_first=True, dtype=dtype,
    )
    stack = nn.TransformerEncoder(layer, c.num_layers, enable_nested_tensor=False)
    for block, ref_layer in zip(model.blocks, stack.layers, strict=True):
        block_to_torch_layer(block, ref_layer)
    return stack.train()(emb, src_key_padding_mask=~attention_mask.bool())


# --- plain PyTorch decoder LMs ------------------------------------------------------------


def _causal_softmax_attention(q, k, v):
    """q (B, H, T, D), k/v (B, H, T, D): explicit scores, -inf above the diagonal, softmax."""
    T = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v  # (B, H, T, D)


def plain_gpt2_logits(model, ids):
    """GPT-2 forward written from the paper, reading the DecoderLM's weights by name."""
    c = model.config
    B, T = ids.shape
    H, D = c.num_heads, c.d_model // c.num_heads
    x = model.embed.weight[ids] + model.pos.weight[:T]  # (B, T, E)
    for blk in model.blocks:
        a = blk.self_attn
        h = F.layer_norm(x, (c.d_model,), blk.attn_norm.weight, blk.attn_norm.bias, c.norm_eps)
        c_attn_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # (3E, E)
        c_attn_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        q, k, v = (h @ c_attn_w.T + c_attn_b).split(c.d_model, dim=2)  # (B, T, E) each
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = _causal_softmax_attention(q, k, v).transpose(1, 2).reshape(B, T, c.d_model)
        x = x + y @ a.out_proj.weight.T + a.out_proj.bias
        h = F.layer_norm(x, (c.d_model,), blk.ffn_norm.weight, blk.ffn_norm.bias, c.norm_eps)
        f = blk.ffn
        h = F.gelu(h @ f.linear1.weight.T + f.linear1.bias, approximate="tanh")
        x = x + h @ f.linear2.weight.T + f.linear2.bias
    x = F.layer_norm(x, (c.d_model,), model.norm_f.weight, model.norm_f.bias, c.norm_eps)
    return x @ model.embed.weight.T  # tied head (B, T, V)


def plain_llama_logits(model, ids):
    """Llama forward written out: RMSNorm, rotate-half RoPE, GQA by repeating K/V, SwiGLU."""
    c = model.config
    B, T = ids.shape
    H, Hkv, D = c.num_heads, c.num_kv_heads or c.num_heads, c.head_dim
    dtype = model.embed.weight.dtype

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    inv_freq = c.rope_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq  # (T, D/2)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)  # (T, D)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)

    def rotate(x):  # (B, h, T, D)
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = model.embed.weight[ids]  # (B, T, E)
    for blk in model.blocks:
        a = blk.self_attn
        h = rms(x, blk.attn_norm.weight)
        q = (h @ a.q_proj.weight.T).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = (h @ a.k_proj.weight.T).view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = (h @ a.v_proj.weight.T).view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = rotate(q), rotate(k)
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # (B, H, T, D)
        y = _causal_softmax_attention(q, k, v).transpose(1, 2).reshape(B, T, H * D)
        x = x + y @ a.out_proj.weight.T
        h = rms(x, blk.ffn_norm.weight)
        f = blk.ffn
        x = x + (F.silu(h @ f.gate_proj.weight.T) * (h @ f.up_proj.weight.T)) @ f.down_proj.weight.T
    return rms(x, model.norm_f.weight) @ model.embed.weight.T  # (B, T, V)
