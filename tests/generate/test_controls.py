"""Generation controls against transformers' ``generate`` on the same random weights.

For two families (Llama, GPT-2) transformers builds a small random model, saves it and qkv
loads the folder. For each control alone and several together, qkv's greedy tokens for a
batch of two prompts of different lengths (the short one left-padded) equal transformers'
``generate(do_sample=False)`` on each prompt alone: the padding never counts as a token.
Each case is chosen from the plain greedy output so that it changes the tokens. Min-p is
compared as a filter (which tokens survive) against ``MinPLogitsWarper``, since random draws
differ between the libraries; bad values give a ValueError naming the field.
"""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch

import qkv.pretrained
from qkv.generate import (
    DecoderSession,
    GenerationControls,
    filter_logits,
    generate,
    greedy,
    sample,
    stream,
)
from qkv.generate.controls import NO_TOKEN, prompt_ids
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer

V, N = 64, 20  # vocabulary, new tokens per row
PROMPTS = [[5, 9, 14, 9, 30, 7, 22], [11, 40, 3]]
SIZES = dict(vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=0)
FAMILIES = {
    "llama": lambda t: t.LlamaConfig(**SIZES, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64,
                                     tie_word_embeddings=False),
    "gpt2": lambda t: t.GPT2Config(**SIZES, n_embd=64, n_layer=2, n_head=4, n_positions=64),
}  # fmt: skip


def _transformers():
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        pytest.fail(f"this test needs transformers ({err}): pip install 'qkv[parity]'",
                    pytrace=False)  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """``(transformers' model, qkv's model)`` of one family, on the same random weights."""
    t = _transformers()
    torch.manual_seed(0)
    ref = t.AutoModelForCausalLM.from_config(FAMILIES[request.param](t),
                                             attn_implementation="eager")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights large enough that the logits are far from ties
        for name, p in ref.named_parameters():
            scale = 0.3 if "bias" in name else 0.08
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if "norm" in name or "ln_" in name
                    else torch.randn(p.shape, generator=gen) * scale)  # fmt: skip
    folder = tmp_path_factory.mktemp(request.param)
    ref.eval().save_pretrained(folder)
    return ref, qkv.pretrained.load(folder).model


def _cut(row: list[int], eos: int | None) -> list[int]:
    """A row up to and including its first EOS."""
    return row[: row.index(eos) + 1] if eos is not None and eos in row else row


def _first_difference(ours: list[int], theirs: list[int], name: str = "transformers") -> str:
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
             min(len(ours), len(theirs)))  # fmt: skip
    return (f"first difference at new token {i}: ours {ours[i : i + 3]}, {name}'s "
            f"{theirs[i : i + 3]}\n  ours   {ours}\n  {name} {theirs}")  # fmt: skip


def _plain(model) -> list[list[int]]:
    return greedy(model, PROMPTS, max_new_tokens=N, eos_id=None).tolist()


def _most_common(rows: list[list[int]]) -> int:
    return Counter(t for row in rows for t in row).most_common(1)[0][0]


# Each case: plain greedy rows -> (qkv controls, transformers' generate kwargs, eos id).
CASES = {
    "repetition_penalty": lambda rows: (dict(repetition_penalty=1.3), {}, None),
    "no_repeat_ngram_2": lambda rows: (dict(no_repeat_ngram_size=2), {}, None),
    "no_repeat_ngram_3": lambda rows: (dict(no_repeat_ngram_size=3), {}, None),
    "bad_word_single": lambda rows: (dict(bad_words_ids=((_most_common(rows),),)), {}, None),
    "bad_word_multi": lambda rows: (dict(bad_words_ids=((rows[0][1], rows[0][2]),
                                                        (rows[1][0], rows[1][1]))), {}, None),
    "min_new_tokens": lambda rows: (dict(min_new_tokens=4), {}, rows[0][0]),
    "forced_eos": lambda rows: (dict(forced_eos=True), dict(forced_eos_token_id=V - 1), V - 1),
    "together": lambda rows: (dict(repetition_penalty=1.3, no_repeat_ngram_size=3,
                                   bad_words_ids=((_most_common(rows),), (rows[1][0], 8)),
                                   min_new_tokens=3, forced_eos=True),
                              dict(forced_eos_token_id=rows[0][0]), rows[0][0]),
    "penalty_and_ngram_2": lambda rows: (dict(repetition_penalty=0.8, no_repeat_ngram_size=2),
                                         {}, None),
}  # fmt: skip


def _hf_kwargs(fields: dict, extra: dict) -> dict:
    """transformers' names for the controls' fields (forced EOS is given by ``extra``)."""
    out = {k: v for k, v in fields.items() if k != "forced_eos"}
    if "bad_words_ids" in out:
        out["bad_words_ids"] = [list(w) for w in out["bad_words_ids"]]
    return {**out, **extra}


@pytest.mark.parametrize("case", CASES)
def test_control_matches_transformers(pair, case):
    ref, ours = pair
    plain = _plain(ours)
    fields, extra, eos = CASES[case](plain)
    got = greedy(ours, PROMPTS, max_new_tokens=N, eos_id=eos,
                 controls=GenerationControls(**fields)).tolist()  # fmt: skip
    changed = False
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False,
                               eos_token_id=eos, pad_token_id=0,
                               **_hf_kwargs(fields, extra))  # fmt: skip
        theirs = out[0, len(prompt) :].tolist()
        row = _cut(got[b], eos)
        assert row == theirs, f"{case}, row {b}: " + _first_difference(row, theirs)
        changed |= row != _cut(plain[b], eos)
    assert changed, f"{case}: the controls left the plain greedy tokens unchanged {plain}"


def test_controls_through_generate_and_stream_match_greedy(pair):
    _, ours = pair
    controls = GenerationControls(repetition_penalty=1.3, no_repeat_ngram_size=2)
    expect = greedy(ours, PROMPTS, max_new_tokens=N, controls=controls)
    got = generate(ours, PROMPTS, max_new_tokens=N, controls=controls)
    assert torch.equal(got, expect), f"generate {got.tolist()} != greedy {expect.tolist()}"
    streamed = list(stream(ours, PROMPTS[1], max_new_tokens=N, controls=controls))
    assert streamed == expect[1].tolist(), f"stream {streamed} != greedy {expect[1].tolist()}"


def _lm() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.llama_style(V, d_model=32, num_layers=2, num_heads=4,
                                                 num_kv_heads=2, max_len=64)).eval()  # fmt: skip


ALL_ON = GenerationControls(repetition_penalty=1.5, no_repeat_ngram_size=2,
                            bad_words_ids=((4,), (9, 10)), min_new_tokens=2, forced_eos=True)


def test_padding_is_no_token():
    """The left padding of a short prompt is NO_TOKEN, so no control counts it as token 0."""
    session = DecoderSession(_lm(), [[5, 0, 7], [8]], max_new_tokens=4)
    ids = prompt_ids(session)
    assert ids.tolist() == [[5, 0, 7], [NO_TOKEN, NO_TOKEN, 8]], ids.tolist()
    logits = torch.ones(2, V)
    both = GenerationControls(repetition_penalty=2.0, no_repeat_ngram_size=1)
    out = both.apply(logits, ids, new=0, last_step=False, eos_id=None)
    expect = torch.ones(2, V)
    expect[0, [0, 5, 7]] = float("-inf")
    expect[1, 8] = float("-inf")
    assert torch.equal(out, expect), f"edited where {(out != expect).nonzero().tolist()}"


def test_a_lone_eos_is_not_a_bad_word():
    """As transformers: a one-token bad word that is the EOS id is dropped, longer ones kept."""
    words = GenerationControls(bad_words_ids=((2,), (7,), (5, 2)))
    out = words.apply(torch.zeros(1, V), torch.tensor([[3, 5]]), new=0, last_step=False, eos_id=2)
    assert torch.isinf(out).nonzero()[:, 1].tolist() == [2, 7], out
    out = words.apply(torch.zeros(1, V), torch.tensor([[3, 4]]), new=0, last_step=False, eos_id=2)
    assert torch.isinf(out).nonzero()[:, 1].tolist() == [7], out


@pytest.mark.parametrize("controls", [ALL_ON, GenerationControls(repetition_penalty=0.05),
                                      GenerationControls(no_repeat_ngram_size=1)], ids=repr)
def test_batch_equals_rows_alone(controls):
    """A batch of prompts of three lengths decodes each row as alone."""
    prompts = [[0, 5, 9, 14, 9, 30, 7, 22], [0, 40], [3]]
    model = _lm()
    batch = greedy(model, prompts, max_new_tokens=N, eos_id=2, pad_id=0, controls=controls)
    for b, prompt in enumerate(prompts):
        alone = greedy(model, [prompt], max_new_tokens=N, eos_id=2, controls=controls)[0]
        row = _cut(batch[b].tolist(), 2)
        assert row == alone.tolist(), f"row {b}: " + _first_difference(row, alone.tolist(),
                                                                        "alone")  # fmt: skip
        assert row[-1] == 2 or not controls.forced_eos, f"row {b} does not end with EOS: {row}"


def test_encoder_decoder_batch_equals_rows_alone():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(Seq2SeqConfig(V, V, d_model=32, num_heads=4, d_ff=64,
                                             dropout=0.0, max_len=64)).eval()  # fmt: skip
    sources = [[5, 6, 7, 2], [8, 2]]
    batch = greedy(model, sources, max_new_tokens=N, bos_id=1, eos_id=2, controls=ALL_ON)
    for b, source in enumerate(sources):
        alone = greedy(model, [source], max_new_tokens=N, bos_id=1, eos_id=2, controls=ALL_ON)
        assert _cut(batch[b].tolist(), 2) == alone[0].tolist(), f"row {b}"


# transformers' warpers in their order: temperature, top-k, top-p, min-p.
FILTERS = [dict(min_p=m) for m in (0.0, 0.02, 0.1, 0.3, 0.7, 1.0)] + [
    dict(min_p=0.1, temperature=0.5), dict(min_p=0.1, temperature=2.0),
    dict(min_p=0.05, top_k=20), dict(min_p=0.05, temperature=1.5, top_k=30, top_p=0.9)]


@pytest.mark.parametrize("options", FILTERS, ids=str)
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_min_p_filter_matches_transformers_warper(options, scale):
    t = _transformers()
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(3)) * scale
    logits[0, :5] = 10.0  # a tie at the top
    ours = torch.isfinite(filter_logits(logits, **options))
    warpers = [t.TemperatureLogitsWarper(float(options.get("temperature", 1.0)))]
    if "top_k" in options:
        warpers.append(t.TopKLogitsWarper(options["top_k"]))
    if "top_p" in options:
        warpers.append(t.TopPLogitsWarper(options["top_p"]))
    warpers.append(t.MinPLogitsWarper(options["min_p"]))
    theirs = logits.clone()
    for warp in warpers:
        theirs = warp(None, theirs)
    theirs = torch.isfinite(theirs)
    bad = (ours != theirs).nonzero().tolist()
    assert not bad, f"{options}: {len(bad)} tokens differ, first (row, token) {bad[0]}"


def test_min_p_one_samples_the_greedy_tokens():
    model = _lm()
    expect = greedy(model, PROMPTS, max_new_tokens=N)
    got = sample(model, PROMPTS, max_new_tokens=N, temperature=0.7, seed=0,
                 controls=GenerationControls(min_p=1.0))  # fmt: skip
    assert torch.equal(got, expect), f"min_p=1 sampled {got.tolist()} != greedy {expect.tolist()}"


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", True),
    ("repetition_penalty", float("inf")), ("no_repeat_ngram_size", -1),
    ("no_repeat_ngram_size", 2.0), ("bad_words_ids", ((),)), ("bad_words_ids", ((1, -2),)),
    ("bad_words_ids", "ab"), ("bad_words_ids", (3,)), ("min_new_tokens", -1),
    ("min_new_tokens", None), ("min_p", 1.5), ("min_p", -0.1), ("min_p", "0.1"),
    ("forced_eos", 1),
])  # fmt: skip
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must .*got"):
        GenerationControls(**{field: value})


def test_lists_are_stored_as_tuples():
    assert GenerationControls(bad_words_ids=[[1, 2], [3]]).bad_words_ids == ((1, 2), (3,))


def test_controls_the_model_cannot_meet_are_refused():
    model = _lm()
    with pytest.raises(ValueError, match=rf"bad_words_ids must hold tokens .*\[0, {V}\), got {V}"):
        greedy(model, PROMPTS, controls=GenerationControls(bad_words_ids=((V,),)))
    with pytest.raises(ValueError, match="forced_eos=True needs an eos_id"):
        greedy(model, PROMPTS, eos_id=None, controls=GenerationControls(forced_eos=True))
    with pytest.raises(TypeError, match="controls must be a GenerationControls or None, got dict"):
        sample(model, PROMPTS, controls={"min_p": 0.1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="controls are not supported by beam search"):
        generate(model, PROMPTS, beam_size=2, controls=GenerationControls())
    with pytest.raises(ValueError, match="min_p must be None or a number in"):
        filter_logits(torch.zeros(1, 3), min_p=2.0)
