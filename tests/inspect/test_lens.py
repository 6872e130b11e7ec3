"""Logit lens and direct logit attribution, against hand-written norms and the model's logits;
their heatmaps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from analysis_models import V, encoder, gpt2, ids, llama, seq2seq

import qkv.inspect as qi
from helpers import assert_close


def test_logit_lens_rows_are_the_readout_of_each_layer():
    model, x = gpt2(), ids()
    logits, cache = qi.run_with_cache(model, x)
    lens = qi.logit_lens(cache)
    assert lens.logits.shape == (3, 2, 7, V)
    assert_close(lens.logits[-1], logits, atol=1e-5, name="last lens row vs model logits")
    norm = model.norm_f
    for l in range(3):
        resid = cache.resid(l)  # (B, T, E)
        normed = F.layer_norm(resid, (24,), norm.weight, norm.bias, norm.eps)
        expected = normed @ model.embed.weight.T  # tied unembedding
        assert_close(lens.logits[l], expected, atol=1e-5, name=f"lens row {l} by hand")
    probs, top = lens.top(3)
    assert probs.shape == top.shape == (3, 2, 7, 3)
    assert torch.equal(top[..., 0], lens.logits.argmax(-1))
    p_next = lens.prob_of(x)  # (L+1, B, T)
    assert_close(p_next[1, 1, 4], lens.probs()[1, 1, 4, x[1, 4]], atol=1e-7, name="prob_of")


def test_logit_lens_needs_an_unembedding():
    _, cache = qi.run_with_cache(encoder("pre"), ids())
    with pytest.raises(ValueError, match="no lm_head"):
        qi.logit_lens(cache)
    head = torch.nn.Linear(24, 5, bias=False)
    assert qi.logit_lens(cache, unembed=head).logits.shape == (3, 2, 7, 5)
    with pytest.raises(TypeError, match="unembed must be"):
        qi.logit_lens(cache, unembed="head")


CASES = {
    "gpt2": (gpt2, lambda: (ids(),)),
    "llama": (llama, lambda: (ids(),)),
    "seq2seq": (seq2seq, lambda: (ids(2, 6, 1), ids(2, 5, 2))),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("position", [-1, 2])
def test_attribution_sums_to_the_logit_difference(case, position):
    make, inputs_fn = CASES[case]
    model, inputs = make(), inputs_fn()
    logits, cache = qi.run_with_cache(model, *inputs)
    attr = qi.direct_logit_attribution(cache, (3, 8), position=position)
    expected = logits[:, position, 3] - logits[:, position, 8]  # (B,)
    assert_close(attr.total(), expected, atol=1e-5, rtol=1e-5,
                 name=f"{case}: sum of attributions vs logit difference")  # fmt: skip
    per_seq = torch.tensor([[1, 2], [4, 0]])
    attr2 = qi.direct_logit_attribution(cache, per_seq, position=position, heads=False)
    expected2 = torch.stack([logits[b, position, per_seq[b, 0]] - logits[b, position, per_seq[b, 1]]
                             for b in range(2)])  # fmt: skip
    assert_close(attr2.total(), expected2, atol=1e-5, rtol=1e-5, name=f"{case} per sequence")
    single = qi.direct_logit_attribution(cache, 5, position=position)
    assert_close(single.total(), logits[:, position, 5], atol=1e-5, rtol=1e-5,
                 name=f"{case} one token's logit")  # fmt: skip


def test_attribution_of_one_head_by_hand():
    """L1H2 of the GPT-2-style model: its write, LayerNorm's centring and frozen scale, then
    the unembedding direction, all spelled out."""
    model, x = gpt2(), ids()
    _, cache = qi.run_with_cache(model, x)
    attr = qi.direct_logit_attribution(cache, (3, 8))
    z = cache["blocks.1.self_attn.hook_out"][:, 2, -1]  # (B, D)
    W_O = model.blocks[1].self_attn.out_proj.weight.detach()[:, 16:24]  # (E, D)
    write = z @ W_O.T  # (B, E)
    final = cache["blocks.1.hook_resid_post"][:, -1]  # (B, E)
    sigma = torch.sqrt(final.var(-1, unbiased=False) + model.norm_f.eps)  # (B,)
    centred = (write - write.mean(-1, keepdim=True)) / sigma[:, None] * model.norm_f.weight
    direction = model.embed.weight[3] - model.embed.weight[8]
    assert_close(attr["L1H2"], centred @ direction, atol=1e-6, name="L1H2 by hand")
    assert_close(attr.heads()[1, 2], attr["L1H2"], atol=0, name="heads() table")
    bias = model.norm_f.bias @ direction
    assert_close(attr["bias"], bias.expand(2), atol=1e-6, name="norm bias term")


def test_attribution_errors():
    _, cache = qi.run_with_cache(gpt2(), ids())
    with pytest.raises(ValueError, match=r"token ids in \[0, 37\)"):
        qi.direct_logit_attribution(cache, (3, 99))
    with pytest.raises(TypeError, match="tokens must be"):
        qi.direct_logit_attribution(cache, 1.5)
    with pytest.raises(ValueError, match="position must be"):
        qi.direct_logit_attribution(cache, 3, position=7)
    with pytest.raises(KeyError, match="no term"):
        qi.direct_logit_attribution(cache, 3)["L9H9"]


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_lens_and_attribution_plots(tmp_path):
    model, x = gpt2(), ids()
    _, cache = qi.run_with_cache(model, x)
    lens = qi.logit_lens(cache)
    out = qi.plot_logit_lens(lens, tmp_path / "lens.png", tokens=[f"t{i}" for i in range(7)],
                             token_names=lambda i: f"<{i}>")  # fmt: skip
    assert _is_png(out)
    assert _is_png(qi.plot_logit_lens(lens, tmp_path / "lens_next.png", targets=x[0], batch=0))
    attr = qi.direct_logit_attribution(cache, (3, 8))
    assert _is_png(qi.plot_head_attribution(attr, tmp_path / "sub" / "dla.png"))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dla.png", "lens.png",
                                                           "lens_next.png", "sub"]  # fmt: skip
    with pytest.raises(ValueError, match="batch must be"):
        qi.plot_logit_lens(lens, tmp_path / "x.png", batch=5)
    with pytest.raises(ValueError, match="targets must be"):
        qi.plot_logit_lens(lens, tmp_path / "x.png", targets=x)
    with pytest.raises(ValueError, match="values must be a non-empty 2-D tensor"):
        qi.plot_heatmap(torch.zeros(3), tmp_path / "x.png")
    with pytest.raises(ValueError, match="NaN"):
        qi.plot_heatmap(torch.tensor([[1.0, float("nan")]]), tmp_path / "x.png")
    with pytest.raises(ValueError, match="col_ticks must have 2 labels"):
        qi.plot_heatmap(torch.ones(2, 2), tmp_path / "x.png", col_ticks=["a"])
    assert not (tmp_path / "x.png").exists()


def test_logit_lens_last_row_is_the_soft_capped_logits():
    from qkv.models import DecoderLM, DecoderLMConfig

    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4,
                                      logit_softcap=0.5)).eval()
    logits, cache = qi.run_with_cache(model, torch.randint(0, 40, (2, 6)))
    lens = qi.logit_lens(cache)
    err = (lens.logits[-1] - logits).abs().max().item()
    assert err < 1e-5, f"lens' last row vs the soft-capped logits: {err:.2e}"
    assert lens.logits.abs().max() <= 0.5
