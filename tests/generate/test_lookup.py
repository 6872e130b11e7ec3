"""Prompt-lookup decoding gives greedy search's tokens, in fewer forwards when the output copies
the context: random-weight models of every position kind, a "successor" model whose greedy
output is known (so drafts are accepted, partly accepted or never made), EOS inside a draft,
the length limit inside a draft, SmolLM2 repeating a paragraph, and clear errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import nn

from qkv.generate import greedy, strip
from qkv.generate.lookup import LookupResult, find_draft, prompt_lookup
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer

V = 40
STYLES = {
    "gpt2": lambda: DecoderLMConfig.gpt2_style(V, d_model=32, num_layers=2, num_heads=4,
                                               max_len=96),
    "llama-gqa": lambda: DecoderLMConfig.llama_style(V, d_model=32, num_layers=2, num_heads=4,
                                                     num_kv_heads=2, max_len=96),
    "alibi": lambda: DecoderLMConfig(V, d_model=32, num_layers=2, num_heads=4, max_len=96,
                                     positions="alibi"),
    "window": lambda: DecoderLMConfig.llama_style(V, d_model=32, num_layers=2, num_heads=4,
                                                  max_len=96, window=5),
}  # fmt: skip
REPEATED = [1, *[5, 6, 7, 8, 9] * 3]  # drafts found at once
DISTINCT = [1, 2, 3, 4]  # no n-gram occurs twice


def _lm(style: str, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(STYLES[style]()).eval()


def _successor_lm(after: Callable[[int], int]) -> DecoderLM:
    """A model whose greedy choice after token ``t`` is ``after(t)``, whatever came before:
    attention and MLP outputs are zeroed, embeddings are one-hot and the head maps ``t`` to
    ``after(t)`` (logit 8 against 0)."""
    config = DecoderLMConfig.llama_style(V, d_model=64, num_layers=2, num_heads=4, max_len=96,
                                         tie_embeddings=False)  # fmt: skip
    model = DecoderLM(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.self_attn.out_proj.weight.zero_()
            block.ffn.down_proj.weight.zero_()
        model.embed.weight.copy_(torch.eye(V, 64))  # (V, E)
        model.lm_head.weight.zero_()
        for t in range(V):
            model.lm_head.weight[after(t), t] = 1.0  # (V, E)
    return model


def _cycle(tokens: list[int]) -> Callable[[int], int]:
    """``after``: each of ``tokens`` is followed by the next, the last by the first; any other
    token by ``t + 1``."""
    nxt = {a: b for a, b in zip(tokens, tokens[1:] + tokens[:1], strict=True)}
    return lambda t: nxt.get(t, (t + 1) % V)


def _period4() -> DecoderLM:
    """Cycles 9, 5, 6, 7 (period 4) after :data:`REPEATED` (period 5): drafts partly right."""
    return _successor_lm(_cycle([9, 5, 6, 7]))


def _greedy(model: nn.Module, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    return strip(greedy(model, [prompt], max_new_tokens=n, eos_id=eos), eos)[0]


def _check_stats(r: LookupResult, n: int) -> None:
    assert 0 <= r.accepted <= r.drafted, r
    assert 1 <= r.forwards <= n, r
    assert len(r.tokens) == r.forwards + r.accepted, f"no EOS: 1 + accepted per forward: {r}"


@pytest.mark.parametrize("prompt", [REPEATED, DISTINCT], ids=["repeated", "distinct"])
@pytest.mark.parametrize("style", list(STYLES))
def test_same_tokens_as_greedy(style, prompt):
    model = _lm(style)
    r = prompt_lookup(model, prompt, max_new_tokens=30)
    assert r.tokens == _greedy(model, prompt, 30), r
    _check_stats(r, 30)


@pytest.mark.parametrize("draft", [1, 2, 3, 4])
@pytest.mark.parametrize("ngram", [1, 2, 3, 4])
def test_ngram_and_draft_sizes(ngram, draft):
    for model in (_lm("llama-gqa", seed=1), _period4()):
        r = prompt_lookup(model, REPEATED, max_new_tokens=17, ngram=ngram, draft=draft)
        assert r.tokens == _greedy(model, REPEATED, 17), (ngram, draft, r)
        _check_stats(r, 17)
    assert r.accepted > 0 and r.forwards < 17, f"a cycling model accepts drafts: {r}"


def test_copying_model_accepts_every_draft():
    model = _successor_lm(_cycle([5, 6, 7, 8, 9]))
    r = prompt_lookup(model, REPEATED, max_new_tokens=40, ngram=3, draft=10)
    assert r.tokens == _greedy(model, REPEATED, 40) == [5, 6, 7, 8, 9] * 8
    assert r.accepted == r.drafted > 0, r
    # the prompt, then 10 drafted + 1 per forward: 1 + 11 + 11 + 11 + 6 tokens
    assert r.forwards == 5 and r.acceptance == 1.0, r


def test_partly_wrong_drafts_are_rejected():
    model = _period4()
    r = prompt_lookup(model, REPEATED, max_new_tokens=30, ngram=2, draft=4)
    assert r.tokens == _greedy(model, REPEATED, 30), r
    assert 0 < r.accepted < r.drafted and r.forwards < 30, r
    _check_stats(r, 30)


def test_no_repeats_no_drafts():
    model = _successor_lm(lambda t: (t + 1) % V)  # 5, 6, 7, ... never seen before
    r = prompt_lookup(model, DISTINCT, max_new_tokens=20)
    assert r.tokens == _greedy(model, DISTINCT, 20) == list(range(5, 25))
    assert (r.drafted, r.accepted, r.forwards) == (0, 0, 20), r


def test_eos_inside_a_draft():
    model = _successor_lm(_cycle([5, 6, 7, 8]))
    prompt = [5, 6, 7, 8] * 3
    r = prompt_lookup(model, prompt, max_new_tokens=20, ngram=3, eos_id=7)
    assert r.tokens == _greedy(model, prompt, 20, eos=7) == [5, 6], r
    # the prompt gives 5; the draft [6, 7] (cut after EOS) is accepted in the second forward
    assert (r.forwards, r.drafted, r.accepted) == (2, 2, 2), r


@pytest.mark.parametrize("eos", [None, 5, 8, 9])
def test_eos_anywhere(eos):
    model = _successor_lm(_cycle([5, 6, 7, 8, 9]))
    r = prompt_lookup(model, REPEATED, max_new_tokens=24, eos_id=eos)
    assert r.tokens == _greedy(model, REPEATED, 24, eos=eos), r
    assert eos not in r.tokens


@pytest.mark.parametrize("n", range(1, 13))
def test_max_new_tokens_inside_a_draft(n):
    model = _successor_lm(_cycle([5, 6, 7, 8, 9]))
    r = prompt_lookup(model, REPEATED, max_new_tokens=n, draft=10)
    assert r.tokens == _greedy(model, REPEATED, n) and len(r.tokens) == n, r
    _check_stats(r, n)


def test_tensor_prompt_and_eos_from_the_config():
    g = greedy(_lm("gpt2"), [REPEATED], max_new_tokens=12)[0].tolist()
    eos = g[4]  # a token greedy produces: it must stop there
    torch.manual_seed(0)  # the weights of _lm("gpt2")
    model = DecoderLM(replace(STYLES["gpt2"](), eos_id=eos)).eval()
    r = prompt_lookup(model, torch.tensor(REPEATED), max_new_tokens=12)
    assert r.tokens == _greedy(model, REPEATED, 12, eos=eos) == g[: g.index(eos)], r


@pytest.mark.parametrize(
    ("context", "ngram", "draft", "expected"),
    [
        ([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 3, 2, [4, 5]),  # the latest match
        ([1, 2, 3, 8, 5, 2, 3, 9, 1, 2, 3], 3, 3, [8, 5, 2]),  # the longest suffix wins
        ([1, 2, 3, 8, 5, 2, 3, 9, 1, 2, 3], 2, 1, [9]),
        ([4, 5, 6, 4, 5], 2, 7, [6, 4, 5, 6, 4, 5, 6]),  # a recent match repeats its period
        ([1, 1], 3, 3, [1, 1, 1]),
        ([1, 2, 3, 4], 4, 5, []),  # no suffix occurs earlier
        ([3], 2, 4, []),
    ],
)
def test_find_draft(context, ngram, draft, expected):
    assert find_draft(torch.tensor(context), ngram, draft) == expected


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 1.0}, "max_new_tokens"),
        ({"ngram": 0}, "ngram"),
        ({"ngram": True}, "ngram"),
        ({"draft": -1}, "draft"),
        ({"draft": "10"}, "draft"),
        ({"eos_id": V}, "eos_id"),
        ({"eos_id": -1}, "eos_id"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, V]}, "prompt"),
        ({"prompt": "hello"}, "prompt"),
        ({"prompt": [1.0, 2.0]}, "prompt"),
        ({"prompt": torch.ones(1, 3, dtype=torch.long)}, "prompt"),
        ({"prompt": [1] * 90, "max_new_tokens": 7}, "max_new_tokens"),
    ],
)
def test_bad_arguments(kwargs, name):
    args = {"prompt": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=name):
        prompt_lookup(_lm("gpt2"), args.pop("prompt"), **args)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Linear(3, 3),
        lambda: Seq2SeqTransformer(Seq2SeqConfig(V, V, d_model=32, num_heads=4, d_ff=64)),
    ],
    ids=["no-cache", "seq2seq"],
)
def test_models_that_are_not_decoder_lms(make):
    with pytest.raises(ValueError, match="model must be"):
        prompt_lookup(make(), [1, 2, 3])


@pytest.mark.slow
def test_smollm2_repeating_a_paragraph():
    import qkv.pretrained

    bundle = qkv.pretrained.load("SmolLM2-135M-Instruct")
    text = (
        "The river runs past the old mill, under the stone bridge and through the town, "
        "where children throw bread to the ducks every morning before school."
    )
    ids = bundle.prompt_ids(f"{text}\n\nRepeat the paragraph above exactly.")
    r = prompt_lookup(bundle.model, ids, max_new_tokens=24, eos_id=bundle.eos_id)
    assert r.tokens == _greedy(bundle.model, ids, 24, eos=bundle.eos_id), r
    assert r.accepted > 0 and r.forwards < len(r.tokens), r
