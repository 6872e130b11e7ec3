"""Greedy search, sampling and streaming on real qkv models: the KV cache equals recomputation,
a batch of different-length prompts equals its rows one at a time, EOS stops a row, seeds
reproduce, the limits of temperature and top-k give greedy, and errors are clear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.data import CharTokenizer
from qkv.generate import (
    beam_search,
    complete,
    generate,
    greedy,
    sample,
    stream,
    strip,
    translate,
)
from qkv.generate.args import special_ids
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer

V = 40
LM_STYLES = {
    "gpt2": lambda: DecoderLMConfig.gpt2_style(V, d_model=32, num_layers=2, num_heads=4,
                                               max_len=64),
    "llama-gqa": lambda: DecoderLMConfig.llama_style(V, d_model=32, num_layers=2, num_heads=4,
                                                     num_kv_heads=2, max_len=64),
    "alibi": lambda: DecoderLMConfig(V, d_model=32, num_layers=2, num_heads=4, max_len=64,
                                     positions="alibi"),
}  # fmt: skip
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 10, 11, 12, 13, 14, 15], [1, 20, 21]]
SOURCES = [[5, 6, 7, 2], [8, 2], [9, 10, 11, 12, 13, 14, 2], [30, 31, 2]]


def _lm(style: str = "gpt2", seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(LM_STYLES[style]()).eval()


def _s2s(seed: int = 0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    config = Seq2SeqConfig(V, V, d_model=32, num_heads=4, d_ff=64, dropout=0.0, max_len=64)
    return Seq2SeqTransformer(config).eval()


def _model_and_inputs(kind: str):
    return (_lm(), PROMPTS) if kind == "lm" else (_s2s(), SOURCES)


def _greedy_by_recomputation(model, inputs, n: int, eos: int | None) -> list[int]:
    """Greedy decoding that reruns the whole model on the whole sequence at every step."""
    out: list[int] = []
    for _ in range(n):
        if isinstance(model, Seq2SeqTransformer):
            src, tgt = torch.tensor([inputs]), torch.tensor([[1, *out]])
            logits = model(src, tgt)[0, -1]
        else:
            logits = model(torch.tensor([inputs + out]))[0, -1]
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
    return out


@pytest.mark.parametrize("style", [*LM_STYLES, "seq2seq"])
def test_greedy_with_cache_equals_recomputation(style):
    model = _s2s() if style == "seq2seq" else _lm(style)
    inputs = SOURCES if style == "seq2seq" else PROMPTS
    out = greedy(model, inputs, max_new_tokens=12, eos_id=None)
    # eos_id=None takes the config's EOS (an encoder-decoder has one): a row that draws it
    # (seen with CUDA's initial weights) ends, and is filled to the limit.
    eos, _, _, fill = special_ids(model, None, None, None, seq2seq=style == "seq2seq")
    for b, row in enumerate(inputs):
        expected = _greedy_by_recomputation(model, row, 12, eos)
        expected += [fill] * (12 - len(expected))
        assert out[b].tolist() == expected, f"row {b}: cached {out[b].tolist()} vs {expected}"


def _eos_from_first_row(model, inputs) -> int:
    """A token that row 0 generates at step 3, so that EOS really stops some rows."""
    return int(greedy(model, inputs, max_new_tokens=6, eos_id=None)[0, 3])


def _run(method: str, model, inputs, eos: int, **kw):
    if method == "greedy":
        return greedy(model, inputs, max_new_tokens=10, eos_id=eos, pad_id=0, **kw)
    if method == "sample":
        seed = kw.pop("seed", 11)
        return sample(model, inputs, max_new_tokens=10, eos_id=eos, pad_id=0, seed=seed,
                      temperature=1.3, top_k=20, top_p=0.95, **kw)  # fmt: skip
    return beam_search(model, inputs, max_new_tokens=10, eos_id=eos, pad_id=0, beam_size=3, **kw)


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_batch_equals_one_at_a_time(kind, method):
    model, inputs = _model_and_inputs(kind)
    eos = _eos_from_first_row(model, inputs)
    batch = _run(method, model, inputs, eos)
    for b, row in enumerate(inputs):
        extra = {"seed": 11 + b} if method == "sample" else {}
        alone = _run(method, model, [row], eos, **extra)[0]
        got = batch[b]
        assert got[: alone.numel()].tolist() == alone.tolist(), f"{method} row {b}"
        assert bool((got[alone.numel() :] == 0).all()), f"{method} row {b}: tail not padding"


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_rows_stop_at_eos_and_are_padded(kind):
    model, inputs = _model_and_inputs(kind)
    eos = _eos_from_first_row(model, inputs)
    out = greedy(model, inputs, max_new_tokens=10, eos_id=eos, pad_id=0)
    row0 = out[0].tolist()
    stop = row0.index(eos)
    assert stop <= 3 and all(t == 0 for t in row0[stop + 1 :]), row0
    for row in strip(out, eos):
        assert eos not in row
    assert out.shape[1] <= 10


def test_no_eos_runs_to_the_limit():
    out = greedy(_lm(), PROMPTS, max_new_tokens=7, eos_id=None)
    assert out.shape == (len(PROMPTS), 7)


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_sampling_limits_equal_greedy(kind):
    model, inputs = _model_and_inputs(kind)
    expected = greedy(model, inputs, max_new_tokens=10, eos_id=None)
    for kwargs in (dict(temperature=0.0), dict(temperature=1e-4), dict(temperature=1.0, top_k=1)):
        got = sample(model, inputs, max_new_tokens=10, eos_id=None, seed=3, **kwargs)
        assert torch.equal(got, expected), f"{kwargs}: {got.tolist()} vs {expected.tolist()}"


def test_same_seed_same_samples_other_seed_other_samples():
    model = _lm()
    a = sample(model, PROMPTS, max_new_tokens=12, eos_id=None, seed=42, temperature=1.5)
    b = sample(model, PROMPTS, max_new_tokens=12, eos_id=None, seed=42, temperature=1.5)
    c = sample(model, PROMPTS, max_new_tokens=12, eos_id=None, seed=43, temperature=1.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stream_yields_the_tokens_of_greedy_and_sample():
    model = _lm()
    eos = _eos_from_first_row(model, PROMPTS[:1])
    full = greedy(model, PROMPTS[:1], max_new_tokens=10, eos_id=eos)
    assert list(stream(model, PROMPTS[0], max_new_tokens=10, eos_id=eos)) == strip(full, eos)[0]
    sampled = sample(model, PROMPTS[:1], max_new_tokens=10, eos_id=eos, seed=5, temperature=2.0)
    streamed = stream(model, PROMPTS[0], max_new_tokens=10, eos_id=eos, seed=5, temperature=2.0)
    assert list(streamed) == strip(sampled, eos)[0]


def test_stream_is_lazy():
    calls = []
    model = _lm()
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    it = stream(model, PROMPTS[0], max_new_tokens=50, eos_id=None)
    assert calls == []
    next(it), next(it)
    assert len(calls) == 2, "two tokens should cost two forward passes (prompt, one step)"
    handle.remove()


def test_generate_dispatches():
    model = _lm()
    assert torch.equal(generate(model, PROMPTS, max_new_tokens=5), greedy(model, PROMPTS, max_new_tokens=5))
    assert torch.equal(
        generate(model, PROMPTS, max_new_tokens=5, temperature=0.8, seed=1),
        sample(model, PROMPTS, max_new_tokens=5, temperature=0.8, seed=1),
    )
    assert torch.equal(
        generate(model, PROMPTS, max_new_tokens=5, beam_size=2),
        beam_search(model, PROMPTS, max_new_tokens=5, beam_size=2),
    )
    with pytest.raises(ValueError, match=r"beam_size=2 searches, temperature=0.5 samples"):
        generate(model, PROMPTS, beam_size=2, temperature=0.5)


def test_tensor_inputs_equal_list_inputs():
    model = _lm()
    ids = torch.tensor([[1, 5, 6], [1, 7, 8]])
    assert torch.equal(greedy(model, ids, max_new_tokens=4), greedy(model, ids.tolist(), max_new_tokens=4))
    s2s = _s2s()
    src = torch.tensor([[5, 6, 2], [8, 2, 0]])  # right-padded with pad_id 0
    assert torch.equal(
        greedy(s2s, src, max_new_tokens=4), greedy(s2s, [[5, 6, 2], [8, 2]], max_new_tokens=4)
    )


def test_translate_and_complete_round_trip_text():
    tok = CharTokenizer.fit("abc")
    torch.manual_seed(0)
    s2s = Seq2SeqTransformer(Seq2SeqConfig(tok.vocab_size, tok.vocab_size, d_model=16,
                                           num_heads=2, d_ff=32, dropout=0.0)).eval()
    texts = ["abc", "ca", "b"]
    out = translate(s2s, texts, tok, tok, batch_size=2, max_new_tokens=5)
    ids = greedy(s2s, [tok.encode(t, add_eos=True) for t in texts], max_new_tokens=5)
    assert out == [tok.decode(r) for r in strip(ids, 2)]
    lm = DecoderLM(DecoderLMConfig(tok.vocab_size, d_model=16, num_layers=1, num_heads=2)).eval()
    text = complete(lm, ["ab", "c"], tok, max_new_tokens=4)
    assert len(text) == 2 and all(isinstance(t, str) for t in text)
    with pytest.raises(TypeError, match=r"translate needs an encoder-decoder model, got DecoderLM"):
        translate(lm, texts, tok, tok)
    with pytest.raises(TypeError, match=r"complete needs a decoder-only model"):
        complete(s2s, texts, tok)


@pytest.mark.parametrize("inputs, kwargs, err, match", [
    ([[1, 2], []], {}, ValueError, r"prompts\[1\] is empty"),
    ([[1, 99]], {}, ValueError, r"prompts\[0\] has ids outside \[0, 40\)"),
    ([[1] * 60], dict(max_new_tokens=10), ValueError, "a prompt of 60 tokens \\+ max_new_tokens=10 exceeds the model's max_len=64"),
    ([[1, 2]], dict(max_new_tokens=0), ValueError, "max_new_tokens must be a positive int, got 0"),
    ("hello", {}, ValueError, "prompts must be a non-empty list of id lists"),
    ([[1, 2.5]], {}, ValueError, r"prompts\[0\] must hold ints"),
    (torch.ones(2, 3), {}, ValueError, "prompts must be a \\(B, L\\) integer tensor"),
    ([[1, 2]], dict(eos_id=-1), ValueError, "eos_id must be a non-negative int or None, got -1"),
])  # fmt: skip
def test_greedy_errors(inputs, kwargs, err, match):
    with pytest.raises(err, match=match):
        greedy(_lm(), inputs, **kwargs)


def test_sample_and_model_errors():
    model = _lm()
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0 \(0 = greedy\), got -1"):
        sample(model, PROMPTS, temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must lie in"):
        sample(model, PROMPTS, top_p=0.0)
    with pytest.raises(ValueError, match=r"seed must be an int or 4 ints"):
        sample(model, PROMPTS, seed=[1, 2])
    with pytest.raises(TypeError, match=r"got Linear"):
        greedy(nn.Linear(2, 2), PROMPTS)
    with pytest.raises(ValueError, match=r"sources\[0\] is empty"):
        greedy(_s2s(), [[]])
    with pytest.raises(ValueError, match=r"max_new_tokens=100 exceeds the model's max_len=64"):
        greedy(_s2s(), SOURCES, max_new_tokens=100)
