"""Seq2SeqTransformer: the seeds' demo configuration and its parameter count, a causal
decoder, cached decoding equal to recomputation, padded sources equal per-example runs,
tied/shared embeddings, gradients everywhere, and clear errors."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, assert_close
from qkv.models import Seq2SeqConfig, Seq2SeqTransformer
from qkv.nn import KVCache

F32 = TOL[torch.float32]
SV, TV = 29, 31
VARIANTS = {
    "paper": dict(),
    "pre-gelu-learned": dict(norm="pre", activation="gelu", positions="learned"),
    "rope": dict(positions="rope"),
    "alibi": dict(positions="alibi"),
}


def _model(variant="paper", seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(d_model=32, num_heads=4, d_ff=48, dropout=0.0, max_len=40)
    cfg = Seq2SeqConfig(SV, TV, **{**base, **VARIANTS[variant], **kw})
    return Seq2SeqTransformer(cfg).eval()


def _ids(shape, vocab, seed, low=3):
    return torch.randint(low, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_demo_configuration_parameter_count():
    """The seeds' demo: 2+2 layers, d_model 128, 4 heads, d_ff 512, vocabularies of 1000."""
    model = Seq2SeqTransformer(Seq2SeqConfig(1000, 1000, d_model=128, num_heads=4, d_ff=512))
    E, F, V = 128, 512, 1000
    attention = 4 * (E * E + E)  # q, k, v, out projections with biases
    ffn = E * F + F + F * E + E
    norm = 2 * E
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    embeddings = 2 * V * E  # source and target; sinusoidal positions have no parameters
    head = E * V + V
    expected = 2 * encoder_layer + 2 * decoder_layer + embeddings + head
    assert expected == 1_310_696
    assert model.num_parameters() == expected == sum(p.numel() for p in model.parameters())
    assert model.num_parameters(trainable_only=True) == expected
    model.src_embed.weight.requires_grad_(False)
    assert model.num_parameters(trainable_only=True) == expected - V * E
    text = repr(model)
    assert "Seq2SeqConfig(src_vocab_size=1000, tgt_vocab_size=1000, d_model=128" in text
    assert "parameters: 1,310,696" in text and "(decoder_blocks): ModuleList(" in text


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_is_causal(variant):
    model = _model(variant)
    src = _ids((2, 9), SV, 1)
    tgt = _ids((2, 12), TV, 2)
    changed = tgt.clone()
    changed[:, 7:] = _ids((2, 5), TV, 3)
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    assert_close(a[:, :7], b[:, :7], **F32, name="logits before the change")
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_equals_full_decode(variant):
    model = _model(variant)
    src = _ids((3, 10), SV, 4)
    src[1, 6:] = model.config.pad_id
    tgt = _ids((3, 11), TV, 5)
    with torch.no_grad():
        src_mask = model.make_src_mask(src)
        memory = model.encode(src, src_mask)
        full = model.decode(tgt, memory, src_mask)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, :4], memory, src_mask, cache=cache)]
        steps += [model.decode(tgt[:, t : t + 1], memory, src_mask, cache=cache)
                  for t in range(4, 11)]
    assert_close(torch.cat(steps, 1), full, **F32, name="cached decoding")
    assert all(layer.static is not None for layer in cache)  # cross K/V stored once


@pytest.mark.parametrize("variant", ["paper", "alibi"])
def test_padded_sources_equal_per_example_runs(variant):
    model = _model(variant)
    lengths = [10, 6, 3]
    src = _ids((3, 10), SV, 6)
    for b, n in enumerate(lengths):
        src[b, n:] = model.config.pad_id
    tgt = _ids((3, 8), TV, 7)
    with torch.no_grad():
        batched = model(src, tgt)
        for b, n in enumerate(lengths):
            alone = model(src[b : b + 1, :n], tgt[b : b + 1])
            assert_close(batched[b], alone[0], **F32, name=f"row {b} (source length {n})")


def test_tied_and_shared_embeddings():
    tied = _model(tie_embeddings=True)
    assert tied.lm_head.weight is tied.tgt_embed.weight
    assert tied.num_parameters() == _model().num_parameters() - TV * 32
    torch.manual_seed(0)
    shared = Seq2SeqTransformer(Seq2SeqConfig(SV, SV, d_model=32, d_ff=48,
                                              share_embeddings=True, tie_embeddings=True))
    assert shared.src_embed is shared.tgt_embed
    assert shared.lm_head.weight is shared.src_embed.weight
    out = shared(_ids((2, 5), SV, 8), _ids((2, 4), SV, 9))
    out.sum().backward()
    assert shared.src_embed.weight.grad is not None


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_reach_every_parameter(variant):
    model = _model(variant, dropout=0.1).train()
    out = model(_ids((2, 7), SV, 10), _ids((2, 5), TV, 11))
    (out * torch.randn_like(out)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


def test_dropout_only_in_training():
    model = _model(dropout=0.3)
    src, tgt = _ids((2, 6), SV, 12), _ids((2, 5), TV, 13)
    assert torch.equal(model(src, tgt), model(src, tgt))
    model.train()
    assert not torch.equal(model(src, tgt), model(src, tgt))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m: m(_ids((2, 5), SV, 0, low=0) + SV, _ids((2, 3), TV, 0)), ValueError,
         r"src must lie in \[0, vocab_size=29\)"),
        (lambda m: m(_ids((2, 5), SV, 0), torch.full((2, 3), TV)), ValueError,
         r"tgt_in must lie in \[0, vocab_size=31\), got values in \[31, 31\]"),
        (lambda m: m(_ids((2, 5), SV, 0).float(), _ids((2, 3), TV, 0)), TypeError,
         r"src must hold integer token ids"),
        (lambda m: m(_ids((2, 5), SV, 0), _ids((2, 41), TV, 0)), ValueError,
         r"tgt_in has T=41 tokens, which goes beyond max_len=40"),
        (lambda m: m.encode(_ids((2, 5), SV, 0), torch.ones(2, 1, 1, 4, dtype=torch.bool)),
         ValueError, r"src_mask of shape \(2, 1, 1, 4\) must broadcast to the attention scores "
                     r"\(B, H, T, S\) = \(2, 4, 5, 5\)"),
        (lambda m: m.encode(_ids((2, 5), SV, 0), torch.ones(2, 1, 1, 5, dtype=torch.long)),
         TypeError, r"src_mask must be a boolean keep mask"),
        (lambda m: m.decode(_ids((2, 3), TV, 0), torch.zeros(2, 5, 16)), ValueError,
         r"memory must have shape \(B, S, E=32\), got \(2, 5, 16\)"),
        (lambda m: m.decode(_ids((2, 3), TV, 0), torch.zeros(2, 5, 32), cache=KVCache(5)),
         ValueError, r"cache has 5 layers but the model has 2"),
        (lambda m: Seq2SeqTransformer("config"), TypeError, r"config must be a Seq2SeqConfig"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(_model(positions="learned"))
