"""T5's bucketed relative bias as a position type of DecoderLM and Encoder (not only of
encoder-decoders): against a forward written out with the bias added to every block's scores,
with the bucket formula written here in plain Python; cache, padding and packed rows."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close
from qkv.models import DecoderLM, DecoderLMConfig, Encoder, EncoderConfig


def bucket(rel: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """T5's bucket of ``rel = key - query`` (Raffel et al., 2020), in plain Python."""
    base, n_buckets = 0, num_buckets
    if bidirectional:
        n_buckets //= 2
        base = n_buckets if rel > 0 else 0
        n = abs(rel)
    else:
        n = max(-rel, 0)
    exact = n_buckets // 2
    if n < exact:
        return base + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact)
                        * (n_buckets - exact))
    return base + min(large, n_buckets - 1)


def bias_table(weight, T, S, offset, buckets, max_distance, bidirectional):
    """``(1, H, T, S)`` from the bias module's ``(num_buckets, H)`` weight, by loops."""
    out = torch.empty(weight.shape[1], T, S, dtype=weight.dtype)
    for i in range(T):
        for j in range(S):
            out[:, i, j] = weight[bucket(j - (offset + i), buckets, max_distance, bidirectional)]
    return out[None]


def _decoder(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
               positions="relative", relative_buckets=8, relative_max_distance=12,
               norm_kind="rmsnorm", activation="swiglu", bias=False)  # fmt: skip
    model = DecoderLM(DecoderLMConfig(**{**cfg, **kw})).eval()
    with torch.no_grad():  # a bias that matters: as large as the scores
        model.rel_bias.weight.normal_(0, 2.0)
    return model


@pytest.mark.parametrize("T", [1, 5, 19])
def test_decoder_equals_bias_added_in_every_block(T):
    model = _decoder()
    c = model.config
    ids = torch.randint(0, c.vocab_size, (2, T))
    table = bias_table(model.rel_bias.weight.detach(), T, T, 0, 8, 12, False)
    with torch.no_grad():
        h = model.embed(ids)
        for block in model.blocks:
            h = block(h, mask=table, is_causal=True)
        want = model.lm_head(model.norm_f(h))
        got = model(ids)
        assert model.config.positions == "relative" and model.pos is None
    assert_close(got, want, atol=1e-5, name=f"relative-bias decoder T={T}")
    # the bias matters: without it the logits differ
    with torch.no_grad():
        plain = DecoderLM(DecoderLMConfig(**{**c.to_dict(), "positions": None}))
        plain.load_state_dict({k: v for k, v in model.state_dict().items()
                               if not k.startswith("rel_bias")})  # fmt: skip
        err = (plain.eval()(ids) - got).abs().max().item()
    assert T == 1 or err > 1e-2, f"the relative bias changes nothing ({err:.1e})"


def test_decoder_gradient_reaches_the_bias_table():
    model = _decoder().train()
    model(torch.randint(0, 61, (2, 9))).square().mean().backward()
    g = model.rel_bias.weight.grad
    assert g is not None and g.abs().sum() > 0


@pytest.mark.parametrize("window", [None, 4])
def test_decoder_cache_equals_recompute(window):
    model = _decoder(window=window)
    ids = torch.randint(0, 61, (2, 14))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :6], cache=cache)]
        steps += [model(ids[:, t:t + 1], cache=cache) for t in range(6, 14)]
    assert_close(torch.cat(steps, 1), full, atol=1e-5, name=f"cached decode, window={window}")


def test_decoder_left_padding_equals_each_row_alone():
    model = _decoder()
    a, b = torch.randint(0, 61, (1, 9)), torch.randint(0, 61, (1, 5))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    keep = torch.ones(2, 9, dtype=torch.long)
    keep[1, :4] = 0
    positions = (keep.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(batch, attention_mask=keep, positions=positions)
        assert_close(out[0], model(a)[0], atol=1e-5, name="unpadded row")
        assert_close(out[1, 4:], model(b)[0], atol=1e-5, name="left-padded row")


def test_decoder_packed_documents_equal_each_alone():
    model = _decoder()
    ids = torch.randint(0, 61, (1, 11))
    docs = torch.tensor([[0] * 4 + [1] * 7])
    with torch.no_grad():
        packed = model(ids, document_ids=docs)
        assert_close(packed[0, :4], model(ids[:, :4])[0], atol=1e-5, name="document 0")
        assert_close(packed[0, 4:], model(ids[:, 4:])[0], atol=1e-5, name="document 1")


def test_encoder_bidirectional_bias_and_padding():
    torch.manual_seed(1)
    model = Encoder(EncoderConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4,
                                  positions="relative", relative_buckets=10,
                                  relative_max_distance=20, dropout=0.0)).eval()  # fmt: skip
    with torch.no_grad():
        model.rel_bias.weight.normal_(0, 2.0)
    ids = torch.randint(1, 50, (2, 13))
    ids[1, 9:] = 0  # padding (pad_id 0)
    table = bias_table(model.rel_bias.weight.detach(), 13, 13, 0, 10, 20, True)
    keep = (ids != 0)[:, None, None, :]
    with torch.no_grad():
        h = model.drop(model.embed_norm(model.embed(ids) + model._token_types(None, 2, 13)))
        for block in model.blocks:
            h = block(h, mask=table.masked_fill(~keep, float("-inf")))
        got = model(ids)
        assert_close(got, h, atol=1e-5, name="relative-bias encoder")
        assert_close(got[1, :9], model(ids[1:, :9])[0], atol=1e-5, name="padded row alone")


def test_config_checks_and_round_trip():
    cfg = DecoderLMConfig(vocab_size=10, positions="relative", relative_buckets=6,
                          relative_max_distance=9)  # fmt: skip
    assert DecoderLMConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"relative_max_distance must be an int > "
                                         r"relative_buckets // 2 = 3, got 2"):
        DecoderLMConfig(vocab_size=10, positions="relative", relative_buckets=6,
                        relative_max_distance=2)  # fmt: skip
    with pytest.raises(ValueError, match="relative_buckets must be an int >= 4"):
        EncoderConfig(vocab_size=10, relative_buckets=2)
