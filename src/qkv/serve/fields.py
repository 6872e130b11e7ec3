"""The checks every field of a ``qkv serve`` request goes through, and the one error a bad
request becomes, :class:`ApiError`, which the app answers as OpenAI does::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}

A message names the field, what it must be, and what was received (a JSON type, or the
value). Status codes: 400 for a malformed or invalid body, 401 for a missing or wrong API key,
404 for another model's name, 413 for a body over the server's limit.
"""

from __future__ import annotations

import json
from typing import Any

from qkv.checks import is_int, is_number

__all__ = ["ApiError", "flag", "kind", "number", "read_json", "shown", "text"]

_JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
               list: "an array", dict: "an object", type(None): "null"}  # fmt: skip


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object.

    Args:
        status: the HTTP status (400, 401, 404, 413, 500, 503).
        message: what is wrong, naming the field and the value received.
        param: the field at fault (None: the request as a whole).
        kind: OpenAI's error ``type``.
        code: OpenAI's error ``code`` (``"invalid_api_key"``; None for most).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


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
        raise ApiError(400, f"the body must be a JSON object, got {kind(body)}", "body")
    return body


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the body must be at most {limit} bytes, got {size} or more", "body",
                    kind="request_too_large")  # fmt: skip


def number(body: dict[str, Any], name: str, want: type, default: Any, *,
           low: float | None = None, high: float | None = None) -> Any:  # fmt: skip
    """Field ``name`` as an int (``want=int``) or a finite number, within ``[low, high]``;
    ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    ok = is_int(value) or (want is float and is_number(value))
    if not ok:
        what = "an integer" if want is int else "a number"
        raise ApiError(400, f"'{name}' must be {what}, got {shown(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"at least {low}" if high is None else f"in [{low}, {high}]"
        if name.startswith("max_") and high is not None:
            span = f"between {low} and {high} (this server's limit)"
        raise ApiError(400, f"'{name}' must be {span}, got {value}", name)
    return want(value)


def flag(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    """Field ``name`` as a boolean (absent or null: False)."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{param or name}' must be a boolean, got {shown(value)}",
                       param or name)  # fmt: skip
    return bool(value)


def text(body: dict[str, Any], name: str) -> str | None:
    """Field ``name`` as a string (absent or null: None)."""
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string, got {shown(value)}", name)
    return value


def kind(value: object) -> str:
    """The JSON type of ``value``, in words."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def shown(value: object) -> str:
    """``value`` for an error message: its JSON type and, when short, itself."""
    dumped = json.dumps(value)
    return kind(value) + (f" {dumped}" if len(dumped) <= 40 else "")
