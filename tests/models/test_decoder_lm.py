"""DecoderLM invariances: causality, KV-cache decoding equals recomputation, left-padded
batches equal per-example runs (with and without a cache), weight tying, gradients to every
parameter, and clear errors for bad inputs."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, assert_close
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn import KVCache

V = 50
STYLES = {
    "gpt2": lambda: DecoderLMConfig.gpt2_style(V, d_model=32, num_layers=2, num_heads=4,
                                               max_len=64),
    "llama-gqa-rope": lambda: DecoderLMConfig.llama_style(V, d_model=48, num_layers=2,
                                                          num_heads=6, num_kv_heads=2),
    "alibi": lambda: DecoderLMConfig(V, d_model=32, num_layers=2, num_heads=4,
                                     positions="alibi"),
    "sinusoidal-post-relu": lambda: DecoderLMConfig(
        V, d_model=32, num_layers=2, num_heads=4, positions="sinusoidal", norm="post",
        activation="relu", tie_embeddings=False),
}
F32 = TOL[torch.float32]


def _model(style, seed=0):
    torch.manual_seed(seed)
    return DecoderLM(STYLES[style]()).eval()


def _ids(shape, seed):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("style", STYLES)
def test_outputs_do_not_depend_on_later_tokens(style):
    model = _model(style)
    ids = _ids((2, 16), 1)
    t = 9
    changed = ids.clone()
    changed[:, t + 1 :] = _ids((2, 16 - t - 1), 2)
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert_close(a[:, : t + 1], b[:, : t + 1], **F32, name="logits up to t")
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # later positions do change


@pytest.mark.parametrize("max_len", [None, 20])
@pytest.mark.parametrize("style", STYLES)
def test_cached_decoding_equals_full_recomputation(style, max_len):
    model = _model(style)
    ids = _ids((3, 15), 3)
    chunks = [5, 1, 1, 3, 1, 1, 1, 1, 1]  # a prompt, single tokens, a multi-token chunk
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(max_len=max_len)
        steps, start = [], 0
        for n in chunks:
            steps.append(model(ids[:, start : start + n], cache=cache))
            start += n
    assert cache.length == 15
    assert_close(torch.cat(steps, 1), full, **F32, name=f"cached decoding ({style})")


def _left_padded(prompts, pad_id=0):
    """Left-pad token lists into ids (B, L), attention_mask (B, L) and positions (B, L)."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :] = torch.tensor(p)
        mask[b, L - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # real tokens count from 0
    return ids, mask, positions


@pytest.mark.parametrize("style", STYLES)
def test_left_padded_batch_equals_per_example_runs(style):
    model = _model(style)
    prompts = [_ids((n,), 10 + n).tolist() for n in (9, 5, 2)]
    continuation = _ids((3, 3), 7)  # three more tokens per row, fed one at a time
    ids, mask, positions = _left_padded(prompts)
    L = ids.shape[1]
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, positions=positions)
        cache = model.new_cache()
        model(ids, attention_mask=mask, positions=positions, cache=cache)
        steps = []
        for t in range(3):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
            positions = positions[:, -1:] + 1
            steps.append(model(continuation[:, t : t + 1], attention_mask=mask,
                               positions=positions, cache=cache))
        for b, p in enumerate(prompts):
            alone = model(torch.tensor([p + continuation[b].tolist()]))[0]  # (n + 3, V)
            n = len(p)
            assert_close(batched[b, L - n :], alone[:n], **F32, name=f"row {b} prompt logits")
            cached = torch.cat([s[b] for s in steps])  # (3, V)
            assert_close(cached, alone[n:], **F32, name=f"row {b} cached continuation")


def test_tied_embeddings_share_one_tensor():
    model = _model("gpt2")
    assert model.lm_head.weight is model.embed.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(_ids((2, 6), 4)).square().mean().backward()
    before = model.embed.weight.detach().clone()
    opt.step()
    assert model.lm_head.weight is model.embed.weight
    assert not torch.equal(model.embed.weight, before)  # the shared tensor was updated
    untied = DecoderLM(DecoderLMConfig.gpt2_style(V, d_model=32, num_layers=2, max_len=64,
                                                  tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.weight
    assert untied.num_parameters() == model.num_parameters() + V * 32


@pytest.mark.parametrize("style", STYLES)
def test_gradients_reach_every_parameter(style):
    model = _model(style).train()
    out = model(_ids((2, 7), 5))
    (out * torch.randn_like(out)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_gpt2_and_llama_styles_are_configurations():
    gpt = DecoderLMConfig.gpt2_style(V)
    llama = DecoderLMConfig.llama_style(V, num_kv_heads=2)
    assert (gpt.positions, gpt.norm_kind, gpt.activation, gpt.bias) == (
        "learned", "layernorm", "gelu_tanh", True)
    assert (llama.positions, llama.norm_kind, llama.activation, llama.bias) == (
        "rope", "rmsnorm", "swiglu", False)
    assert llama.ffn_dim == 688  # ceil(8·256/3) = 683, rounded up to a multiple of 8
    assert DecoderLMConfig.llama_style(V, d_ff=100).ffn_dim == 100
    m = DecoderLM(DecoderLMConfig.llama_style(V, d_model=32, num_layers=1))
    assert m.pos is None and m.blocks[0].self_attn.rope is not None
    assert {n for n, _ in m.named_children()} == {"embed", "drop", "blocks", "norm_f", "lm_head"}


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m: m(_ids((2, 5), 0) + V), ValueError,
         r"input_ids must lie in \[0, vocab_size=50\), got values in \[5\d, \d+\]"),
        (lambda m: m(torch.tensor([[-1, 2]])), ValueError, r"input_ids must lie in .*\[-1, 2\]"),
        (lambda m: m(torch.zeros(2, 5)), TypeError, r"input_ids must hold integer token ids"),
        (lambda m: m(torch.zeros(5, dtype=torch.long)), ValueError,
         r"input_ids must have shape \(B, T\) with B, T >= 1, got \(5\)"),
        (lambda m: m(torch.zeros(1, 65, dtype=torch.long)), ValueError,
         r"input_ids has T=65 tokens, which goes beyond max_len=64"),
        (lambda m: m(torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4)),
         ValueError, r"attention_mask must have shape \(B, S\) = \(2, 5\), got \(2, 4\)"),
        (lambda m: m(torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.tensor([[1, 2]])),
         ValueError, r"attention_mask must be boolean or hold only 0 and 1"),
        (lambda m: m(torch.zeros(1, 3, dtype=torch.long), positions=torch.tensor([0, 1])),
         ValueError, r"positions must have shape \(B, T\) = \(1, 3\) or \(T,\), got \(2\)"),
        (lambda m: m(torch.zeros(1, 2, dtype=torch.long), positions=torch.tensor([[63, 64]])),
         ValueError, r"positions must lie in \[0, max_len=64 \(learned positions\)\), got "),
        (lambda m: m(torch.zeros(1, 2, dtype=torch.long), positions=torch.tensor([0.0, 1.0])),
         TypeError, r"positions must be an integer tensor"),
        (lambda m: m(torch.zeros(1, 2, dtype=torch.long), cache=[]), TypeError,
         r"cache must be a qkv.nn.KVCache"),
        (lambda m: m(torch.zeros(1, 2, dtype=torch.long), cache=KVCache(3)), ValueError,
         r"cache has 3 layers but the model has 2"),
        (lambda m: m.new_cache(batch_size=0), ValueError, r"batch_size must be a positive int"),
        (lambda m: DecoderLM({"vocab_size": 5}), TypeError, r"config must be a DecoderLMConfig"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(_model("gpt2"))


def test_learned_positions_limit_counts_cached_tokens():
    model = _model("gpt2")
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(1, 60, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=r"T=5 tokens after 60 cached tokens, which goes "
                                             r"beyond max_len=64"):
            model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
