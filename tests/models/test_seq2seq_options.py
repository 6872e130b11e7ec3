"""Seq2SeqConfig's options for pretrained encoder-decoders, each against a reference of its own.

* ``RelativePositionBias``: T5's bucket table, entry by entry, and equal to
  ``score_mods.relative_bias`` run through ``qkv.flex_attention``; cached rows = full rows.
* ``positions="relative"``: a shared bias per stack (gradients checked numerically in float64),
  cached decoding equal to recomputation.
* ``sinusoidal_layout="split"``: Marian's / fairseq's formula in NumPy float64.
* ``position_offset``: row ``p + offset`` of the learned table.
* ``embed_scale``, ``embed_norm``, ``output_bias``, ``head_scale``, ``norm_kind``,
  ``bias``, ``d_head``, ``attn_scale``: each equal to the computation written out by hand.
* Config validation names the field.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import TOL, assert_close
from qkv.attention.score_mods import relative_bias, relative_position_bucket
from qkv.models import Seq2SeqConfig, Seq2SeqTransformer
from qkv.models.seq2seq_positions import SplitSinusoidalEncoding
from qkv.nn.positions import SinusoidalPositionalEncoding
from qkv.nn.relative_bias import RelativePositionBias

F32 = TOL[torch.float32]
V = 37


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(d_model=24, num_heads=3, d_ff=40, dropout=0.0, max_len=32,
                num_encoder_layers=2, num_decoder_layers=2)  # fmt: skip
    return Seq2SeqTransformer(Seq2SeqConfig(V, V, **{**base, **kw})).eval()


def _ids(shape, seed, low=3):
    return torch.randint(low, V, shape, generator=torch.Generator().manual_seed(seed))


# --- the relative bias module -----------------------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("T", "S", "offset"), [(5, 5, 0), (1, 9, 8), (7, 40, 33), (200, 200, 0)])
def test_relative_bias_is_the_table_at_each_bucket(bidirectional, T, S, offset):
    torch.manual_seed(0)
    mod = RelativePositionBias(3, num_buckets=16, max_distance=50, bidirectional=bidirectional)
    bias = mod(T, S, offset)
    assert bias.shape == (1, 3, T, S)
    expected = torch.empty(1, 3, T, S)
    for i in range(T):
        rel = torch.arange(S) - (offset + i)  # key position minus query position
        buckets = relative_position_bucket(rel, 16, 50, bidirectional)  # (S,)
        expected[0, :, i, :] = mod.weight.detach()[buckets].T  # (H, S)
    assert_close(bias, expected, atol=0.0, name="relative bias")


def test_relative_bias_with_an_offset_is_the_last_rows_of_the_full_bias():
    mod = RelativePositionBias(2, bidirectional=False)
    full = mod(9, 9)
    assert_close(mod(1, 9, 8), full[:, :, 8:], atol=0.0, name="last row")
    assert_close(mod(3, 9, 6), full[:, :, 6:], atol=0.0, name="last three rows")


def test_relative_bias_as_a_mask_equals_the_flex_score_mod():
    """The dense bias added to the scores = ``score_mods.relative_bias`` on the same table."""
    import qkv

    torch.manual_seed(1)
    mod = RelativePositionBias(4, num_buckets=8, max_distance=20, bidirectional=True)
    q, k, v = (torch.randn(2, 4, 11, 8) for _ in range(3))
    dense = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mod(11, 11), scale=1.0)
    mod_fn = relative_bias(mod.weight.detach(), 8, 20, bidirectional=True)
    flex = qkv.flex_attention(q, k, v, score_mod=mod_fn, scale=1.0)
    assert_close(dense, flex, **F32, name="dense bias vs flex score_mod")


def test_relative_bias_equals_transformers_t5_compute_bias():
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    for is_decoder in (False, True):
        cfg = transformers.T5Config(d_model=16, d_kv=4, num_heads=4, is_decoder=is_decoder,
                                    relative_attention_num_buckets=32,
                                    relative_attention_max_distance=128)  # fmt: skip
        ref = T5Attention(cfg, has_relative_attention_bias=True).eval()
        mod = RelativePositionBias(4, 32, 128, bidirectional=not is_decoder)
        with torch.no_grad():
            mod.weight.copy_(ref.relative_attention_bias.weight)
            expected = ref.compute_bias(150, 150)
        assert_close(mod(150, 150), expected, atol=0.0, name=f"T5 bias, decoder={is_decoder}")


def test_relative_bias_bad_arguments():
    with pytest.raises(ValueError, match="num_heads"):
        RelativePositionBias(0)
    with pytest.raises(ValueError, match="num_buckets"):
        RelativePositionBias(2, num_buckets=2)
    with pytest.raises(ValueError, match="offset"):
        RelativePositionBias(2)(3, 3, -1)


# --- positions="relative" in the model -----------------------------------------------------------


def test_relative_positions_one_table_per_stack_and_cached_decoding():
    model = _model(positions="relative", relative_buckets=8, relative_max_distance=16)
    assert model.src_pos is None and model.tgt_pos is None
    assert model.src_rel_bias.bidirectional and not model.tgt_rel_bias.bidirectional
    n_bias = sum(p.numel() for n, p in model.named_parameters() if "rel_bias" in n)
    assert n_bias == 2 * 8 * 3  # one (buckets, H) table per stack, not per block
    src, tgt = _ids((2, 7), 1), _ids((2, 6), 2)
    src[1, 5:] = 0  # padding
    full = model(src, tgt)
    mask = model.make_src_mask(src)
    memory = model.encode(src, mask)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, mask, cache=cache) for t in range(6)]
    assert_close(torch.cat(steps, dim=1), full, **F32, name="cached vs full logits")


def test_relative_positions_move_the_output():
    """Positions matter: swapping two source tokens changes the output (no bag of words)."""
    model = _model(positions="relative", relative_buckets=8, relative_max_distance=16)
    src, tgt = torch.tensor([[5, 6, 7, 8, 9, 10]]), _ids((1, 4), 4)
    swapped = src[:, [1, 0, 2, 3, 4, 5]]
    assert (model(src, tgt) - model(swapped, tgt)).abs().max() > 1e-4


def test_relative_bias_gradients_match_finite_differences():
    model = _model(positions="relative", relative_buckets=4, relative_max_distance=6,
                   d_model=8, num_heads=2, d_ff=8, num_encoder_layers=1,
                   num_decoder_layers=1).double()  # fmt: skip
    src, tgt = _ids((1, 5), 5), _ids((1, 4), 6)
    tables = (model.src_rel_bias.weight, model.tgt_rel_bias.weight)

    def f(src_table, tgt_table):
        params = {"src_rel_bias.weight": src_table, "tgt_rel_bias.weight": tgt_table}
        return torch.func.functional_call(model, params, (src, tgt)).sum()

    inputs = tuple(t.detach().clone().requires_grad_(True) for t in tables)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


# --- absolute positions: layout and offset -----------------------------------------------------


@pytest.mark.parametrize("E", [8, 9, 24])
def test_split_sinusoidal_layout_is_marians_formula(E):
    P = 50
    pos = np.arange(P)[:, None] / np.power(10000, 2 * (np.arange(E) // 2) / E)[None, :]
    sentinel = (E + 1) // 2
    expected = np.empty((P, E))
    expected[:, :sentinel] = np.sin(pos[:, 0::2])
    expected[:, sentinel:] = np.cos(pos[:, 1::2])
    split = SplitSinusoidalEncoding(E, 16)  # grows past its first 16 rows
    assert_close(split.table(P, dtype=torch.float64), expected, **TOL[torch.float64],
                 name="split sinusoids, float64")  # fmt: skip
    assert_close(split.table(10, 40), expected[40:], atol=1e-6, name="split sinusoids, offset")
    interleaved = SinusoidalPositionalEncoding(E, 16).table(P, dtype=torch.float64)
    assert_close(split.table(P, dtype=torch.float64),
                 torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], -1),
                 atol=0.0, name="same values as interleaved")  # fmt: skip


def test_model_uses_the_split_layout():
    model = _model(sinusoidal_layout="split")
    assert isinstance(model.src_pos, SplitSinusoidalEncoding)
    assert isinstance(model.tgt_pos, SplitSinusoidalEncoding)
    assert not isinstance(_model().src_pos, SplitSinusoidalEncoding)


def test_position_offset_reads_rows_after_the_offset():
    model = _model(positions="learned", position_offset=2, max_len=10)
    assert model.src_pos.weight.shape == (12, 24) and model.position_limit == 10
    plain = _model(positions="learned", max_len=10)
    plain.load_state_dict({**model.state_dict(),
                           "src_pos.weight": model.src_pos.weight[2:],
                           "tgt_pos.weight": model.tgt_pos.weight[2:]})  # fmt: skip
    src, tgt = _ids((2, 10), 7), _ids((2, 10), 8)
    assert_close(model(src, tgt), plain(src, tgt), **F32, name="offset 2 vs shifted table")
    with pytest.raises(ValueError, match="max_len=10"):
        model(_ids((1, 11), 9), tgt[:1])


# --- embedding, output and block options -------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_embedding_scale_and_norm_written_out(scale):
    model = _model(embed_scale=scale, embed_norm=True, positions="learned")
    assert model.embed_scale == scale
    src = _ids((2, 6), 10)
    x = model.src_embed(src) * scale + model.src_pos.weight[:6]  # (B, S, E)
    x = model.src_embed_norm(x)
    for block in model.encoder_blocks:
        x = block(x, mask=model.make_src_mask(src))
    assert_close(model.encode(src), x, **F32, name=f"encoder, embedding norm, scale {scale}")
    scaled = _model()  # default: sqrt(E)
    assert scaled.embed_scale == math.sqrt(24) and scaled.src_embed_norm is None


def test_output_bias_head_scale_norm_kind_and_no_biases():
    model = _model(output_bias=False, head_scale=0.25, norm="pre", norm_kind="rmsnorm",
                   bias=False, d_head=5)  # fmt: skip
    assert model.lm_head.bias is None
    assert not [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert isinstance(model.decoder_norm, torch.nn.RMSNorm)
    assert model.encoder_blocks[0].self_attn.q_proj.weight.shape == (15, 24)  # H·D = 3·5
    src, tgt = _ids((2, 5), 11), _ids((2, 4), 12)
    memory = model.encode(src)
    y = model.tgt_embed(tgt) * model.embed_scale + model.tgt_pos.table(4)
    for block in model.decoder_blocks:
        y = block(y, memory, is_causal=True, context_mask=model.make_src_mask(src))
    expected = model.decoder_norm(y) @ model.lm_head.weight.T * 0.25
    assert_close(model(src, tgt), expected, **F32, name="scaled output without bias")


def test_attention_scale_equals_prescaled_queries():
    """``attn_scale=s`` on ``q·k`` = the default ``1/sqrt(D)`` with queries times
    ``s·sqrt(D)`` (every self- and cross-attention)."""
    scaled = _model(attn_scale=1.0, d_head=6)
    plain = _model(d_head=6)
    plain.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        for block in [*plain.encoder_blocks, *plain.decoder_blocks]:
            for attn in (block.self_attn, block.cross_attn):
                if attn is not None:
                    attn.q_proj.weight *= math.sqrt(6)
                    attn.q_proj.bias *= math.sqrt(6)
    src, tgt = _ids((2, 7), 13), _ids((2, 5), 14)
    assert_close(scaled(src, tgt), plain(src, tgt), **F32, name="scale 1.0 vs prescaled q")
    assert (scaled(src, tgt) - _model(d_head=6)(src, tgt)).abs().max() > 1e-3


@pytest.mark.parametrize(("field", "value", "message"), [
    ("sinusoidal_layout", "sincos", "sinusoidal_layout must be one of"),
    ("position_offset", -1, "position_offset must be an int >= 0"),
    ("relative_buckets", 3, "relative_buckets must be an int >= 4"),
    ("relative_max_distance", 16, "relative_max_distance must be an int > relative_buckets"),
    ("attn_scale", 0.0, "attn_scale must be a finite number > 0"),
    ("embed_scale", -1.0, "embed_scale must be a finite number > 0"),
    ("head_scale", float("nan"), "head_scale must be a finite number > 0"),
    ("norm_kind", "batchnorm", "norm_kind must be one of"),
    ("d_head", 0, "d_head must be a positive int or None"),
    ("embed_norm", 1, "embed_norm must be a bool"),
])  # fmt: skip
def test_bad_options_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        Seq2SeqConfig(V, V, **{field: value})


def test_config_round_trips_with_the_new_fields():
    cfg = Seq2SeqConfig(V, V, positions="relative", norm_kind="rmsnorm", bias=False,
                        position_offset=2, sinusoidal_layout="split", head_scale=0.5)  # fmt: skip
    assert Seq2SeqConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in Seq2SeqConfig(V, V).to_dict().items()
           if k in ("src_vocab_size", "tgt_vocab_size", "d_model")}  # an older checkpoint's
    assert Seq2SeqConfig.from_dict(old).embed_scale is None  # sqrt(E), as before
