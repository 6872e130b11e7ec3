"""all-MiniLM-L6-v2 on qkv's encoder == transformers' BertModel and sentence-transformers.

Token ids equal sentence-transformers' (truncation at 256, not the 128 baked into the
package's tokenizer.json); hidden states and every layer's and head's attention weights equal
BertModel's (eager attention) to 1e-5 over real tokens; sentence embeddings equal
sentence-transformers' to 1e-6. One batch holds all the varied texts, so padding is exercised.

The weights are taken from qkv's math backend (the textbook softmax). ``auto`` with
``need_weights`` currently picks the flash backend, whose weights rebuilt from the float32
log-sum-exp were measured 2.6e-5 off on layer 0 (a weight of 1.0000229); that is a precision
issue of the rebuild, reported separately, not of the model.
"""

from __future__ import annotations

import functools

import pytest
import torch
from pretrained_refs import TEXTS, hf_bert, minilm, st_minilm

import qkv.nn.core
import qkv.pretrained
from helpers import assert_close
from qkv.attention.sdpa import run_call
from qkv.models import Encoder


def _capture_weights(model: Encoder) -> tuple[list[torch.Tensor], list]:
    """Make every block's self-attention also return its weights, and keep them."""
    weights: list[torch.Tensor] = []

    def ask(module, args, kwargs):
        return args, {**kwargs, "need_weights": True}

    def keep(module, args, kwargs, output):
        weights.append(output[1])

    handles = []
    for block in model.blocks:
        handles.append(block.self_attn.register_forward_pre_hook(ask, with_kwargs=True))
        handles.append(block.self_attn.register_forward_hook(keep, with_kwargs=True))
    return weights, handles


def test_config_matches_the_checkpoint():
    c = minilm().config
    assert (c.num_layers, c.num_heads, c.d_model, c.ffn_dim) == (6, 12, 384, 1536)
    assert (c.norm, c.activation, c.norm_eps, c.positions) == ("post", "gelu", 1e-12, "learned")
    assert minilm().tokenizer.max_length == 256 == st_minilm().max_seq_length


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_token_ids_equal_sentence_transformers(text):
    ours = minilm().tokenizer.encode(text)
    ref = st_minilm().preprocess([text])["input_ids"][0].tolist()
    assert ours == ref, f"{text[:40]!r}: ours {ours[:12]}... vs {ref[:12]}..."
    assert ours[0] == 101 and ours[-1] == 102  # [CLS] ... [SEP]


def test_long_text_is_truncated_at_256_not_128():
    ids = minilm().tokenizer.encode(TEXTS[1])
    assert len(ids) == 256


def test_hidden_states_and_attention_weights_equal_bert_model(monkeypatch):
    # Every attention module's kernel call goes through the core: force the math backend.
    math_run = functools.partial(run_call, backend="math")
    monkeypatch.setattr(qkv.nn.core, "run_call", math_run)
    bundle, ref = minilm(), hf_bert()
    ids, keep = bundle.tokenizer.encode_batch(TEXTS)  # (B, S) each
    weights, handles = _capture_weights(bundle.model)
    try:
        with torch.no_grad():
            hidden = bundle.model(ids, attention_mask=keep)  # (B, S, E)
            out = ref(input_ids=ids, attention_mask=keep.long(), output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    real = keep[..., None]  # (B, S, 1)
    assert_close(hidden * real, out.last_hidden_state * real, atol=1e-5, name="hidden states")
    assert len(weights) == len(out.attentions) == 6
    rows = keep[:, None, :, None]  # (B, 1, S, 1): real query rows
    for layer, (ours, theirs) in enumerate(zip(weights, out.attentions, strict=True)):
        assert ours.shape == theirs.shape == (len(TEXTS), 12, ids.shape[1], ids.shape[1])
        assert_close(ours * rows, theirs * rows, atol=1e-5, name=f"layer {layer} weights")


def test_sentence_embeddings_equal_sentence_transformers():
    ours = minilm().encode(TEXTS, batch_size=4)  # several batches, sorted by length
    ref = st_minilm().encode(TEXTS, batch_size=32, convert_to_tensor=True)
    assert ours.shape == (len(TEXTS), 384)
    assert_close(ours, ref, atol=1e-6, name="sentence embeddings")
    assert_close(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-6, name="norms")


def test_encode_batch_size_does_not_change_embeddings():
    bundle = minilm()
    one = torch.cat([bundle.encode(t) for t in TEXTS[:4]])
    assert_close(bundle.encode(TEXTS[:4], batch_size=3), one, atol=1e-6, name="batched")


def test_similarity_ranks_paraphrases_first():
    sims = minilm().similarity(
        ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell."]
    )
    assert sims.shape == (3, 3)
    assert_close(sims.diagonal(), torch.ones(3), atol=1e-6, name="self-similarity")
    assert sims[0, 1] > sims[0, 2] + 0.2


def test_encode_errors_name_the_argument():
    bundle = minilm()
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        bundle.encode(["a"], batch_size=0)
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got int"):
        bundle.encode(["a", 3])
    assert bundle.encode([]).shape == (0, 384)


def test_embed_gives_embeddings_and_cosine_table():
    emb, cos = qkv.pretrained.embed(["a red apple", "a green apple"], minilm())
    assert emb.shape == (2, 384) and cos.shape == (2, 2)
    assert_close(cos, emb @ emb.T, atol=1e-6, name="cosine of unit vectors")
    with pytest.raises(ValueError, match="is a language model, not a sentence encoder"):
        qkv.pretrained.embed(["x"], _fake_decoder())


def _fake_decoder() -> qkv.pretrained.DecoderBundle:
    from qkv.models import DecoderLM, DecoderLMConfig

    return qkv.pretrained.DecoderBundle(DecoderLM(DecoderLMConfig(11, d_model=8, num_layers=1,
                                                                  num_heads=2)), None, "tiny")
