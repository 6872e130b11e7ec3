"""What a request to ``qkv serve`` asks for: the JSON body read once, every field checked, and
the result one frozen :class:`Job`.

Every field of OpenAI's completions and chat-completions APIs is either *used*, *accepted with
no effect on the answer* (:data:`NO_EFFECT`: who the user is, metadata, cache hints), or
*refused* with a 400 naming it unless left at its default (:data:`UNSUPPORTED`); a field
neither API has is refused too (:data:`EXTRAS` are the few beyond OpenAI's that this server
takes, as vLLM does). Nothing a client asks for is silently ignored.

Errors are :class:`~qkv.serve.fields.ApiError` (re-exported here), built by the checks of
:mod:`qkv.serve.fields`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkv.checks import is_int, is_number
from qkv.generate.grammar import Grammar
from qkv.serve.fields import ApiError, flag, kind, number, read_json, shown, text
from qkv.serve.formats import grammar_of

__all__ = ["ApiError", "Job", "parse_job", "read_json"]

MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_CHOICES = 16  # the most choices (`n`) one request may ask for
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}  # OpenAI's limits on the alternatives shown
ROLES = ("system", "developer", "user", "assistant", "tool")
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
          "stop", "seed", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
          "user"}  # fmt: skip
FIELDS = {
    "completions": COMMON | {"prompt", "echo", "best_of", "suffix"},
    "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "metadata", "store",
                      "service_tier", "safety_identifier", "prompt_cache_key",
                      "parallel_tool_calls", "tools", "tool_choice", "functions",
                      "function_call", "response_format", "modalities", "audio", "prediction",
                      "reasoning_effort", "verbosity", "web_search_options"},
}  # fmt: skip
# Beyond OpenAI's fields, as vLLM's server takes them: the sampling filters and the CTRL
# repetition penalty of qkv.generate, and vLLM's structured outputs (a regex, a choice, a JSON
# schema or a Lark grammar, in either API).
EXTRAS = {"top_k", "min_p", "repetition_penalty", "structured_outputs"}
# Accepted with no effect on the answer (checked for their JSON type only).
NO_EFFECT = {"user": str, "metadata": dict, "safety_identifier": str, "prompt_cache_key": str,
             "service_tier": str, "parallel_tool_calls": bool}  # fmt: skip
# Not implemented: refused unless left at one of these defaults.
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
               "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "store": (None, False),
               "modalities": (None, ["text"]), "audio": (None,),
               "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
               "web_search_options": (None,)}  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One checked request.

    Attributes:
        prompt: the completion prompt (text or token ids), or the chat's messages
            (``[{"role", "content"}]`` with text content).
        max_tokens: the most new tokens (each choice).
        temperature, top_p, top_k, min_p, seed: decoding (temperature 0: greedy).
        stop: strings that end the text (cut before them).
        stream: answer with server-sent events.
        include_usage: streaming: a last chunk with the token counts.
        model: the model the client named (None: not given).
        n: how many choices (each decoded as its own request; choice ``i`` seeded ``seed + i``).
        frequency_penalty, presence_penalty, logit_bias, repetition_penalty: the controls of
            :class:`~qkv.generate.controls.GenerationControls` (``logit_bias`` as
            ``(id, bias)`` pairs).
        logprobs: None, or how many of the most probable tokens to show beside each token's
            log-probability (chat: ``top_logprobs``; completions: ``logprobs``).
        echo: completions: the answer starts with the prompt's text.
        grammar: what the text must match (``response_format``, ``structured_outputs``), or
            None.
    """

    prompt: str | list[int] | list[dict[str, str]]
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None
    echo: bool = False
    grammar: Grammar | None = None

    def decoding(self) -> dict[str, Any]:
        """The keywords of :func:`~qkv.generate.engine.decoding_params` this job asks for
        (the seed aside: each choice has its own)."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    stop=self.stop, logprobs=self.logprobs, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty,
                    frequency_penalty=self.frequency_penalty or None,
                    presence_penalty=self.presence_penalty or None,
                    logit_bias=self.logit_bias or None, grammar=self.grammar)  # fmt: skip


def parse_job(body: dict[str, Any], *, chat: bool, max_tokens_limit: int) -> Job:
    """Check a completions (``chat=False``) or chat-completions body; return its :class:`Job`.

    Raises:
        ApiError: 400 naming the first field that is unknown, not supported, missing, of the
            wrong type or out of range.
    """
    _check_names(body, "chat" if chat else "completions")
    prompt = _messages(body) if chat else _prompt(body)
    default_tokens = max_tokens_limit if chat else 16  # OpenAI's defaults: no limit / 16
    name = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
    max_tokens = number(body, name, int, default_tokens, low=1, high=max_tokens_limit)
    temperature = number(body, "temperature", float, 1.0, low=0.0, high=2.0)
    top_p = number(body, "top_p", float, None, low=0.0, high=1.0)
    if top_p == 0.0:
        raise ApiError(400, "'top_p' must lie in (0, 1], got 0", "top_p")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, f"'stream_options' must be an object, got {kind(options)}",
                       "stream_options")  # fmt: skip
    echo = flag(body, "echo")
    logprobs = _logprobs(body, chat)
    if echo and logprobs is not None:
        raise ApiError(400, "'echo' with 'logprobs' (the prompt's log-probabilities) is not "
                       "supported by this server; ask for one of them", "echo")  # fmt: skip
    return Job(prompt, max_tokens, temperature, top_p,
               top_k=number(body, "top_k", int, None, low=1),
               seed=number(body, "seed", int, None, low=-(2**63), high=2**64 - 1),
               stop=_stops(body), stream=flag(body, "stream"),
               include_usage=flag(options, "include_usage", "stream_options.include_usage"),
               model=text(body, "model"), n=number(body, "n", int, 1, low=1, high=MAX_CHOICES),
               frequency_penalty=number(body, "frequency_penalty", float, 0.0, low=-2, high=2),
               presence_penalty=number(body, "presence_penalty", float, 0.0, low=-2, high=2),
               logit_bias=_logit_bias(body),
               repetition_penalty=number(body, "repetition_penalty", float, None, low=0),
               min_p=number(body, "min_p", float, None, low=0, high=1),
               logprobs=logprobs, echo=echo, grammar=grammar_of(body, chat))  # fmt: skip


def _check_names(body: dict[str, Any], api: str) -> None:
    """Refuse a field neither the API nor :data:`EXTRAS` has, one of :data:`UNSUPPORTED` away
    from its defaults, one of :data:`NO_EFFECT` of the wrong JSON type."""
    for name, value in body.items():
        if name not in FIELDS[api] and name not in EXTRAS:
            where = "chat completions" if api == "chat" else "completions"
            raise ApiError(400, f"'{name}' is not a field of the {where} API this server "
                           f"knows (refused rather than ignored), got {shown(value)}",
                           name)  # fmt: skip
        if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
            raise ApiError(400, f"'{name}' is not supported by this server, got "
                           f"{shown(value)}", name)  # fmt: skip
        if name in NO_EFFECT and value is not None and not isinstance(value, NO_EFFECT[name]):
            raise ApiError(400, f"'{name}' must be {kind(NO_EFFECT[name]())}, got "
                           f"{shown(value)}", name)  # fmt: skip


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives to show beside each token's log-probability, or None (off):
    chat's ``logprobs`` (a boolean) and ``top_logprobs``; completions' ``logprobs`` (a
    count)."""
    if not chat:
        return number(body, "logprobs", int, None, low=0, high=MAX_TOP_LOGPROBS["completions"])
    top = number(body, "top_logprobs", int, None, low=0, high=MAX_TOP_LOGPROBS["chat"])
    if not flag(body, "logprobs"):
        if top is not None:
            raise ApiError(400, f"'top_logprobs' needs 'logprobs': true, got 'top_logprobs'="
                           f"{top} without it", "top_logprobs")  # fmt: skip
        return None
    return top or 0


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object of token ids (as strings, JSON's keys) to biases in
    [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, f"'logit_bias' must be an object of token ids to numbers, got "
                       f"{shown(bias)}", "logit_bias")  # fmt: skip
    pairs = []
    for key, value in bias.items():
        param = f"logit_bias.{key}"
        if not key.isdigit():
            raise ApiError(400, f"'{param}': the keys of 'logit_bias' must be token ids "
                           f"(digits), got {key!r}", param)  # fmt: skip
        if not is_number(value) or not -100 <= value <= 100:
            raise ApiError(400, f"'{param}' must be a number in [-100, 100], got "
                           f"{shown(value)}", param)  # fmt: skip
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _prompt(body: dict[str, Any]) -> str | list[int]:
    """``prompt``: a string or token ids (a list of one string reads as that string)."""
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required (a string or a list of token ids)", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a non-empty string or list of token ids (one prompt "
                   f"per request), got {shown(prompt)}", "prompt")  # fmt: skip


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``messages``: a non-empty list of ``{"role", "content"}``, content as text (OpenAI's
    text parts ``[{"type": "text", "text": ...}]`` joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "nothing" if messages is None else shown(messages)
        raise ApiError(400, f"'messages' must be a non-empty array of messages, got {got}",
                       "messages")  # fmt: skip
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"'{where}' must be an object, got {kind(message)}", where)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got "
                           f"{shown(role)}", f"{where}.role")  # fmt: skip
        out.append({"role": role, "content": _content(message.get("content"), where)})
    return out


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"'{where}.content' must be a string or a list of text parts, got "
                   f"{shown(content)}", f"{where}.content")  # fmt: skip


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):  # fmt: skip
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most "
                       f"{MAX_STOPS} of them, got {shown(stop)}", "stop")  # fmt: skip
    return tuple(stops)
