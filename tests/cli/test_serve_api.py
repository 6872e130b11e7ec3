"""``qkv serve``'s request options beyond the basics (issue 45), through OpenAI's own client
on 127.0.0.1: ``n`` choices, the frequency and presence penalties and the logit bias,
``logprobs`` in both APIs' shapes, ``echo``, fields with no effect, ``/metrics``, the API key
and a port in use refused before the model loads.

References: each choice's text equals the request decoded alone with its options
(``bundle.generate_ids`` with the same :func:`~qkv.generate.engine.decoding_params`, choice
``i`` seeded ``seed + i``); log-probabilities equal ``log_softmax`` of SmolLM2's full forward
pass over prompt + answer in float64, within a bound measured in the same test from the float32
forward's own error."""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("fastapi", reason="qkv serve needs the serve extra")
pytest.importorskip("uvicorn", reason="qkv serve needs the serve extra")
openai = pytest.importorskip("openai", reason="the tests talk through OpenAI's client")
parser = pytest.importorskip("prometheus_client.parser", reason="qkv serve's /metrics")

from serving import MODEL, PROMPTS, TIMEOUT, alone, serving, smollm2  # noqa: E402

from qkv.cli.app import app  # noqa: E402
from qkv.serve.logprobs import TokenBytes  # noqa: E402

CHAT = ({"role": "user", "content": "Name three colours."},)


@pytest.fixture(scope="module")
def served():
    with serving() as out:
        yield out


def _stream_texts(chunks, n: int) -> tuple[list[str], list[str | None]]:
    """The text and finish reason of each of ``n`` choices from streamed chunks."""
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] += piece or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return texts, reasons


def test_n_sampled_choices_are_each_their_seed_alone(served):
    got = served.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12,
                                             n=3, temperature=0.8, seed=11)  # fmt: skip
    want = [alone(PROMPTS[1], 12, temperature=0.8, seed=11 + i) for i in range(3)]
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == want
    assert len(set(want)) > 1, f"the seeds gave one text ({want}): the test could not fail"
    assert got.usage.completion_tokens == sum(len(r.output) for r in served.submitted[-3:])
    assert got.usage.prompt_tokens == len(smollm2().tokenizer.encode(PROMPTS[1]))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_choices_join_to_each_alone(served, chat):
    client = served.client()
    common = dict(model=MODEL, max_tokens=10, n=2, temperature=0.9, seed=4, stream=True)
    if chat:
        chunks = list(client.chat.completions.create(messages=list(CHAT), **common))
        want = [alone(tuple(tuple(m.items()) for m in CHAT), 10, temperature=0.9, seed=4 + i)
                for i in range(2)]  # fmt: skip
    else:
        chunks = list(client.completions.create(prompt=PROMPTS[0], **common))
        want = [alone(PROMPTS[0], 10, temperature=0.9, seed=4 + i) for i in range(2)]
    texts, reasons = _stream_texts(chunks, 2)
    assert texts == want
    assert all(r in ("stop", "length") for r in reasons), reasons


@pytest.mark.parametrize("options", [
    dict(frequency_penalty=1.2, presence_penalty=0.6), dict(frequency_penalty=-2.0,
                                                              presence_penalty=2.0),
    "ban the first token"], ids=str)
def test_penalties_and_logit_bias_answer_as_alone(served, options):
    prompt = PROMPTS[2]
    if options == "ban the first token":
        first = smollm2().tokenizer.encode(alone(prompt, 1), add_special_tokens=False)[0]
        options = dict(logit_bias={first: -100.0}, frequency_penalty=0.3)
    bias = options.get("logit_bias", {})
    api = {**options, "logit_bias": {str(t): b for t, b in bias.items()}}
    got = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                             temperature=0, **api)  # fmt: skip
    library = {**options, "logit_bias": tuple(bias.items()) or None}
    want = alone(prompt, 24, **library)
    assert got.choices[0].text == want
    assert want != alone(prompt, 24), "the options changed nothing: the test could not fail"


def _reference_logprobs(prompt_ids: list[int], answer_ids: list[int]) -> tuple[list, float]:
    """log_softmax of SmolLM2's full forward over prompt + answer in float64, at each answer
    token, and the float32 forward's own largest error against it."""
    model = smollm2().model
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        low = model(ids)[0].double().log_softmax(-1)  # (L, V)
        model.double()
        try:
            high = model(ids)[0].log_softmax(-1)  # (L, V)
        finally:
            model.float()
    rows = range(len(prompt_ids) - 1, len(prompt_ids) + len(answer_ids) - 1)
    err = max((low[r] - high[r]).abs().max().item() for r in rows)
    return [high[r] for r in rows], err


def test_chat_logprobs_are_the_model_s_and_their_bytes_join_to_the_text(served):
    got = served.client().chat.completions.create(model=MODEL, messages=list(CHAT),
                                                  max_tokens=12, temperature=0, logprobs=True,
                                                  top_logprobs=3)  # fmt: skip
    choice = got.choices[0]
    content = choice.logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    tokenizer = smollm2().tokenizer
    prompt = tokenizer.encode_chat([dict(m) for m in CHAT])
    answer = served.submitted[-1].output[: len(content)]
    want, own = _reference_logprobs(prompt, answer)
    bound = 4 * own + 1e-6  # the served steps and the full forward: float32 both
    for i, (entry, row) in enumerate(zip(content, want, strict=True)):
        assert next(t.token for t in entry.top_logprobs) == entry.token, f"token {i}: not argmax"
        assert len(entry.top_logprobs) == 3
        err = abs(entry.logprob - row[answer[i]].item())
        assert err <= bound, f"token {i}: logprob error {err:.2e} (bound {bound:.2e})"
        top = row.topk(3)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [
            TokenBytes(tokenizer)(t) for t in top.indices.tolist()], f"token {i}: other top"


def test_completion_logprobs_streamed_equal_whole(served):
    client, common = served.client(), dict(model=MODEL, prompt=PROMPTS[3], max_tokens=10,
                                           temperature=0, logprobs=2)  # fmt: skip
    whole = client.completions.create(**common).choices[0]
    lp = whole.logprobs
    assert "".join(lp.tokens) == whole.text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    assert all(len(top) <= 2 and max(top.values()) >= p - 1e-6
               for top, p in zip(lp.top_logprobs, lp.token_logprobs, strict=True))  # fmt: skip
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert [whole.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens,
                                                          strict=True)] == [True] * len(lp.tokens)
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**common, stream=True):
        for c in chunk.choices:
            for key in streamed:
                streamed[key] += getattr(c.logprobs, key) if c.logprobs else []
    assert streamed == {k: getattr(lp, k) for k in streamed}


def test_echo_starts_with_the_prompt(served):
    client = served.client()
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                    temperature=0, echo=True)  # fmt: skip
    assert got.choices[0].text == PROMPTS[0] + alone(PROMPTS[0], 8)
    chunks = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                       temperature=0, echo=True, stream=True)  # fmt: skip
    assert _stream_texts(chunks, 1)[0] == [got.choices[0].text]


def test_fields_with_no_effect_are_accepted(served):
    got = served.client().chat.completions.create(
        model=MODEL, messages=list(CHAT), max_tokens=6, temperature=0, user="u-1",
        metadata={"k": "v"}, service_tier="auto", parallel_tool_calls=False,
        tool_choice="none", response_format={"type": "text"}, store=False)
    assert got.choices[0].message.content == alone(tuple(tuple(m.items()) for m in CHAT), 6)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def test_metrics_count_what_was_served(served):
    before = _metrics(served.url)
    client = served.client()
    got = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=7, temperature=0)
    list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=5, temperature=0,
                                   stream=True))  # fmt: skip
    httpx.post(f"{served.url}/v1/completions", json={"prompt": "hi", "n": 99}, timeout=TIMEOUT)
    after = _metrics(served.url)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("qkv_generation_tokens_total") == got.usage.completion_tokens + 5
    assert grew("qkv_prompt_tokens_total") == 2 * got.usage.prompt_tokens
    assert grew("qkv_time_to_first_token_seconds_count") == 2
    assert grew("qkv_inter_token_latency_seconds_count") == got.usage.completion_tokens - 1 + 4
    assert grew("qkv_requests_refused_total{status=400}") == 1
    assert grew("qkv_requests_total{finish_reason=length}") == 2
    assert after["qkv_requests_running"] == 0 and after["qkv_requests_waiting"] == 0
    assert after["qkv_cache_blocks_used"] == 0 and after["qkv_cache_blocks"] == 160


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}  # fmt: skip


def test_json_schema_answers_parse_and_validate(served):
    """Six sampled answers under a strict JSON schema, decoded together, all end, parse and
    validate (jsonschema); two greedy ones in plain JSON mode, where any object is allowed
    and a small model may loop until ``max_tokens``: those that end parse as objects."""
    jsonschema = pytest.importorskip("jsonschema", reason="answers are validated by jsonschema")
    client = served.client()
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    strict = {"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                     "schema": PERSON}}  # fmt: skip

    def one(i: int):
        if i < 6:
            return client.chat.completions.create(model=MODEL, messages=ask, max_tokens=120,
                                                  temperature=0.8, seed=i, response_format=strict)
        return client.chat.completions.create(
            model=MODEL, max_tokens=80, temperature=0, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": f"Give {topics[i]} as a JSON object."}])

    topics = {6: "a city and its country", 7: "a book and its author"}
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(8)))
    for i, got in enumerate(answers[:6]):
        choice = got.choices[0]
        assert choice.finish_reason == "stop", (i, choice.finish_reason, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # JSON mode: an answer that ended is one JSON object (one cut by max_tokens is a prefix)
    ended = [a.choices[0].message.content for a in answers[6:]
             if a.choices[0].finish_reason == "stop"]  # fmt: skip
    assert ended, "no JSON-mode answer ended: nothing was checked"
    assert all(isinstance(json.loads(text), dict) for text in ended), ended


@pytest.mark.parametrize(("form", "check"), [
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'},
     lambda t: re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", t)),
], ids=["regex", "choice", "lark"])
def test_structured_outputs_hold_completions_to_their_form(served, form, check):
    got = served.client().completions.create(model=MODEL, prompt="My favourite:", max_tokens=40,
                                             temperature=0, extra_body={"structured_outputs":
                                                                        form})  # fmt: skip
    assert got.choices[0].finish_reason == "stop" and check(got.choices[0].text), got


SYSTEM = ("You are a careful assistant. " * 30).strip()


def test_requests_sharing_a_system_prompt_read_its_blocks_once(served):
    """Three chats with one long system prompt at once: each answer is its own alone, and
    the later ones read the system prompt's blocks instead of computing them."""
    before = _metrics(served.url)
    chats = [({"role": "system", "content": SYSTEM}, {"role": "user", "content": q})
             for q in ("Hi!", "What is 2 + 2?", "Name a fruit.")]  # fmt: skip
    client = served.client()
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda c: client.chat.completions.create(
            model=MODEL, messages=list(c), max_tokens=8, temperature=0), chats))
    for chat, got in zip(chats, answers, strict=True):
        assert got.choices[0].message.content == alone(tuple(tuple(m.items()) for m in chat), 8)
    after = _metrics(served.url)
    system_tokens = len(smollm2().tokenizer.encode(SYSTEM, add_special_tokens=False))
    hits = after["qkv_prefix_cache_hit_tokens"] - before.get("qkv_prefix_cache_hit_tokens", 0)
    assert hits >= 2 * (system_tokens // 16 - 1) * 16, (hits, system_tokens)


def test_an_api_key_guards_the_v1_routes():
    with serving(api_key="s3cret", max_batch=1) as served:
        url = served.url
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=TIMEOUT).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            got = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=headers,
                             timeout=TIMEOUT)  # fmt: skip
            assert got.status_code == 401, got.text
            assert got.json()["error"]["code"] == "invalid_api_key", got.text
        with pytest.raises(openai.AuthenticationError):
            served.client(key="wrong").models.list()
        assert [m.id for m in served.client().models.list().data] == [MODEL]
        got = served.client().completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                                 temperature=0)  # fmt: skip
        assert got.choices[0].text == alone("hi", 3)


def test_a_port_in_use_is_refused_before_the_model_loads(monkeypatch):
    import qkv.pretrained

    monkeypatch.setattr(qkv.pretrained, "load", lambda *a, **k: pytest.fail("model loaded"))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        result = CliRunner().invoke(app, ["serve", MODEL, "--port", str(port)])
    finally:
        holder.close()
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --port"), result.output
    assert "in use" in lines[0], result.output
    result = CliRunner(env={"QKV_API_KEY": " "}).invoke(app, ["serve", MODEL])
    assert result.exit_code == 2 and "--api-key" in result.output, result.output


def test_serve_help_names_the_new_options():
    runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
    result = runner.invoke(app, ["serve", "--help"])
    assert result.exit_code == 0, result.output
    for word in ("--api-key", "QKV_API_KEY", "--access-log", "/metrics", "--no-prefix-cache",
                 "--prefill-chunk"):  # fmt: skip
        assert word in result.output, result.output


def test_qkv_serve_runs_as_a_command_and_stops_on_sigterm():
    """The real command in a child process: the port it took in its one announce line, an
    answer equal to the request alone, a graceful stop on SIGTERM with exit status 0."""
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "serve", MODEL, "--port", "0",
                             "--max-batch", "2", "--no-access-log"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 120
        while url is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if found := re.search(r"serving .* on (http://127\.0\.0\.1:\d+/v1)", line):
                url = found.group(1)
        client = openai.OpenAI(base_url=url, api_key="x", timeout=TIMEOUT, max_retries=0)
        got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                        temperature=0)  # fmt: skip
        assert got.choices[0].text == alone(PROMPTS[0], 8)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
