"""Structured output's fields of a ``qkv serve`` request, read into one
:class:`~qkv.generate.grammar.Grammar`: chat's ``response_format`` (OpenAI's ``text``,
``json_object`` and ``json_schema``) or vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``: a Lark grammar) in either API. A schema or grammar llguidance refuses
is a 400 naming the field, with llguidance's reason.
"""

from __future__ import annotations

import json
from typing import Any

from qkv.generate.args import ParamError
from qkv.generate.grammar import Grammar
from qkv.serve.fields import ApiError, kind, shown

__all__ = ["grammar_of"]

STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def grammar_of(body: dict[str, Any], chat: bool) -> Grammar | None:
    """What the text must match: chat's ``response_format`` (``text``, ``json_object``,
    ``json_schema``), or ``structured_outputs`` (one of ``json``, ``regex``, ``choice``,
    ``grammar``); not both."""
    fmt, extra = body.get("response_format") if chat else None, body.get("structured_outputs")
    if fmt is not None and extra is not None:
        raise ApiError(400, "'response_format' and 'structured_outputs' cannot both be given",
                       "structured_outputs")  # fmt: skip
    if extra is not None:
        return _structured(extra)
    if fmt is None:
        return None
    kind_ = fmt.get("type") if isinstance(fmt, dict) else None
    if kind_ not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, \"json_object\" "
                       f"or \"json_schema\"}}, got {shown(fmt)}", "response_format")  # fmt: skip
    if kind_ == "text":
        return None
    if kind_ == "json_object":
        return _made("json_object", "", "response_format")
    spec, param = fmt.get("json_schema"), "response_format.json_schema"
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ApiError(400, f"'{param}' must be an object with a 'name' and a 'schema', got "
                       f"{shown(spec)}", param)  # fmt: skip
    schema = spec.get("schema")
    if schema is None:
        return _made("json_object", "", param)
    if not isinstance(schema, dict):
        raise ApiError(400, f"'{param}.schema' must be a JSON schema (an object), got "
                       f"{shown(schema)}", f"{param}.schema")  # fmt: skip
    return _made("json_schema", json.dumps(schema), f"{param}.schema")


def _structured(extra: object) -> Grammar:
    """vLLM's ``structured_outputs``: exactly one of its kinds."""
    given = [k for k in STRUCTURED if isinstance(extra, dict) and extra.get(k) is not None]
    if not isinstance(extra, dict) or len(given) != 1 or set(extra) - set(STRUCTURED):
        raise ApiError(400, f"'structured_outputs' must be an object with one of "
                       f"{', '.join(STRUCTURED)}, got {shown(extra)}",
                       "structured_outputs")  # fmt: skip
    name, value = given[0], extra[given[0]]
    param = f"structured_outputs.{name}"
    want = {"json": dict, "regex": str, "choice": list, "grammar": str}[name]
    if not isinstance(value, want):
        raise ApiError(400, f"'{param}' must be {kind(want())}, got {shown(value)}", param)
    source = value if isinstance(value, str) else json.dumps(value)
    return _made(STRUCTURED[name], source, param)


def _made(kind_: str, source: str, param: str) -> Grammar:
    """The grammar, or a 400 naming ``param`` with llguidance's reason."""
    try:
        return Grammar(kind_, source)
    except ParamError as err:
        raise ApiError(400, err.named(f"'{param}'"), param) from None
