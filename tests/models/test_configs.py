"""Model configs: validation names the field and the value, JSON round trip, frozen, repr."""

from __future__ import annotations

import dataclasses
import json

import pytest

from qkv.models import (
    DecoderLM,
    DecoderLMConfig,
    Encoder,
    EncoderConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
    ViT,
    ViTConfig,
)

CONFIGS = {
    "decoder": lambda **kw: DecoderLMConfig(**{"vocab_size": 50, **kw}),
    "seq2seq": lambda **kw: Seq2SeqConfig(**{"src_vocab_size": 50, "tgt_vocab_size": 60, **kw}),
    "encoder": lambda **kw: EncoderConfig(**{"vocab_size": 50, **kw}),
    "vit": lambda **kw: ViTConfig(**kw),
}
NAMES = {"decoder": "DecoderLMConfig", "seq2seq": "Seq2SeqConfig", "encoder": "EncoderConfig",
         "vit": "ViTConfig"}

# (field overrides, regex after "<ConfigName>."), valid for every config.
COMMON_ERRORS = [
    (dict(d_model=0), r"d_model must be a positive int, got 0"),
    (dict(d_model=2.5), r"d_model must be a positive int, got 2.5"),
    (dict(num_heads=-1), r"num_heads must be a positive int, got -1"),
    (dict(d_model=100, num_heads=3), r"d_model \(100\) must be a multiple of num_heads \(3\)"),
    (dict(dropout=1.0), r"dropout must be a number in \[0, 1\), got 1.0"),
    (dict(dropout=-0.1), r"dropout must be a number in \[0, 1\), got -0.1"),
    (dict(norm="sandwich"), r"norm must be one of \('post', 'pre'\), got 'sandwich'"),
    (dict(activation="tanh"), r"activation must be one of \('relu', 'gelu', 'gelu_tanh', "
                              r"'silu', 'swiglu', 'geglu'\), got 'tanh'"),
    (dict(d_ff=0), r"d_ff must be a positive int( or None)?, got 0"),
]


@pytest.mark.parametrize("kind", CONFIGS)
@pytest.mark.parametrize("overrides, match", COMMON_ERRORS, ids=lambda v: str(v)[:40])
def test_common_errors_name_the_field_and_value(kind, overrides, match):
    with pytest.raises(ValueError, match=NAMES[kind] + r"\." + match):
        CONFIGS[kind](**overrides)


@pytest.mark.parametrize(
    "kind, overrides, match",
    [
        ("decoder", dict(vocab_size=0), r"DecoderLMConfig\.vocab_size must be a positive int"),
        ("decoder", dict(num_heads=8, num_kv_heads=3),
         r"DecoderLMConfig\.num_heads \(8\) must be a multiple of num_kv_heads \(3\)"),
        ("decoder", dict(num_kv_heads=0), r"DecoderLMConfig\.num_kv_heads must be a positive "
                                          r"int or None, got 0"),
        ("decoder", dict(norm_kind="batchnorm"),
         r"DecoderLMConfig\.norm_kind must be one of \('layernorm', 'rmsnorm'\), got 'batchnorm'"),
        ("decoder", dict(positions="t5"), r"DecoderLMConfig\.positions must be one of "
                                          r"\('sinusoidal', 'learned', 'rope', 'alibi', "
                                          r"'relative', None\), got 't5'"),
        ("decoder", dict(positions="rope", d_model=36, num_heads=4),
         r"DecoderLMConfig\.positions='rope' needs an even head width, .* = 9"),
        ("decoder", dict(norm_eps=0.0), r"DecoderLMConfig\.norm_eps must be a finite number "
                                        r"> 0, got 0.0"),
        ("decoder", dict(rope_base=float("inf")), r"DecoderLMConfig\.rope_base must be a "
                                                   r"finite number > 0, got inf"),
        ("decoder", dict(max_len=0), r"DecoderLMConfig\.max_len must be a positive int, got 0"),
        ("decoder", dict(bias="yes"), r"DecoderLMConfig\.bias must be a bool, got 'yes'"),
        ("decoder", dict(eos_id=50), r"DecoderLMConfig\.eos_id must be None or a token id in "
                                     r"\[0, 50\), got 50"),
        ("seq2seq", dict(share_embeddings=True), r"Seq2SeqConfig\.share_embeddings=True needs "
                                                 r"src_vocab_size == tgt_vocab_size, got 50 and 60"),
        ("seq2seq", dict(num_encoder_layers=0), r"Seq2SeqConfig\.num_encoder_layers must be a "
                                                r"positive int, got 0"),
        ("seq2seq", dict(pad_id=55), r"Seq2SeqConfig\.pad_id must be None or a token id in "
                                     r"\[0, 50\), got 55"),
        ("encoder", dict(pooling="max"), r"EncoderConfig\.pooling must be one of \('mean', "
                                         r"'cls'\), got 'max'"),
        ("encoder", dict(type_vocab_size=-1), r"EncoderConfig\.type_vocab_size must be an int "
                                              r">= 0, got -1"),
        ("vit", dict(image_size=30, patch_size=4), r"ViTConfig\.image_size \(30\) must be a "
                                                   r"multiple of patch_size \(4\)"),
        ("vit", dict(channels=0), r"ViTConfig\.channels must be a positive int, got 0"),
    ],
)
def test_specific_errors(kind, overrides, match):
    with pytest.raises(ValueError, match=match):
        CONFIGS[kind](**overrides)


def test_d_head_lifts_the_divisibility_rule():
    cfg = DecoderLMConfig(50, d_model=100, num_heads=3, d_head=32, num_layers=1)
    assert cfg.head_dim == 32
    model = DecoderLM(cfg)
    assert model.blocks[0].self_attn.q_proj.out_features == 96


@pytest.mark.parametrize("kind", CONFIGS)
def test_json_round_trip_and_frozen(kind):
    cfg = CONFIGS[kind](dropout=0.25)
    d = json.loads(json.dumps(cfg.to_dict()))
    again = type(cfg).from_dict(d)
    assert again == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dropout = 0.5


def test_from_dict_errors():
    with pytest.raises(ValueError, match=r"DecoderLMConfig.from_dict: unknown keys \['n_embd'\]"):
        DecoderLMConfig.from_dict({"vocab_size": 5, "n_embd": 3})
    with pytest.raises(ValueError, match=r"missing required keys \['tgt_vocab_size'\]"):
        Seq2SeqConfig.from_dict({"src_vocab_size": 5})
    with pytest.raises(TypeError, match=r"from_dict needs a mapping, got list"):
        ViTConfig.from_dict([])
    with pytest.raises(ValueError, match=r"EncoderConfig\.d_model must be a positive int"):
        EncoderConfig.from_dict({"vocab_size": 5, "d_model": -3})


@pytest.mark.parametrize(
    "model",
    [
        lambda: DecoderLM(DecoderLMConfig.llama_style(50, d_model=32, num_layers=1)),
        lambda: Seq2SeqTransformer(Seq2SeqConfig(50, 50, d_model=32, d_ff=32,
                                                 num_encoder_layers=1, num_decoder_layers=1)),
        lambda: Encoder(EncoderConfig(50, d_model=32, num_layers=1)),
        lambda: ViT(ViTConfig(d_model=32, num_layers=1)),
    ],
    ids=["decoder", "seq2seq", "encoder", "vit"],
)
def test_repr_shows_config_summary_and_module_tree(model):
    m = model()
    text = repr(m)
    assert text.startswith(f"{type(m).__name__}(\n  config: {type(m.config).__name__}(")
    assert f"parameters: {m.num_parameters():,}" in text
    assert "(blocks)" in text or "(encoder_blocks)" in text
    assert "TransformerBlock(" in text and "Attention(" in text
    assert m.num_parameters() == sum(p.numel() for p in m.parameters())
