"""Structured output in the batching engine (issue 45): every answer matches its grammar.

References: ``jsonschema`` validates each JSON answer against its schema, Python's ``re``
matches the regex answers, the choices are compared as strings. The model is a tiny random
DecoderLM over SmolLM2's tokenizer (49,152 tokens), sampled at temperature 1.2: its tokens are
noise, so only the mask keeps the text valid, across 200 answers of five grammars decoded
together."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs llguidance (qkv[serve])")
jsonschema = pytest.importorskip("jsonschema", reason="the answers are validated by jsonschema")

import qkv.pretrained  # noqa: E402
from qkv.generate.args import ParamError  # noqa: E402
from qkv.generate.batching import BatchingEngine  # noqa: E402
from qkv.generate.engine import decoding_params  # noqa: E402
from qkv.generate.grammar import Grammar  # noqa: E402
from qkv.models import DecoderLM, DecoderLMConfig  # noqa: E402

TIMEOUT = 120
pytestmark = pytest.mark.self_check  # text against its grammar: no kernel decides it
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
     "age": {"type": "integer", "minimum": 0, "maximum": 120},
     "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array",
     "items": {"type": "string", "maxLength": 6}, "maxItems": 3}, "point": {"type": "object",
     "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"],
     "additionalProperties": False}}, "required": ["ok", "tags", "point"],
     "additionalProperties": False},
]  # fmt: skip
REGEX = r"[A-Z]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "naïve ☃", 'a "quoted" one']


@functools.cache
def _tokenizer():
    return qkv.pretrained.load("SmolLM2-135M-Instruct").tokenizer


def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig(vocab_size=_tokenizer().vocab_size, d_model=32, num_heads=2,
                             num_layers=1, d_ff=64, max_len=1024, eos_id=_tokenizer().eos_id)
    return DecoderLM(config).eval()


def _grammars() -> list[tuple[Grammar, object]]:
    """``(grammar, check)``: check(text) raises when the text does not match."""

    def schema_check(schema):
        return lambda text: jsonschema.validate(json.loads(text), schema)

    def regex_check(text):
        assert re.fullmatch(REGEX, text), text

    def choice_check(text):
        assert text in CHOICES, text

    def tuple_check(text):
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text), text

    # (Any JSON object, "json_object", is left to test_serve_api's SmolLM2: noise never
    # closes a free string, so a random model's answer runs to its length limit.)
    return [*[(Grammar("json_schema", json.dumps(s)), schema_check(s)) for s in SCHEMAS],
            (Grammar("regex", REGEX), regex_check),
            (Grammar("choice", json.dumps(CHOICES)), choice_check),
            (Grammar("lark", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'), tuple_check)]


def test_two_hundred_sampled_answers_all_match_their_grammars():
    tokenizer, grammars = _tokenizer(), _grammars()
    engine = BatchingEngine(_model(), max_batch=16, block_size=16, num_blocks=1200,
                            tokenizer=tokenizer)  # fmt: skip
    prompt = tokenizer.encode("Answer:", add_special_tokens=False)
    jobs = [(*grammars[i % len(grammars)], i) for i in range(200)]
    requests = [engine.submit(prompt, decoding_params(300, temperature=1.2, seed=i,
                                                      grammar=g)) for g, _, i in jobs]  # fmt: skip
    engine.start()
    try:
        outputs = [list(r.tokens(timeout=TIMEOUT)) for r in requests]
    finally:
        engine.shutdown(timeout=TIMEOUT)
    bad = []
    for (grammar, check, i), request, ids in zip(jobs, requests, outputs, strict=True):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        try:
            assert request.finish_reason == "stop", request.finish_reason
            check(text)
        except Exception as err:
            bad.append((i, grammar.kind, text[:80], repr(err)[:120]))
    assert not bad, f"{len(bad)} of 200 answers do not match: {bad[:5]}"
    assert len({tokenizer.decode(o) for o in outputs}) > 100, "the answers hardly differ"


@pytest.mark.parametrize(("kind", "source", "words"), [
    ("json", "{}", "kind must be one of"), ("json_schema", "{not json", "must be JSON text"),
    ("json_schema", '{"type": "nonsense"}', "Invalid type"), ("regex", "[A-Z", "regex"),
    ("choice", "[]", "non-empty strings"), ("choice", '["a", 3]', "non-empty strings"),
    ("lark", "start: missing_rule", "llguidance"),
])  # fmt: skip
def test_bad_grammars_are_refused_naming_the_grammar(kind, source, words):
    with pytest.raises(ParamError, match=words) as caught:
        Grammar(kind, source)
    assert caught.value.param == "grammar"


def test_an_engine_without_the_tokenizer_refuses_grammars():
    engine = BatchingEngine(_model(), block_size=16, num_blocks=8)
    with pytest.raises(ParamError, match="needs the engine to know the model's tokenizer"):
        engine.submit([1, 2], decoding_params(4, grammar=Grammar("json_object")))
    with pytest.raises(ParamError, match="applied by the batching engine only"):
        decoding_params(4, grammar=Grammar("json_object")).keywords()
