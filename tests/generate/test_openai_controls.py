"""OpenAI's three logit controls (issue 45) and the engine's log-probabilities.

References: the frequency and presence penalties as OpenAI's API reference defines them,
``logit[j] -= count[j] * frequency + (count[j] > 0) * presence`` over the tokens generated so
far, written as a plain loop of full forward passes (no cache) with a ``Counter``; the logit
bias against transformers' ``SequenceBiasLogitsProcessor`` on one-token sequences; the
engine's log-probabilities against ``log_softmax`` of the same model's full forward pass over
prompt + answer (float64 weights, so both sides agree to rounding)."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from qkv.generate import GenerationControls, greedy, sample, strip
from qkv.generate.batching import BatchingEngine
from qkv.generate.engine import SamplingParams, decoding_params
from qkv.models import DecoderLM, DecoderLMConfig

V, EOS, TIMEOUT = 53, 2, 60
G = GenerationControls


def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama_style(V, d_model=32, num_layers=2, num_heads=4,
                                         num_kv_heads=2, max_len=64)  # fmt: skip
    return DecoderLM(config).double().eval()


def _reference(model, prompt: list[int], n: int, frequency: float, presence: float,
               bias: dict[int, float]) -> list[int]:  # fmt: skip
    """Greedy decoding by the definitions, one full forward pass per step."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out]))[0, -1].tolist()  # (V,)
            counts = collections.Counter(out)
            edited = [x + bias.get(j, 0.0) - counts[j] * frequency - (counts[j] > 0) * presence
                      for j, x in enumerate(logits)]  # fmt: skip
            token = max(range(V), key=edited.__getitem__)
            if token == EOS:
                break
            out.append(token)
    return out


CASES = [(1.2, 0.0, {}), (0.0, 1.5, {}), (-0.8, 1.5, {}), (0.5, 0.5, {7: 3.0, 11: -100.0}),
         (0.0, 0.0, {30: 4.0})]  # fmt: skip


@pytest.mark.parametrize(("frequency", "presence", "bias"), CASES, ids=str)
def test_penalties_and_bias_follow_openai_definitions_in_a_padded_batch(frequency, presence, bias):
    model, n = _model(), 12
    prompts = [[5, 9, 14, 9, 30, 7, 22], [40], [3, 3, 3]]
    controls = GenerationControls(frequency_penalty=frequency, presence_penalty=presence,
                                  logit_bias=bias)  # fmt: skip
    plain = strip(greedy(model, prompts, max_new_tokens=n, eos_id=EOS, pad_id=0), EOS)
    got = strip(greedy(model, prompts, max_new_tokens=n, eos_id=EOS, pad_id=0,
                       controls=controls), EOS)  # fmt: skip
    want = [_reference(model, p, n, frequency, presence, bias) for p in prompts]
    assert got == want, f"qkv {got} != the definitions {want}"
    assert got != plain, f"the controls changed nothing here ({plain}): the test could not fail"


def test_logit_bias_equals_transformers_sequence_bias():
    transformers = pytest.importorskip("transformers", reason="pip install 'qkv[parity]'")
    torch.manual_seed(1)
    logits, ids = torch.randn(3, V), torch.randint(0, V, (3, 6))
    bias = {0: -100.0, 5: 2.5, V - 1: 0.25}
    theirs = transformers.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    ours = GenerationControls(logit_bias=bias).apply(logits, ids, new=0, last_step=False,
                                                     eos_id=None)  # fmt: skip
    want = theirs(ids, logits.clone())
    err = (ours - want).abs().max().item()
    assert err == 0.0, f"max error {err}"


def test_the_penalties_count_generated_tokens_not_the_prompt():
    controls = GenerationControls(frequency_penalty=1.0, presence_penalty=0.5)
    ids = torch.tensor([[4, 4, 4, 7, 7, 9]])  # a prompt of 3, then 7, 7, 9 generated
    out = controls.apply(torch.zeros(1, 10), ids, new=3, last_step=False, eos_id=None)
    want = torch.zeros(1, 10)
    want[0, 7], want[0, 9] = -2.5, -1.5
    assert torch.equal(out, want), f"{out.tolist()} != {want.tolist()}"


@pytest.mark.parametrize(("field", "value"), [
    ("frequency_penalty", 2.5), ("frequency_penalty", float("nan")), ("presence_penalty", -3),
    ("presence_penalty", "1"), ("logit_bias", {-1: 1.0}), ("logit_bias", {1: 101}),
    ("logit_bias", {1.5: 1.0}), ("logit_bias", "ab"), ("logit_bias", [(1, 1.0), (1, 2.0)]),
    ("logit_bias", {1: float("inf")}),
])  # fmt: skip
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must .*got"):
        GenerationControls(**{field: value})


def test_a_bias_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=rf"logit_bias must hold tokens .*\[0, {V}\), got {V}"):
        greedy(_model(), [[1, 2]], controls=GenerationControls(logit_bias={V: 1.0}))


def _served(requests: list[tuple[list[int], SamplingParams]]):
    engine = BatchingEngine(_model(), eos_id=EOS, max_batch=4, block_size=4, num_blocks=64)
    submitted = [engine.submit(prompt, params) for prompt, params in requests]
    engine.start()
    try:
        for r in submitted:
            list(r.tokens(timeout=TIMEOUT))
    finally:
        engine.shutdown(timeout=TIMEOUT)
    return submitted


@pytest.mark.parametrize("mode", [{}, dict(temperature=0.7, seed=3, top_k=5)], ids=str)
def test_engine_logprobs_are_the_log_softmax_of_the_chosen_distribution(mode):
    """Each token's log-probability and its top 4 equal ``log_softmax`` of the model's full
    forward pass over prompt + answer (after the controls; divided by the temperature when
    sampling, before top-k cuts it), in a batch with requests that ask for none."""
    model, prompt = _model(), [5, 9, 14, 9]
    controls = dict(frequency_penalty=0.5, logit_bias={7: 1.0})
    params = decoding_params(10, logprobs=4, **mode, **controls)
    first, *_ = _served([(prompt, params), ([3, 4], decoding_params(6)),
                         ([8], decoding_params(5, temperature=1.0, seed=1))])  # fmt: skip
    alone = (greedy(model, [prompt], max_new_tokens=10, eos_id=EOS, controls=G(**controls))
             if not mode else sample(model, [prompt], max_new_tokens=10, eos_id=EOS,
                                     controls=G(**controls), **mode))  # fmt: skip
    assert first.output == strip(alone, EOS)[0], "the tokens are not the request's alone"
    assert [e.token for e in first.logprobs] == first.output
    with torch.no_grad():
        logits = model(torch.tensor([prompt + first.output]))[0]  # (P + N, V)
    temperature = mode.get("temperature", 1.0)
    for i, entry in enumerate(first.logprobs):
        step = logits[len(prompt) - 1 + i][None]  # (1, V)
        seen = torch.tensor([prompt + first.output[:i]])
        edited = G(**controls).apply(step, seen, new=i, last_step=False, eos_id=EOS)[0]
        want = (edited / temperature).log_softmax(-1)  # (V,)
        # The engine works in float32: the logits rounded (half an ulp each), then the
        # log-sum-exp; a few ulps of the largest magnitude involved.
        tol = 16 * torch.finfo(torch.float32).eps * (1 + want.abs().max().item())
        err = abs(entry.logprob - want[entry.token].item())
        assert err < tol, f"token {i}: logprob error {err} (bound {tol:.2e})"
        top_ids = want.topk(4).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids, f"token {i}: top {entry.top} != {top_ids}"
        err = max(abs(lp - want[t].item()) for t, lp in entry.top)
        assert err < tol, f"token {i}: top logprob error {err} (bound {tol:.2e})"
        assert math.fsum(math.exp(lp) for _, lp in entry.top) <= 1 + tol
        if not mode:
            assert entry.top[0][0] == entry.token, "greedy chose a token that is not the argmax"


def test_logprobs_are_refused_where_they_cannot_be_reported():
    with pytest.raises(ValueError, match=r"^logprobs must be None or an int >= 0"):
        decoding_params(4, logprobs=-1)
    with pytest.raises(ValueError, match=r"^logprobs are reported by the batching engine only"):
        decoding_params(4, logprobs=2).keywords()
