"""Log-probabilities as OpenAI's API shows them: each token's text and raw bytes, its
log-probability, and the most probable alternatives at its step.

The engine reports ids (:class:`~qkv.generate.engine.TokenLogprob`); this module turns them
into the two shapes of the API:

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}``;
* completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}``.

A byte-level token can hold part of a character: its ``bytes`` are exact (the tokenizer's
byte alphabet undone), its ``token`` the bytes decoded with ``\\x..`` escapes for an incomplete
character, so the bytes of an answer's tokens join to its UTF-8 text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from qkv.generate.engine import TokenLogprob

__all__ = ["TokenBytes", "chat_logprobs", "completion_logprobs"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the ``bytes_to_unicode`` table of byte-level BPE),
    inverted: a printable stand-in character -> the byte it stands for."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
             *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    table, extra = {b: b for b in shown}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in table.items()}


class TokenBytes:
    """The raw bytes of one token id, memoised: byte-level BPE's alphabet undone,
    sentencepiece's ``<0x..>`` byte tokens and ``▁`` spaces read, special tokens empty (as
    the answer's text skips them), anything else the token's decoded text.

    Args:
        tokenizer: a :class:`~qkv.pretrained.tokenizer.PretrainedTokenizer` (or anything with
            ``decode(ids, skip_special_tokens=True)``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.memo = tokenizer, {}
        backend = getattr(tokenizer, "backend", None)
        self.backend = backend
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        self.byte_level = '"ByteLevel"' in json.dumps(decoder)
        self.alphabet = _byte_alphabet() if self.byte_level else {}

    def __call__(self, token: int) -> bytes:
        if token not in self.memo:
            self.memo[token] = self._read(token)
        return self.memo[token]

    def _read(self, token: int) -> bytes:
        decoded = self.tokenizer.decode([token], skip_special_tokens=True)
        piece = self.backend.id_to_token(token) if self.backend is not None else None
        if piece is None or (not decoded and piece):  # no vocabulary, or a special token
            return decoded.encode()
        if self.byte_level and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        if match := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode() if "\u2581" in piece else decoded.encode()

    def text(self, token: int) -> str:
        """The token's text (an incomplete character's bytes as ``\\x..`` escapes)."""
        return self(token).decode("utf-8", errors="backslashreplace")


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    """Chat's ``logprobs`` object for ``entries`` (one per token)."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        return {"token": token_bytes.text(token), "logprob": logprob,
                "bytes": list(token_bytes(token))}  # fmt: skip

    content = [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
               for e in entries]  # fmt: skip
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes,
                        offset: int = 0) -> dict[str, Any]:  # fmt: skip
    """Completions' ``logprobs`` object for ``entries``; ``text_offset`` counts characters
    from ``offset`` (where the first token's text starts in the answer)."""
    tokens, offsets, raw = [], [], b""
    for e in entries:
        offsets.append(offset + len(raw.decode("utf-8", errors="ignore")))
        raw += token_bytes(e.token)
        tokens.append(token_bytes.text(e.token))
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_bytes.text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}  # fmt: skip
