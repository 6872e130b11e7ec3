"""Whole-model parity with trusted references, forward and backward.

* Seq2SeqTransformer == torch.nn.Transformer (post-norm, ReLU, final norms removed) with the
  same weights, wrapped in the same embeddings, paper sinusoids and output projection.
* Encoder == hand-written BERT embeddings + a torch.nn.TransformerEncoderLayer stack.
* DecoderLM (GPT-2 style) == a plain PyTorch GPT-2; DecoderLM (Llama style) == a plain
  PyTorch Llama (RMSNorm, rotate-half RoPE, GQA, SwiGLU).
"""

from __future__ import annotations

import pytest
import torch
from model_refs import (
    perturb_,
    plain_gpt2_logits,
    plain_llama_logits,
    torch_bert_hidden,
    torch_seq2seq_logits,
    torch_transformer_for,
)

from helpers import TOL, assert_close
from qkv.models import (
    DecoderLM,
    DecoderLMConfig,
    Encoder,
    EncoderConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
)

DTYPES = [torch.float64, torch.float32]
# Parameter gradients sum over every position and logit (a bias gradient of a head-facing
# layer adds B·T·V float32 products), so float32 allows 1e-4: accumulation order differs.
GRAD_TOL = {torch.float64: TOL[torch.float64], torch.float32: dict(atol=1e-4, rtol=1e-4)}


def _ids(shape, vocab, seed, low=0):
    return torch.randint(low, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _grads(model, out_fn, seed=99):
    """Gradients of a random projection of the output, for every named parameter."""
    model.zero_grad()
    out = out_fn()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * g).sum().backward()
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_seq2seq_equals_torch_transformer(dtype):
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(37, 41, d_model=32, num_heads=4, d_ff=48, dropout=0.0)
    model = perturb_(Seq2SeqTransformer(cfg).to(dtype)).train()
    ref = torch_transformer_for(model)
    src = _ids((3, 11), 37, 1, low=3)
    src[0, 7:] = cfg.pad_id  # padded source rows
    src[2, 9:] = cfg.pad_id
    tgt = _ids((3, 9), 41, 2, low=3)

    # The reference reads the model's embeddings and head, so run it first, then the model
    # (whose gradients _grads clears) and compare the stacks' gradients.
    expected = _grads(ref, lambda: torch_seq2seq_logits(model, ref, src, tgt))
    out = _grads(model, lambda: model(src, tgt))
    assert_close(out, expected, **TOL[dtype], name="seq2seq logits")
    enc, dec = model.encoder_blocks[0], model.decoder_blocks[1]
    in_proj = torch.cat([enc.self_attn.q_proj.weight.grad, enc.self_attn.k_proj.weight.grad,
                         enc.self_attn.v_proj.weight.grad])
    pairs = [
        (in_proj, ref.encoder.layers[0].self_attn.in_proj_weight.grad),
        (enc.ffn.linear1.weight.grad, ref.encoder.layers[0].linear1.weight.grad),
        (dec.ffn_norm.weight.grad, ref.decoder.layers[1].norm3.weight.grad),
        (dec.cross_attn.out_proj.weight.grad,
         ref.decoder.layers[1].multihead_attn.out_proj.weight.grad),
    ]
    for ours, theirs in pairs:
        assert_close(ours, theirs, **GRAD_TOL[dtype], name="stack parameter gradient")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encoder_equals_bert_style_torch_stack(dtype):
    torch.manual_seed(0)
    cfg = EncoderConfig(53, d_model=32, num_layers=2, num_heads=4, d_ff=40, dropout=0.0,
                        max_len=16)
    model = perturb_(Encoder(cfg).to(dtype))
    ids = _ids((3, 13), 53, 3, low=1)
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, 8:] = 0
    ids[1, 8:] = cfg.pad_id
    types = _ids((3, 13), 2, 4)
    out = model(ids, attention_mask=mask, token_type_ids=types)
    expected = torch_bert_hidden(model, ids, mask, types)
    real = mask.bool()
    assert_close(out[real], expected[real], **TOL[dtype], name="encoder hidden (real tokens)")
    # Mean pooling over real tokens, CLS pooling: the first state.
    mean = torch.stack([expected[b, real[b]].mean(0) for b in range(3)])
    assert_close(model.pool(out, mask), mean, **TOL[dtype], name="mean pooling")
    assert_close(model.pool(out, mask, pooling="cls"), expected[:, 0], **TOL[dtype], name="cls")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpt2_style_equals_plain_gpt(dtype):
    torch.manual_seed(0)
    cfg = DecoderLMConfig.gpt2_style(61, d_model=48, num_layers=2, num_heads=4, max_len=32)
    model = perturb_(DecoderLM(cfg).to(dtype))
    ids = _ids((2, 17), 61, 5)
    out = _grads(model, lambda: model(ids))
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = _grads(model, lambda: plain_gpt2_logits(model, ids))
    assert_close(out, expected, **TOL[dtype], name="gpt2 logits")
    for name, p in model.named_parameters():
        assert_close(ours[name], p.grad, **GRAD_TOL[dtype], name=f"gradient of {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_style_equals_plain_llama(dtype):
    torch.manual_seed(0)
    cfg = DecoderLMConfig.llama_style(59, d_model=48, num_layers=2, num_heads=6,
                                      num_kv_heads=2, rope_base=500.0)
    model = perturb_(DecoderLM(cfg).to(dtype))
    ids = _ids((2, 19), 59, 6)
    out = _grads(model, lambda: model(ids))
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = _grads(model, lambda: plain_llama_logits(model, ids))
    assert_close(out, expected, **TOL[dtype], name="llama logits")
    for name, p in model.named_parameters():
        assert_close(ours[name], p.grad, **GRAD_TOL[dtype], name=f"gradient of {name}")
