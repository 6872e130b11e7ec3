"""OpenAI's response objects for one request of ``qkv serve``: the whole answer
(``text_completion`` / ``chat.completion``, one entry of ``choices`` per choice), or its
server-sent events (``text_completion`` / ``chat.completion.chunk`` chunks, each about one
choice, ``data: {...}`` then ``data: [DONE]``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from qkv.generate.engine import TokenLogprob
from qkv.serve.logprobs import TokenBytes, chat_logprobs, completion_logprobs

__all__ = ["Reply", "sse"]


class Reply:
    """OpenAI's response objects for one request: whole, or as stream chunks.

    Args:
        chat: chat completions (else completions).
        model: the model's name in the API.
        prompt_tokens: the prompt's length, for ``usage``.
        token_bytes: each token's bytes, for ``logprobs`` (None: no log-probabilities asked).
    """

    def __init__(self, chat: bool, model: str, prompt_tokens: int,
                 token_bytes: TokenBytes | None = None) -> None:  # fmt: skip
        self.chat, self.prompt_tokens, self.token_bytes = chat, prompt_tokens, token_bytes
        kind = "chat.completion" if chat else "text_completion"
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": kind, "created": int(time.time()), "model": model}  # fmt: skip

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}  # fmt: skip

    def logprobs(self, entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        """The API's ``logprobs`` object for ``entries`` (None when none were asked for);
        ``offset``: completions' ``text_offset`` of the first entry."""
        if self.token_bytes is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_bytes)
        return completion_logprobs(entries, self.token_bytes, offset)

    def choice(self, index: int, text: str, reason: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """One entry of a whole answer's ``choices``."""
        out: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": logprobs}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        return out

    def whole(self, choices: list[dict[str, Any]], completion_tokens: int) -> dict[str, Any]:
        return {**self.head, "choices": choices, "usage": self.usage(completion_tokens)}

    def chunk(self, index: int, piece: str | None, reason: str | None = None,
              first: bool = False, logprobs: dict[str, Any] | None = None) -> str:  # fmt: skip
        """One server-sent event about choice ``index``: a piece of text (None: none), or
        its end (``reason``)."""
        choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": logprobs}
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
