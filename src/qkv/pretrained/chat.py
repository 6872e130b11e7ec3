"""Chat templates: turning a list of messages into the prompt text a chat model was tuned on.

A chat model expects its conversation in a fixed markup, e.g. SmolLM2's

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n

The checkpoint ships that markup as a Jinja template (GGUF ``tokenizer.chat_template``, Hugging
Face ``tokenizer_config.json``'s ``chat_template``). It is rendered here the way Hugging Face's
``apply_chat_template`` renders it (a sandboxed environment, ``trim_blocks`` and
``lstrip_blocks``, a ``raise_exception`` helper, a ``tojson`` filter), so the text, and hence
the token ids, are the same. ``jinja2`` comes with torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from qkv.pretrained.errors import require

__all__ = ["check_messages", "render_chat"]


def check_messages(messages: object) -> list[dict[str, str]]:
    """Validate a conversation: a non-empty list of ``{"role": str, "content": str}``.

    Raises:
        TypeError: not a list of mappings, or a role/content that is not a string.
        ValueError: an empty list, or a message without ``role`` or ``content``.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
            f"{type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages must hold at least one message, got an empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] has no {key!r} key: {dict(m)!r:.100}")
            if not isinstance(m[key], str):
                raise TypeError(
                    f"messages[{i}][{key!r}] must be a str, got {type(m[key]).__name__}"
                )
        out.append(dict(m))
    return out


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    ext = require("jinja2.ext", "jinja2")
    sandbox = require("jinja2.sandbox", "jinja2")

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(
    template: str,
    messages: object,
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
) -> str:
    """Render ``messages`` with a Jinja chat ``template``.

    Args:
        template: the Jinja source shipped with the model.
        messages: list of ``{"role": "system" | "user" | "assistant", "content": str}``.
        add_generation_prompt: end with the opening of an assistant turn, so the model's
            continuation is its reply.
        special_tokens: variables the template may use (``bos_token``, ``eos_token``, ...).

    Returns:
        The prompt text (special tokens as text; the tokenizer maps them to their ids).

    Raises:
        TypeError / ValueError: malformed messages (see :func:`check_messages`), or the
            template's own ``raise_exception`` (e.g. roles out of order).
    """
    msgs = check_messages(messages)
    return _compile(template).render(
        messages=msgs, add_generation_prompt=add_generation_prompt, **dict(special_tokens or {})
    )
