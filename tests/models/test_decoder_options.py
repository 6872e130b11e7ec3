"""DecoderLMConfig's options of today's decoders: validation, JSON round trip, and the model.

Windows (every layer, per layer) with the rolling cache equal full recompute; the logit soft
cap and the embedding multiplier do what their formulas say (same weights, option on vs off).
"""

from __future__ import annotations

import json

import pytest
import torch

import qkv.inspect
from helpers import assert_close
from qkv.generate import generate
from qkv.models import DecoderLM, DecoderLMConfig

ALL_OPTIONS = dict(
    attn_scale=0.2, qkv_bias=True, k_bias=False, out_bias=False, qk_norm="rmsnorm",
    layer_windows=[3, None, 2], attn_softcap=20.0, logit_softcap=15.0, embed_scale=4.0,
    sandwich_norm=True, rope_scaling={"kind": "yarn", "factor": 4.0, "original_max_len": 8},
    rope_dim=4,
)


def _config(**kw) -> DecoderLMConfig:
    base = dict(d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, max_len=64)
    return DecoderLMConfig.llama_style(61, **{**base, **kw})


def test_every_option_round_trips_through_json():
    c = _config(**ALL_OPTIONS, activation="geglu")
    assert c.layer_windows == (3, None, 2) and c.windows == (3, None, 2)
    back = DecoderLMConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c
    assert back.rope_scaling["kind"] == "yarn" and back.ffn_dim == c.ffn_dim
    assert _config(window=5).windows == (5, 5, 5)
    assert _config().windows == (None, None, None)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(window=0), r"window must be a positive int or None, got 0"),
    (dict(layer_windows=[2, 3]), r"layer_windows must be a sequence of 3 entries"),
    (dict(layer_windows=[2, 0, None]), r"layer_windows must be a sequence of 3 entries"),
    (dict(window=2, layer_windows=[2, 2, 2]), r"layer_windows must be None when window is set"),
    (dict(attn_softcap=0.0), r"attn_softcap must be a finite number > 0, got 0.0"),
    (dict(logit_softcap=float("nan")), r"logit_softcap must be a finite number > 0"),
    (dict(embed_scale=-1.0), r"embed_scale must be a finite number > 0, got -1.0"),
    (dict(attn_scale=float("inf")), r"attn_scale must be a finite number > 0, got inf"),
    (dict(qkv_bias="yes"), r"qkv_bias must be a bool, got 'yes'"),
    (dict(qk_norm="batchnorm"), r"qk_norm must be one of \('layernorm', 'rmsnorm', None\)"),
    (dict(sandwich_norm=True, norm="post"), r"sandwich_norm must be False with norm='post'"),
    (dict(rope_dim=3), r"rope_dim must be None or an even int <= the head width 8, got 3"),
    (dict(rope_dim=4, positions="learned"), r"positions must be 'rope' when rope_scaling"),
    (dict(rope_scaling={"kind": "longrope"}), r"rope_scaling: RopeScaling.kind must be one of"),
    (dict(rope_scaling={"kind": "yarn", "factor": 2.0}), r"rope_scaling: .*needs original_max"),
    (dict(activation="reglu"), r"activation must be one of \(.*'swiglu', 'geglu'\)"),
])
def test_bad_options_name_the_field(kw, match):
    with pytest.raises(ValueError, match=r"DecoderLMConfig\.?.*" + match):
        _config(**kw)


def _model(seed=0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(_config(**kw)).eval()


@pytest.mark.parametrize("kw", [
    dict(window=3),
    dict(layer_windows=[2, None, 4], attn_softcap=3.0, sandwich_norm=True),
    dict(window=4, rope_scaling={"kind": "llama3", "factor": 8.0, "original_max_len": 8}),
], ids=["window", "layer-windows", "llama3-rope"])
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "full"])
def test_windowed_decoding_equals_recompute(kw, rolling):
    model = _model(**kw)
    ids = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(rolling=rolling)
        steps = [model(ids[:, :5], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(5, 14)]
    assert_close(torch.cat(steps, 1), full, atol=2e-5, name=f"cached logits {kw}")
    held = [layer.held for layer in cache]
    expect = [w if (w is not None and rolling) else 14 for w in model.config.windows]
    assert held == expect, f"held positions per layer {held}, expected {expect}"


def test_window_changes_the_model_only_past_the_window():
    plain, windowed = _model(), _model(window=4)
    windowed.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 61, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = plain(ids), windowed(ids)
    assert_close(b[:, :4], a[:, :4], atol=1e-6, name="positions inside the window")
    assert (b[:, 4:] - a[:, 4:]).abs().max() > 1e-4, "the window hid nothing"


def test_logit_softcap_and_embed_scale_follow_their_formulas():
    plain = _model()
    capped = _model(logit_softcap=2.0)
    capped.load_state_dict(plain.state_dict())
    scaled = _model(embed_scale=3.0)
    scaled.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = plain(ids)
        assert_close(capped(ids), 2.0 * torch.tanh(logits / 2.0), atol=1e-6, name="soft cap")
        with qkv.inspect.capture(scaled, record="blocks.0.hook_resid_pre") as cap:
            scaled(ids)
    assert_close(cap.values["blocks.0.hook_resid_pre"][0], plain.embed(ids) * 3.0, atol=1e-6,
                 name="scaled embeddings")  # fmt: skip


def test_generate_with_a_rolling_cache_equals_greedy_recompute():
    model = _model(layer_windows=[3, None, 2])
    prompt = [5, 9, 1, 40]
    tokens = generate(model, torch.tensor([prompt]), max_new_tokens=8)[0].tolist()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert tokens == ids[-8:], f"generated {tokens}, recompute gives {ids[-8:]}"


def _no_rolling(model: DecoderLM) -> DecoderLM:
    """The same model whose caches keep every position (the reference for rolling ones)."""
    full = _model(**{k: getattr(model.config, k) for k in ("layer_windows", "window")})
    full.load_state_dict(model.state_dict())
    full.new_cache = lambda *a, **k: DecoderLM.new_cache(full, *a, rolling=False, **k)
    return full


def test_beam_search_and_padded_batches_with_a_rolling_cache():
    model = _model(layer_windows=[3, None, 2])
    full = _no_rolling(model)
    prompts = [[5, 9, 1, 40, 7], [11, 3]]  # left-padded in one batch
    for kw in (dict(), dict(beam_size=3)):
        ours = generate(model, prompts, max_new_tokens=7, pad_id=0, **kw)
        theirs = generate(full, prompts, max_new_tokens=7, pad_id=0, **kw)
        assert torch.equal(ours, theirs), f"{kw}: rolling {ours.tolist()} != full {theirs.tolist()}"
    alone = [generate(model, [p], max_new_tokens=7, pad_id=0)[0] for p in prompts]
    batch = generate(model, prompts, max_new_tokens=7, pad_id=0)
    for i, row in enumerate(alone):
        assert batch[i, : len(row)].tolist() == row.tolist(), f"prompt {i}: batched != alone"


def test_packed_rows_with_a_window_equal_each_document_alone():
    model = _model(layer_windows=[3, None, 2], attn_softcap=4.0)
    docs = [torch.randint(0, 61, (1, n), generator=torch.Generator().manual_seed(n))
            for n in (6, 4, 7)]  # fmt: skip
    row = torch.cat(docs, 1)
    doc_ids = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)], 1)
    with torch.no_grad():
        packed = model(row, document_ids=doc_ids)
        alone = torch.cat([model(d) for d in docs], 1)
    assert_close(packed, alone, atol=2e-5, name="packed windowed rows")
