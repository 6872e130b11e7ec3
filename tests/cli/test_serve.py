"""``qkv serve``: OpenAI's API on the batching engine, over real HTTP on 127.0.0.1, driven by
OpenAI's own client. References: greedy decoding of each request alone
(``bundle.generate_ids``, i.e. ``qkv.generate.greedy``), so the server, the engine and the text
handling are exact; a client that leaves mid-stream frees its request's blocks."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from typer.testing import CliRunner

pytest.importorskip("fastapi", reason="qkv serve needs the serve extra")
uvicorn = pytest.importorskip("uvicorn", reason="qkv serve needs the serve extra")
openai = pytest.importorskip("openai", reason="the tests talk through OpenAI's client")

from serving import LIMIT, MODEL, PROMPTS, TIMEOUT, alone, serving, smollm2  # noqa: E402

from qkv.cli.app import app  # noqa: E402
from qkv.generate.batching import BatchingEngine  # noqa: E402
from qkv.serve.app import make_app  # noqa: E402


@pytest.fixture(scope="module")
def served():
    with serving() as out:
        yield out


def test_health_and_models(served):
    assert httpx.get(f"{served.url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    assert [m.id for m in served.client().models.list().data] == [MODEL]


def test_completion_is_greedy_decoding_alone(served):
    got = served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                             temperature=0)  # fmt: skip
    ids = smollm2().tokenizer.encode(PROMPTS[0])
    assert got.choices[0].text == alone(PROMPTS[0], 12)
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 12)
    by_ids = served.client().completions.create(model=MODEL, prompt=ids, max_tokens=12,
                                                temperature=0)  # fmt: skip
    assert by_ids.choices[0].text == got.choices[0].text


def test_streamed_completion_joins_to_the_whole(served):
    chunks = list(served.client().completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == alone(PROMPTS[1], 16)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16


@pytest.mark.parametrize("stream", [False, True])
def test_chat_is_the_chat_template_then_greedy(served, stream):
    messages = ({"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What colour is the sky?"})
    got = served.client().chat.completions.create(
        model=MODEL, messages=list(messages), max_tokens=10, temperature=0, stream=stream)
    if stream:
        chunks = list(got)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        text = got.choices[0].message.content
        ids = smollm2().tokenizer.encode_chat([dict(m) for m in messages])
        assert got.usage.prompt_tokens == len(ids)
    assert text == alone(tuple(tuple(m.items()) for m in messages), 10)


def test_concurrent_requests_each_get_their_output_alone(served):
    client, lengths = served.client(), [14, 6, 20, 10, 9, 17]
    prompts = [*PROMPTS, *PROMPTS[:2]]  # six requests for four batch rows: some wait

    def ask(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i],
                                          temperature=0).choices[0].text  # fmt: skip

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(ask, range(len(prompts)), timeout=2 * TIMEOUT))
    assert texts == [alone(p, n) for p, n in zip(prompts, lengths, strict=True)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_across_tokens_cuts_the_text(served, stream):
    whole = alone(PROMPTS[2], 20)
    stop = whole[9:13]  # four characters from inside the answer
    assert len(smollm2().tokenizer.encode(stop, add_special_tokens=False)) >= 1
    got = served.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20,
                                             temperature=0, stop=[stop, "@@@"], stream=stream)  # fmt: skip
    chunks = list(got) if stream else [got]
    assert "".join(c.choices[0].text for c in chunks) == whole[: whole.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def _idle(engine) -> bool:
    return not engine.running and not engine.waiting and engine.blocks.held == 0


def test_a_client_that_leaves_mid_stream_has_its_request_cancelled(served):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": LIMIT, "stream": True}
    with httpx.Client(timeout=TIMEOUT) as http, \
            http.stream("POST", f"{served.url}/v1/completions", json=body) as response:  # fmt: skip
        lines = response.iter_lines()
        events = []
        for line in lines:
            events += [line] if line.startswith("data:") else []
            if len(events) == 3:
                break  # three pieces, then the client goes away
    assert json.loads(events[0][5:])["choices"][0]["finish_reason"] is None
    deadline = time.monotonic() + TIMEOUT
    while not _idle(served.engine):
        assert time.monotonic() < deadline, "the engine still holds the request"
        time.sleep(0.05)
    request = served.submitted[-1]
    assert request.finish_reason == "cancelled" and len(request.output) < LIMIT


BAD = [  # (path, body: dict or raw bytes, status, the field named)
    ("completions", b"{not json", 400, "body"),
    ("completions", [1, 2], 400, "body"),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"prompt": 123}, 400, "prompt"),
    ("completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": LIMIT + 1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "messages": []}, 400, "messages"),
    ("completions", {"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("completions", {"prompt": "hi", "presence_penalty": "1"}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "logit_bias": {"a": 1}}, 400, "logit_bias.a"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "typo_temperature": 0}, 400, "typo_temperature"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": [1] * 8190, "max_tokens": 10}, 400, "max_tokens"),
    ("completions", {"prompt": "x" * 200_000}, 413, "body"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    *[("chat/completions", {"messages": [{"role": "user", "content": "hi"}], name: value}, 400,
       name) for name, value in [
        ("response_format", {"type": "xml"}), ("tools", [{"type": "function"}]),
        ("tool_choice", "auto"), ("store", True), ("top_logprobs", 2), ("logprobs", 1),
        ("user", 5), ("metadata", "m"), ("echo", True), ("audio", {})]],
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"schema": {}}}}, 400, "response_format.json_schema"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format.json_schema.schema"),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "[a-"}}, 400,
     "structured_outputs.regex"),
    ("completions", {"prompt": "hi", "structured_outputs": {"choice": "yes"}}, 400,
     "structured_outputs.choice"),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     400, "structured_outputs"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD,
                         ids=[f"{s}-{p}-{i}" for i, (_, _, s, p) in enumerate(BAD)])
def test_bad_requests_get_a_json_error_naming_the_field(served, path, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got = httpx.post(f"{served.url}/v1/{path}", content=raw, timeout=TIMEOUT,
                     headers={"content-type": "application/json"})  # fmt: skip
    error = got.json()["error"]
    assert (got.status_code, error["param"]) == (status, param), error
    assert error["type"] and param in error["message"], error


def test_the_openai_client_reads_the_errors(served):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        served.client().completions.create(model=MODEL, prompt="hi", max_tokens=LIMIT + 1)
    got = httpx.get(f"{served.url}/v1/nothing", timeout=TIMEOUT)
    assert got.status_code == 404 and got.json()["error"]["type"] == "not_found_error"


def test_serve_help_shows_the_options():
    runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
    result = runner.invoke(app, ["serve", "--help"])
    assert result.exit_code == 0, result.output
    for word in ("Example:", "qkv serve", "--host", "--port", "--max-batch", "--max-tokens",
                 "--num-blocks"):  # fmt: skip
        assert word in result.output, result.output


class _IdsTokenizer:
    """A stand-in tokenizer for a tiny model: token ids written as numbers."""

    eos_id = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_a_value_the_engine_refuses_is_a_400_naming_the_api_field():
    """The engine refuses a request longer than the model's 32 positions with the library's
    name (``max_new_tokens``); the app answers with the API's (``max_tokens``), mapped by the
    error's ``param``; the request that fits gets its greedy tokens."""
    import torch
    from fastapi.testclient import TestClient

    from qkv.generate import greedy, strip
    from qkv.models import DecoderLM, DecoderLMConfig
    from qkv.pretrained import DecoderBundle

    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(vocab_size=30, d_model=16, num_heads=2, num_layers=1,
                                      d_ff=32, max_len=32)).double().eval()  # fmt: skip
    bundle = DecoderBundle(model, _IdsTokenizer(), "tiny")
    engine = BatchingEngine(model, eos_id=None, max_batch=2, block_size=4, num_blocks=16)
    with TestClient(make_app(bundle, engine, max_tokens_limit=100)) as client:
        bad = client.post("/v1/completions", json={"prompt": [1] * 30, "max_tokens": 5})
        good = client.post("/v1/completions", json={"prompt": "3 4 5", "max_tokens": 4,
                                                    "temperature": 0})  # fmt: skip
    error = bad.json()["error"]
    assert (bad.status_code, error["param"]) == (400, "max_tokens"), error
    assert error["message"] == ("a prompt of 30 tokens + 'max_tokens'=5 exceeds the model's 32 "
                                "positions"), error  # fmt: skip
    want = strip(greedy(model, [[3, 4, 5]], max_new_tokens=4, eos_id=None), None)[0]
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == " ".join(
        map(str, want)), good.json()
