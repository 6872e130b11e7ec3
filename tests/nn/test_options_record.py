"""``AttentionOptions``: one record of attention's options, built once and carried by reference
from a model's config through ``TransformerBlock`` and ``Attention`` into the kernel call;
checkpoints written before it existed load unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_close
from qkv.checkpoint.folder import load_checkpoint, save_checkpoint
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn import Attention, AttentionOptions, TransformerBlock


def test_fields_as_keywords_and_the_record_build_the_same_module():
    torch.manual_seed(0)
    a = Attention(16, 4, window=3, softcap=20.0, qk_norm="rmsnorm")
    torch.manual_seed(0)
    b = Attention(16, 4, options=AttentionOptions(window=3, softcap=20.0, qk_norm="rmsnorm"))
    assert a.options == b.options and a.window == 3 and b.softcap == 20.0
    x = torch.randn(2, 7, 16)
    assert_close(a(x, is_causal=True)[0], b(x, is_causal=True)[0], atol=0, name="same module")
    c = Attention(16, 4, options=b.options, window=5)  # a keyword replaces the record's field
    assert c.options.window == 5 and c.options.softcap == 20.0 and b.options.window == 3


def test_a_block_hands_one_record_to_its_attentions():
    block = TransformerBlock(16, 4, 32, cross_attention=True, alibi=True, window=4, scale=0.5,
                             qk_norm="layernorm", norm_eps=1e-3)
    own = block.self_attn.options
    assert (own.alibi, own.window, own.scale, own.norm_eps) == (True, 4, 0.5, 1e-3)
    cross = block.cross_attn.options  # positions within one sequence stay in self-attention
    assert (cross.alibi, cross.window, cross.scale, cross.qk_norm) == (False, None, 0.5,
                                                                       "layernorm")


def test_a_model_builds_the_record_once_from_its_config():
    cfg = DecoderLMConfig.llama_style(50, d_model=16, num_layers=3, num_heads=4,
                                      layer_windows=(4, None, 4), attn_softcap=30.0,
                                      attn_scale=0.3)
    model = DecoderLM(cfg)
    options = [b.self_attn.options for b in model.blocks]
    assert [o.window for o in options] == [4, None, 4]
    assert {(o.softcap, o.scale) for o in options} == {(30.0, 0.3)}
    assert cfg.attention == AttentionOptions(scale=0.3, softcap=30.0, norm_eps=cfg.norm_eps)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: Attention(16, 4, heat=2.0), TypeError,
     r"unknown attention option\(s\) heat; the options are alibi, alibi_symmetric"),
    (lambda: AttentionOptions(temperature=(1.0, 0.0)), ValueError, "temperature must be"),
    (lambda: Attention(16, 4, temperature=(1.0, 2.0))(torch.randn(1, 3, 16)), ValueError,
     "temperature has 2 entries but the attention has H=4"),
    (lambda: Attention(16, 4, options={"window": 3}), TypeError,
     "options must be an AttentionOptions or None, got dict"),
    (lambda: AttentionOptions(window=0), ValueError, "window"),
    (lambda: AttentionOptions(scale=float("nan")), ValueError, "scale must be a finite"),
    (lambda: AttentionOptions(alibi_symmetric=True), ValueError, "needs alibi=True"),
    (lambda: AttentionOptions(alibi=1), TypeError, "alibi must be a bool"),
    (lambda: AttentionOptions(qk_norm="batchnorm"), ValueError, "qk_norm must be None or"),
    (lambda: DecoderLMConfig(50, d_model=16, num_layers=1, num_heads=4, attention_options={"scale": 1.0}), ValueError,
     r"attention_options.*no scale \(set attn_scale instead\)"),
    (lambda: DecoderLMConfig(50, d_model=16, num_layers=1, num_heads=4, attention_options={"nope": 1}), ValueError,
     r"attention_options: unknown attention option\(s\) nope"),
    (lambda: DecoderLMConfig(50, d_model=16, num_layers=1, num_heads=4, attention_options=[1]), ValueError,
     "attention_options"),
])
def test_bad_options_are_refused_by_name(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_checkpoint_written_before_the_record_loads_and_computes_the_same(tmp_path):
    """A config file with no ``attention_options`` key (every checkpoint written before it
    existed) loads into the same model."""
    torch.manual_seed(0)
    cfg = DecoderLMConfig.gpt2_style(60, d_model=16, num_layers=2, num_heads=2, max_len=32,
                                     window=5, attn_softcap=10.0)
    model = DecoderLM(cfg).eval()
    folder = save_checkpoint(tmp_path / "run", model)
    config_files = [p for p in folder.rglob("*.json") if "attention_options" in p.read_text()]
    assert config_files, "the config is saved as JSON"
    for path in config_files:  # write it as an older qkv did: without the new key
        data = json.loads(path.read_text())

        def strip(node):
            if isinstance(node, dict):
                node.pop("attention_options", None)
                for value in node.values():
                    strip(value)
        strip(data)
        path.write_text(json.dumps(data))
    loaded = load_checkpoint(folder).model.eval()
    ids = torch.randint(0, 60, (2, 9))
    with torch.no_grad():
        assert_close(loaded(ids), model(ids), atol=0, name="old checkpoint")


def test_per_head_temperature_divides_each_heads_scores():
    """The option added to prove the record: three files (options.py, core.py, this test),
    and it reaches Attention, TransformerBlock and DecoderLM's config with no other edit."""
    torch.manual_seed(0)
    taus = (0.5, 1.0, 2.0, 4.0)
    attn = Attention(16, 4, temperature=taus).eval()
    x = torch.randn(2, 5, 16)
    _, weights = attn(x, need_weights=True)
    q = attn.q_proj(x).view(2, 5, 4, 4).transpose(1, 2)  # (B, H, T, D)
    k = attn.k_proj(x).view(2, 5, 4, 4).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / 2.0 / torch.tensor(taus).view(4, 1, 1)  # D = 4
    assert_close(weights, scores.softmax(-1), atol=1e-6, name="weights with temperatures")
    cfg = DecoderLMConfig.llama_style(50, d_model=16, num_layers=2, num_heads=4,
                                      attention_options={"temperature": list(taus)})
    model = DecoderLM(cfg)
    assert all(b.self_attn.options.temperature == taus for b in model.blocks)
    assert DecoderLMConfig.from_dict(cfg.to_dict()).attention.temperature == taus
