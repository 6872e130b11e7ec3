"""What a request to ``qkv serve`` asks for: the JSON body read once, every OpenAI field checked,
and the result one frozen :class:`Job`.

A bad request is one :class:`ApiError`, which the app answers as OpenAI does::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}

The message names the field, what it must be, and what was received (a JSON type, or the
value). Status codes: 400 for a malformed or invalid body, 413 for a body over the server's
limit, 404 for another model's name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ApiError", "Job", "parse_job", "read_json"]

MAX_STOPS = 4  # OpenAI's limit on stop strings
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields of OpenAI's API this server does not implement: refused unless left at their default.
UNSUPPORTED = {"echo": (None, False), "logprobs": (None, False, 0), "best_of": (None, 1),
               "suffix": (None, ""), "tools": (None, []), "logit_bias": (None, {})}  # fmt: skip
_JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
               list: "an array", dict: "an object", type(None): "null"}  # fmt: skip


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object.

    Args:
        status: the HTTP status (400, 404, 413, 500, 503).
        message: what is wrong, naming the field and the value received.
        param: the field at fault (None: the request as a whole).
        kind: OpenAI's error ``type``.
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One checked request.

    Attributes:
        prompt: the completion prompt (text or token ids), or the chat's messages
            (``[{"role", "content"}]`` with text content).
        max_tokens: the most new tokens.
        temperature, top_p, top_k, seed: decoding (temperature 0: greedy).
        stop: strings that end the text (cut before them).
        stream: answer with server-sent events.
        include_usage: streaming: a last chunk with the token counts.
        model: the model the client named (None: not given).
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


async def read_json(http_request: Any, max_bytes: int) -> dict[str, Any]:
    """The body of ``http_request`` (a Starlette request) as a JSON object, read up to
    ``max_bytes`` (a longer body is refused as soon as it passes the limit).

    Raises:
        ApiError: 413 for a body over ``max_bytes``; 400 for a body that is not a JSON object.
    """
    declared = http_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in http_request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as err:  # (UnicodeDecodeError is a ValueError)
        raise ApiError(400, f"the body must be JSON, got a parse error: {err}", "body") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {_kind(body)}", "body")
    return body


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the body must be at most {limit} bytes, got {size} or more", "body",
                    kind="request_too_large")  # fmt: skip


def parse_job(body: dict[str, Any], *, chat: bool, max_tokens_limit: int) -> Job:
    """Check a completions (``chat=False``) or chat-completions body; return its :class:`Job`.

    Unknown fields are ignored, as OpenAI-compatible servers do; the fields of
    :data:`UNSUPPORTED` are refused unless left at their default.

    Raises:
        ApiError: 400 naming the first field that is missing, of the wrong type or out of range.
    """
    for name, defaults in UNSUPPORTED.items():
        if name in body and body[name] not in defaults:
            raise ApiError(400, f"'{name}' is not supported by this server, got "
                           f"{_shown(body[name])}", name)  # fmt: skip
    n = _number(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {n}", "n")
    prompt = _messages(body) if chat else _prompt(body)
    default_tokens = max_tokens_limit if chat else 16  # OpenAI's defaults: no limit / 16
    name = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
    max_tokens = _number(body, name, int, default_tokens, low=1, high=max_tokens_limit)
    temperature = _number(body, "temperature", float, 1.0, low=0.0, high=2.0)
    top_p = _number(body, "top_p", float, None, low=0.0, high=1.0)
    if top_p == 0.0:
        raise ApiError(400, "'top_p' must lie in (0, 1], got 0", "top_p")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, f"'stream_options' must be an object, got {_kind(options)}",
                       "stream_options")  # fmt: skip
    return Job(prompt, max_tokens, temperature, top_p,
               top_k=_number(body, "top_k", int, None, low=1),
               seed=_number(body, "seed", int, None, low=-(2**63), high=2**64 - 1),
               stop=_stops(body), stream=_flag(body, "stream"),
               include_usage=_flag(options, "include_usage", "stream_options.include_usage"),
               model=_text(body, "model"))  # fmt: skip


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
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a non-empty string or list of token ids (one prompt "
                   f"per request), got {_shown(prompt)}", "prompt")  # fmt: skip


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``messages``: a non-empty list of ``{"role", "content"}``, content as text (OpenAI's
    text parts ``[{"type": "text", "text": ...}]`` joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "nothing" if messages is None else _shown(messages)
        raise ApiError(400, f"'messages' must be a non-empty array of messages, got {got}",
                       "messages")  # fmt: skip
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"'{where}' must be an object, got {_kind(message)}", where)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got "
                           f"{_shown(role)}", f"{where}.role")  # fmt: skip
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
                   f"{_shown(content)}", f"{where}.content")  # fmt: skip


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):  # fmt: skip
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most "
                       f"{MAX_STOPS} of them, got {_shown(stop)}", "stop")  # fmt: skip
    return tuple(stops)


def _number(body: dict[str, Any], name: str, kind: type, default: Any, *,
            low: float | None = None, high: float | None = None) -> Any:  # fmt: skip
    """Field ``name`` as an int (``kind=int``) or a finite number, within ``[low, high]``."""
    value = body.get(name)
    if value is None:
        return default
    ok = _is_int(value) or (kind is float and isinstance(value, float) and math.isfinite(value))
    if not ok:
        what = "an integer" if kind is int else "a number"
        raise ApiError(400, f"'{name}' must be {what}, got {_shown(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"at least {low}" if high is None else f"in [{low}, {high}]"
        if name.startswith("max_") and high is not None:
            span = f"between {low} and {high} (this server's limit)"
        raise ApiError(400, f"'{name}' must be {span}, got {value}", name)
    return kind(value)


def _flag(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{param or name}' must be a boolean, got {_shown(value)}",
                       param or name)  # fmt: skip
    return bool(value)


def _text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string, got {_shown(value)}", name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    """The JSON type of ``value``, in words."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    """``value`` for an error message: its JSON type and, when short, itself."""
    text = json.dumps(value)
    return _kind(value) + (f" {text}" if len(text) <= 40 else "")
