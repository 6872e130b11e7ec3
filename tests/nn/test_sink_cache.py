"""Attention sinks (issue 29): the first positions and the recent ones kept, rotary positions
re-based. References: the model without a cache (nothing dropped), and, for one layer (whose
keys and values depend on the tokens alone), the model run afresh on the kept tokens."""

from __future__ import annotations

import pytest
import torch

from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn.sink_cache import SinkLayerKVCache, sink_cache


def _model(layers: int, positions: str = "rope") -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama_style(vocab_size=97, d_model=64, num_layers=layers,
                                         num_heads=4, num_kv_heads=2)  # fmt: skip
    if positions != "rope":
        config = DecoderLMConfig(vocab_size=97, d_model=64, num_layers=layers, num_heads=4,
                                 positions=positions, max_len=512)  # fmt: skip
    return DecoderLM(config).eval()


def _stream(model, ids, cache, prefill: int) -> torch.Tensor:
    """Logits of a prefill then one token at a time: ``(1, T, V)``."""
    out = [model(ids[:, :prefill], cache=cache)]
    out += [model(ids[:, i : i + 1], cache=cache) for i in range(prefill, ids.shape[1])]
    return torch.cat(out, dim=1)


@torch.no_grad()
def test_nothing_dropped_equals_no_cache():
    model, ids = _model(3), torch.randint(0, 97, (1, 40))
    got = _stream(model, ids, model.new_cache(recent=64, sinks=4), prefill=9)
    err = float((got - model(ids)).abs().max())
    assert err <= 1e-5, f"max error {err:.3g}"


@pytest.mark.parametrize("sinks,recent,prefill", [(4, 8, 10), (2, 5, 30), (0, 6, 3), (1, 1, 4)])
@torch.no_grad()
def test_one_layer_equals_a_fresh_run_on_the_kept_tokens(sinks, recent, prefill):
    """Each step sees the first ``sinks`` tokens and the last ``recent`` (then itself) at
    positions 0, 1, ...: the same logits as running the model on just those tokens."""
    model, ids = _model(1), torch.randint(0, 97, (1, 50))
    cache = model.new_cache(recent=recent, sinks=sinks)
    model(ids[:, :prefill], cache=cache)
    for t in range(prefill, 50):
        step = model(ids[:, t : t + 1], cache=cache)[0, -1]
        kept = list(range(min(sinks, t))) + list(range(max(sinks, t - recent), t + 1))
        ref = model(ids[:, kept])[0, -1]
        err = float((step - ref).abs().max())
        assert err <= 1e-5, f"step {t}: max error {err:.3g}"
        assert cache[0].held == min(t + 1, sinks + recent)


@torch.no_grad()
def test_memory_stays_flat_however_long():
    model = _model(2)
    cache = model.new_cache(recent=16, sinks=4)
    model(torch.randint(0, 97, (1, 30)), cache=cache)
    for _ in range(300):
        model(torch.randint(0, 97, (1, 1)), cache=cache)
    assert cache.length == 330 and all(layer.held == 20 for layer in cache)
    assert all(layer._k.shape[2] == 20 for layer in cache)


@torch.no_grad()
def test_refusals_are_named():
    model = _model(1)
    with pytest.raises(ValueError, match="positions='rope'"):
        _model(1, positions="learned").new_cache(recent=8)
    with pytest.raises(ValueError, match="static=False"):
        model.new_cache(recent=8, static=True, batch_size=1, max_len=16)
    with pytest.raises(ValueError, match="sinks must be an int >= 0"):
        model.new_cache(recent=8, sinks=-1)
    with pytest.raises(ValueError, match="recent must be an int >= 1"):
        sink_cache(2, 4, 0)
    cache = model.new_cache(recent=4, sinks=1)
    with pytest.raises(ValueError, match="rows must not be padded"):
        model(torch.randint(0, 97, (1, 3)), cache=cache, positions=torch.arange(3)[None])
    cache = model.new_cache(recent=4, sinks=1)
    model(torch.randint(0, 97, (1, 9)), cache=cache)
    with pytest.raises(ValueError, match=r"crop: n must be an int in \[4, 9\]"):
        cache.crop(3)
    with pytest.raises(ValueError, match="dropped 4 positions"):
        cache[0].crop(9)


def test_a_mask_over_every_position_is_cut_to_the_kept_ones():
    layer = SinkLayerKVCache(2, 3)
    layer.update(torch.zeros(1, 1, 9, 4), torch.zeros(1, 1, 9, 4))
    layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))  # held 5 + 1 new: S = 6
    mask = torch.arange(10)[None, None, None, :]  # (1, 1, 1, length)
    assert layer.visible(mask, 6).flatten().tolist() == [0, 1, 6, 7, 8, 9]
