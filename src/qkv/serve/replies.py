"""OpenAI's response objects for one request of ``qkv serve``: the whole answer
(``text_completion`` / ``chat.completion``), or its server-sent events
(``text_completion`` / ``chat.completion.chunk`` chunks, ``data: {...}`` then ``data: [DONE]``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

__all__ = ["Reply", "sse"]


class Reply:
    """OpenAI's response objects for one request: whole, or as stream chunks."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat, self.prompt_tokens = chat, prompt_tokens
        kind = "chat.completion" if chat else "text_completion"
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": kind, "created": int(time.time()), "model": model}  # fmt: skip

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}  # fmt: skip

    def whole(self, text: str, reason: str | None, completion_tokens: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self.head, "choices": [choice], "usage": self.usage(completion_tokens)}

    def chunk(self, piece: str | None, reason: str | None = None, first: bool = False) -> str:
        """One server-sent event: a piece of text (None: none), or the end (``reason``)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            choice["delta"] = {**delta, "content": piece} if piece is not None else delta
        else:
            choice["text"] = piece or ""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self.head, "object": kind, "choices": [choice]})

    def usage_chunk(self, completion_tokens: int) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self.head, "object": kind, "choices": [],
                    "usage": self.usage(completion_tokens)})  # fmt: skip


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: a JSON object, or a plain word (``[DONE]``)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
