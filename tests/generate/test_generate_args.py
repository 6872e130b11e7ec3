"""Every public argument of decoding, given a hostile value, is refused at the boundary.

One table per entry point (greedy, sample, stream, beam_search, generate, translate, complete,
Sampler, filter_logits): the error is a ValueError or TypeError whose message names the
argument, raised before decoding (stream: by the call, not at the first ``next``), never an
IndexError from an embedding, a RuntimeError from torch or a silently ignored option.
"""

from __future__ import annotations

import math

import pytest
import torch

from qkv.data import CharTokenizer
from qkv.generate import (
    Sampler,
    beam_search,
    complete,
    filter_logits,
    generate,
    greedy,
    sample,
    stream,
    translate,
)
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer

V, SRC_V = 40, 30
PROMPTS = [[1, 5, 6, 7], [1, 9]]
SOURCES = [[5, 6, 7, 2], [8, 2]]
TOK = CharTokenizer.fit("abcdefgh ")


def _lm(max_len: int = 64, vocab: int = V) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig(vocab, d_model=16, num_layers=1, num_heads=2,
                                     max_len=max_len)).eval()  # fmt: skip


def _s2s(src_vocab: int = SRC_V) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(Seq2SeqConfig(src_vocab, V, d_model=16, num_heads=2, d_ff=32,
                                            num_encoder_layers=1, num_decoder_layers=1,
                                            dropout=0.0, max_len=64)).eval()  # fmt: skip


NAN, INF = math.nan, math.inf
# (argument, value, words the message must hold); the same table for every method that
# takes the argument.
SAMPLING = [
    ("temperature", -1.0, "temperature must be a finite number >= 0"),
    ("temperature", NAN, "temperature must be a finite number >= 0"),
    ("temperature", INF, "temperature must be a finite number >= 0"),
    ("temperature", True, "temperature must be a finite number >= 0"),
    ("temperature", "0.5", "temperature must be a finite number >= 0"),
    ("top_k", 0, "top_k must be a positive int or None"),
    ("top_k", -3, "top_k must be a positive int or None"),
    ("top_k", 2.0, "top_k must be a positive int or None"),
    ("top_k", True, "top_k must be a positive int or None"),
    ("top_p", 0.0, r"top_p must lie in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must lie in \(0, 1\]"),
    ("top_p", NAN, r"top_p must lie in \(0, 1\]"),
    ("top_p", True, r"top_p must lie in \(0, 1\]"),
    ("top_p", "0.9", r"top_p must lie in \(0, 1\]"),
    ("seed", True, "seed must be an int"),
    ("seed", 1.5, "seed must be an int"),
    ("seed", "7", "seed must be an int"),
    ("seed", [1], r"seed must be an int or 2 ints \(one per row\)"),
    ("seed", [1, True], r"seed must be an int or 2 ints \(one per row\)"),
    ("seed", 2**64, r"seed must lie in \[-2\*\*63, 2\*\*64 - 1\]"),
    ("seed", 2**64 - 1, r"seed must lie in .* got 18446744073709551616"),  # row 1: seed + 1
    ("seed", -(2**63) - 1, "seed must lie in"),
]
IDS = [
    ("eos_id", V, rf"eos_id must be a token of the model's vocabulary \[0, {V}\), got {V}"),
    ("eos_id", 10**9, r"eos_id must be a token of the model's vocabulary"),
    ("eos_id", -1, "eos_id must be a non-negative int or None, got -1"),
    ("eos_id", 2.0, "eos_id must be a non-negative int or None"),
    ("eos_id", True, "eos_id must be a non-negative int or None"),
    ("pad_id", V + 5, r"pad_id must be a token of the model's vocabulary"),
    ("pad_id", -2, "pad_id must be a non-negative int or None"),
    ("bos_id", V, r"bos_id must be a token of the model's vocabulary"),
    ("bos_id", "1", "bos_id must be a non-negative int or None"),
]
COMMON = [
    ("max_new_tokens", 0, "max_new_tokens must be a positive int, got 0"),
    ("max_new_tokens", -5, "max_new_tokens must be a positive int"),
    ("max_new_tokens", 2.5, "max_new_tokens must be a positive int"),
    ("max_new_tokens", True, "max_new_tokens must be a positive int"),
    ("max_new_tokens", None, "max_new_tokens must be a positive int"),
]
BEAM = [
    ("beam_size", 0, "beam_size must be a positive int, got 0"),
    ("beam_size", True, "beam_size must be a positive int"),
    ("beam_size", 2.0, "beam_size must be a positive int"),
    ("alpha", -0.5, "alpha must be a finite number >= 0"),
    ("alpha", NAN, "alpha must be a finite number >= 0"),
    ("alpha", INF, "alpha must be a finite number >= 0"),
    ("alpha", True, "alpha must be a finite number >= 0"),
    ("num_return", 0, "num_return must be a positive int"),
    ("num_return", 5, "num_return=5 must be <= beam_size=4"),
]


def _raises(fn, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match) as info:
        fn()
    # a qkv message, not a ValueError/TypeError of torch's or Python's from deep inside
    assert not isinstance(info.value, IndexError | KeyError | RuntimeError), repr(info.value)


def _case_id(case) -> str:
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize("kind", ["lm", "s2s"])
@pytest.mark.parametrize("case", SAMPLING + IDS + COMMON, ids=_case_id)
def test_sample_refuses(kind, case):
    name, value, match = case
    model, inputs = (_lm(), PROMPTS) if kind == "lm" else (_s2s(), SOURCES)
    kwargs = {"temperature": 0.7, name: value}
    _raises(lambda: sample(model, inputs, **kwargs), match)


@pytest.mark.parametrize("case", [c for c in SAMPLING if c[0] != "temperature"], ids=_case_id)
def test_sampling_options_are_checked_even_when_greedy(case):
    # temperature=0 decodes greedily and uses none of them: a typo must still be reported.
    name, value, match = case
    _raises(lambda: sample(_lm(), PROMPTS, temperature=0.0, **{name: value}), match)
    _raises(lambda: generate(_lm(), PROMPTS, **{name: value}), match)


@pytest.mark.parametrize("case", IDS + COMMON, ids=_case_id)
def test_greedy_refuses(case):
    name, value, match = case
    _raises(lambda: greedy(_lm(), PROMPTS, **{name: value}), match)
    _raises(lambda: greedy(_s2s(), SOURCES, **{name: value}), match)


@pytest.mark.parametrize("case", IDS + COMMON + BEAM, ids=_case_id)
def test_beam_search_refuses(case):
    name, value, match = case
    kwargs = {"beam_size": 4, name: value}
    _raises(lambda: beam_search(_lm(), PROMPTS, **kwargs), match)
    _raises(lambda: beam_search(_s2s(), SOURCES, **kwargs), match)
    if name not in ("num_return", "alpha"):  # generate() passes beam_size and alpha only
        _raises(lambda: generate(_s2s(), SOURCES, **kwargs), match)


# stream decodes one row and takes no pad_id; a seed list is refused (next test).
STREAM = [c for c in SAMPLING + IDS + COMMON
          if c[0] != "pad_id" and not isinstance(c[1], list) and c[1] != 2**64 - 1]


@pytest.mark.parametrize("case", STREAM, ids=_case_id)
def test_stream_refuses_at_the_call(case):
    name, value, match = case
    kwargs = {"temperature": 0.5, name: value}
    _raises(lambda: stream(_lm(), [1, 5, 6], **kwargs), match)


def test_stream_refuses_a_seed_list_and_hostile_prompts():
    _raises(lambda: stream(_lm(), [1, 5], temperature=0.5, seed=[1]), r"seed must be an int or None \(stream decodes one row\)")
    _raises(lambda: stream(_lm(), "hello"), "prompt must be a list of token ids")
    _raises(lambda: stream(_lm(), 5), "prompt must be a list of token ids")
    _raises(lambda: stream(_lm(), [1, V]), r"prompts\[0\] has ids outside \[0, 40\)")
    _raises(lambda: stream(_lm(), []), r"prompts\[0\] is empty")


def test_stream_takes_a_1d_tensor_prompt_like_a_list():
    model = _lm()
    as_list = list(stream(model, [1, 5, 6], max_new_tokens=6))
    as_tensor = list(stream(model, torch.tensor([1, 5, 6]), max_new_tokens=6))
    assert as_tensor == as_list and len(as_list) >= 1


def test_seq2seq_pad_id_must_lie_in_the_source_vocabulary():
    # pad_id pads the sources (an embedding of SRC_V rows) and fills finished target rows.
    model = _s2s(src_vocab=SRC_V)
    _raises(lambda: greedy(model, SOURCES, pad_id=SRC_V + 1),
            rf"pad_id pads the sources, so it must lie in the source vocabulary \[0, {SRC_V}\)")
    assert greedy(model, SOURCES, pad_id=SRC_V - 1, max_new_tokens=3).shape[0] == 2


def test_config_ids_outside_the_vocabulary_are_named_as_the_config_s():
    model = _lm()
    object.__setattr__(model.config, "eos_id", V + 3)  # a config edited by hand
    _raises(lambda: greedy(model, PROMPTS), r"eos_id \(from model.config\) must be a token")


@pytest.mark.parametrize("case", [
    ("batch_size", 0, "batch_size must be a positive int, got 0"),
    ("batch_size", -1, "batch_size must be a positive int"),
    ("max_new_tokens", 0, "max_new_tokens must be a positive int, got 0"),
    ("eos_id", V, "eos_id must be a token of the model's vocabulary"),
    ("temperature", NAN, "temperature must be a finite number >= 0"),
    ("beam_size", 0, "beam_size must be a positive int"),
], ids=_case_id)  # fmt: skip
def test_translate_refuses(case):
    name, value, match = case
    tok = CharTokenizer.fit("abc")
    model = Seq2SeqTransformer(Seq2SeqConfig(tok.vocab_size, V, d_model=16, num_heads=2,
                                             d_ff=32, dropout=0.0)).eval()  # fmt: skip
    _raises(lambda: translate(model, ["abc"], tok, tok, **{name: value}), match)


@pytest.mark.parametrize("case", [
    ("max_new_tokens", 0, "max_new_tokens must be a positive int, got 0"),
    ("eos_id", 10**6, "eos_id must be a token of the model's vocabulary"),
    ("top_p", 2.0, r"top_p must lie in \(0, 1\]"),
], ids=_case_id)  # fmt: skip
def test_complete_refuses(case):
    name, value, match = case
    model = _lm(vocab=TOK.vocab_size)
    _raises(lambda: complete(model, ["abc"], TOK, **{name: value}), match)


@pytest.mark.parametrize("max_len", [8, 16, 64, 100])
def test_complete_default_length_fits_the_prompt_within_max_len(max_len):
    # The default used to be 64 whatever the prompt, so every prompt failed when max_len <= 64.
    model = _lm(max_len=max_len, vocab=TOK.vocab_size)
    prompts = ["abc", "abcdefg"]  # 4 and 8 tokens with BOS
    longest = 8
    if max_len <= longest:
        _raises(lambda: complete(model, prompts, TOK),
                rf"a prompt of {longest} tokens leaves no room for new tokens within the "
                rf"model's max_len={max_len}")  # fmt: skip
        return
    n = min(64, max_len - longest)
    assert complete(model, prompts, TOK) == complete(model, prompts, TOK, max_new_tokens=n)
    if n == max_len - longest:  # the default used all the room: one more does not fit
        _raises(lambda: complete(model, prompts, TOK, max_new_tokens=n + 1),
                rf"max_new_tokens={n + 1} exceeds the model's max_len={max_len}")


@pytest.mark.parametrize("case", SAMPLING, ids=_case_id)
def test_sampler_refuses(case):
    name, value, match = case
    kwargs = {"temperature": 0.5, name: value}
    _raises(lambda: Sampler(2, **kwargs), match)


@pytest.mark.parametrize("value", [0.0, -1.0, NAN, INF, True, "1"])
def test_filter_logits_refuses_temperature(value):
    _raises(lambda: filter_logits(torch.zeros(1, 3), temperature=value), "temperature must be")
