"""One record of how a request is decoded (issue 43): :class:`~qkv.generate.engine.SamplingParams`
with its :class:`~qkv.generate.GenerationControls`. Reference: :func:`qkv.generate.generate` on
the request alone (the library's single-request path); the continuous-batching engine must give
the same tokens for every control, alone and in a batch of 8 requests with other controls,
lengths, greedy and seeded sampling. A tiny float64 DecoderLM with a fixed seed."""

from __future__ import annotations

import functools

import pytest
import torch

from qkv.generate import GenerationControls, generate, strip
from qkv.generate.args import ParamError
from qkv.generate.batching import BatchingEngine
from qkv.generate.engine import SamplingParams, decoding_params
from qkv.models import DecoderLM, DecoderLMConfig

TIMEOUT = 60  # seconds any test waits for a token
EOS = 12  # the greedy continuation of a prompt ending in 12 is 12: EOS at once
G = GenerationControls


@functools.cache
def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig(vocab_size=40, d_model=32, num_heads=4, num_kv_heads=2,
                             num_layers=2, d_ff=64, max_len=64)  # fmt: skip
    return DecoderLM(config).double().eval()


# Each control alone, on a prompt where it changes the request's tokens (greedy on [5, 9, 12, 4]
# repeats 4; on [5, 9, 12] it stops at EOS at once).
CONTROLS = {
    "repetition_penalty": ([5, 9, 12, 4], G(repetition_penalty=3.0)),
    "no_repeat_ngram_size": ([5, 9, 12, 4], G(no_repeat_ngram_size=1)),
    "bad_words_ids": ([5, 9, 12, 4], G(bad_words_ids=((4, 4), (1,), (11,), (30,)))),
    "min_new_tokens": ([5, 9, 12], G(min_new_tokens=5)),
    "min_p": ([5, 9, 12, 4], G(min_p=0.5)),
    "forced_eos": ([5, 9, 12, 4], G(forced_eos=True)),
    "logit_bias": ([5, 9, 12, 4], G(logit_bias={4: -2.0, 30: 1.5})),
    "frequency_penalty": ([5, 9, 12, 4], G(frequency_penalty=0.8)),
    "presence_penalty": ([5, 9, 12, 4], G(presence_penalty=1.5)),
}
MODES = {"greedy": {}, "sampled": dict(temperature=0.7, seed=3)}
# min-p filters sampling only: greedy keeps its argmax, so that case could never fail.
CASES = [(c, m) for c in CONTROLS for m in MODES if (c, m) != ("min_p", "greedy")]

# Seven more requests for the batch: other controls (several at once), lengths, modes.
OTHERS = [
    ([7], decoding_params(9)),
    ([3, 3, 8, 21, 30, 2], decoding_params(6, temperature=0.9, seed=1, repetition_penalty=1.5,
                                           min_p=0.1)),
    ([1, 2, 3, 4, 5, 6, 7, 8], decoding_params(11, no_repeat_ngram_size=2,
                                               bad_words_ids=((13,), (4, 5)))),
    ([20, 21], decoding_params(4, temperature=1.2, seed=7, frequency_penalty=-1.0,
                               logit_bias={3: 2.0})),
    ([33, 12], decoding_params(8, min_new_tokens=3, forced_eos=True)),
    ([9] * 5, decoding_params(10, temperature=0.7, top_k=10, seed=11, no_repeat_ngram_size=3,
                              min_new_tokens=2)),
    ([14, 15, 16], decoding_params(7, temperature=0.8, top_p=0.9, seed=5,
                                   bad_words_ids=((1,), (11, 30)), forced_eos=True)),
]  # fmt: skip


def _alone(prompt: list[int], params: SamplingParams) -> list[int]:
    """The request through qkv.generate.generate by itself, EOS cut."""
    return strip(generate(_model(), [prompt], eos_id=EOS, **params.keywords()), EOS)[0]


def _served(requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """The requests through one engine, all submitted before it starts: one batch."""
    engine = BatchingEngine(_model(), eos_id=EOS, max_batch=8, block_size=4, num_blocks=64)
    submitted = [engine.submit(prompt, params) for prompt, params in requests]
    engine.start()
    try:
        return [list(r.tokens(timeout=TIMEOUT)) for r in submitted]
    finally:
        engine.shutdown(timeout=TIMEOUT)


@pytest.mark.parametrize(("control", "mode"), CASES, ids=[f"{c}-{m}" for c, m in CASES])
def test_the_engine_applies_each_control_per_row_as_generate_alone(control, mode):
    prompt, controls = CONTROLS[control]
    params = decoding_params(10, controls=controls, **MODES[mode])
    want = _alone(prompt, params)
    without = _alone(prompt, decoding_params(10, **MODES[mode]))
    assert want != without, f"{control} ({mode}) changes nothing here: the test could not fail"
    assert _served([(prompt, params)]) == [want], "alone in the engine"
    batch = [(prompt, params), *OTHERS]
    got = _served(batch)
    for i, ((p, request), tokens) in enumerate(zip(batch, got, strict=True)):
        assert tokens == _alone(p, request), f"request {i} of the batch: {request}"


def test_a_request_without_controls_never_runs_them(monkeypatch):
    """Nothing edits its logits, so the engine keeps no history and never calls apply."""

    def refuse(*args, **kwargs):
        raise AssertionError("controls applied to a request without them")

    monkeypatch.setattr(GenerationControls, "apply", refuse)
    params = decoding_params(6, temperature=0.9, seed=2, min_p=0.2)  # min-p: the sampler's
    assert not params.edits_logits
    assert _served([([5, 9, 4], params)]) == [_alone([5, 9, 4], params)]


def test_a_bad_option_is_a_param_error_naming_it():
    for options, param in [
        (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_p=0.0), "top_p"),
        (dict(seed=2**70), "seed"), (dict(min_p=2.0), "min_p"), (dict(stop=[""]), "stop"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(controls=G(), min_p=0.1), "controls"),
    ]:
        with pytest.raises(ParamError) as caught:
            decoding_params(**options)
        assert caught.value.param == param and param in str(caught.value), caught.value
    assert caught.value.named("CONTROLS").startswith("CONTROLS")
    engine = BatchingEngine(_model(), eos_id=EOS, block_size=4, num_blocks=64)
    for prompt, params, param, message in [
        ([1] * 60, decoding_params(10), "max_new_tokens",  # past the 64 learned positions
         "a prompt of 60 tokens + max_new_tokens=10 exceeds the model's 64 positions"),
        ([1, 99], decoding_params(4), "prompt", "prompt must be a non-empty list"),
        ([1, 2], decoding_params(4, bad_words_ids=((40,),)), "bad_words_ids",
         "bad_words_ids must hold tokens of the model's vocabulary [0, 40), got 40"),
    ]:
        with pytest.raises(ParamError) as caught:
            engine.submit(prompt, params)
        assert caught.value.param == param and message in str(caught.value), caught.value
