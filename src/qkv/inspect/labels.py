"""Token labels a person can read: tokenizer pieces decoded, one marker for each kind of space.

Tokenizers name their pieces in their own codes: GPT-2's byte-level BPE writes a leading
space as ``Ġ`` and a newline as ``Ċ`` (every byte mapped to a printable character),
SentencePiece writes a space as ``▁``, WordPiece marks a word's continuation with ``##``. A
viewer or a plot showing those codes shows ``Ġprinting`` where the text says `` printing``.
:func:`readable_tokens` decodes each piece to its text and draws the characters one cannot
see with one marker each, the same in every view and plot:

* a space as ``·`` (a middle dot: ``·printing``), a newline as ``↵``, a tab as ``→``;
* special tokens (``<s>``, ``</s>``, ``<|endoftext|>``, ``[CLS]``, ``<|im_start|>``, ...) as
  ``⟨name⟩`` (``⟨s⟩``, ``⟨/s⟩``, ``⟨endoftext⟩``, ``⟨CLS⟩``);
* a WordPiece continuation without its ``##`` (it joins the previous piece: ``play`` ``ing``);
* bytes that are only part of a character (half of an emoji) as ``‹e2 9c›``; SentencePiece's
  byte pieces (``<0x0A>``) as the character.

Labels without tokenizer codes or spaces (words, numbers) come back unchanged, and applying it
twice is the same as once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

__all__ = ["SPACE", "readable_token", "readable_tokens"]

SPACE, NEWLINE, TAB = "·", "↵", "→"
_SPECIAL = re.compile(r"^(?:<\|([^|<>]{1,40})\|>|<(/?[A-Za-z_][\w/]{0,20})>|\[([A-Z]{2,10})\])$")
_SP_SPACE = "▁"  # SentencePiece's word boundary (U+2581)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes-to-unicode table, reversed: the printable stand-in -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))  # fmt: skip
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def _looks_byte_level(piece: str) -> bool:
    """A GPT-2 byte-level piece: every character is in the stand-in table and at least one is
    a stand-in for a space, newline or another control byte (``Ġ``, ``Ċ``, ``ĉ``, ...)."""
    table = _byte_decoder()
    return all(ch in table for ch in piece) and any(256 <= ord(ch) < 324 for ch in piece)


def _show(text: str) -> str:
    return text.replace(" ", SPACE).replace("\n", NEWLINE).replace("\r", "").replace("\t", TAB)


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte pieces


def readable_token(piece: str, byte_level: bool | None = None) -> str:
    """One piece as readable text (see the module docstring).

    ``byte_level``: the piece comes from a GPT-2 byte-level tokenizer (None: guess from the
    piece, by its stand-ins for spaces and control bytes)."""
    if not piece:
        return piece
    special = _SPECIAL.match(piece)
    if special:
        return f"⟨{next(g for g in special.groups() if g)}⟩"
    fallback = _BYTE_FALLBACK.match(piece)
    if fallback:
        byte = int(fallback.group(1), 16)
        return _show(chr(byte)) if byte < 0x80 else f"‹{byte:02x}›"
    if byte_level is None:
        byte_level = _looks_byte_level(piece)
    if byte_level and all(ch in _byte_decoder() for ch in piece):
        raw = bytes(_byte_decoder()[ch] for ch in piece)
        try:
            return _show(raw.decode("utf-8"))
        except UnicodeDecodeError as err:  # part of a multi-byte character: its bytes
            head = _show(raw[: err.start].decode("utf-8"))
            return head + "‹" + " ".join(f"{b:02x}" for b in raw[err.start :]) + "›"
    if piece.startswith("##") and len(piece) > 2:
        return piece[2:]
    return _show(piece.replace(_SP_SPACE, " "))


def readable_tokens(pieces: Sequence[str]) -> list[str]:
    """Each piece as readable text, one marker per kind of space (see the module docstring).

    Args:
        pieces: token strings as a tokenizer names them (``Ġprinting``, ``▁the``, ``##ing``,
            ``<s>``), or already readable labels.

    Returns:
        the labels, as many as ``pieces``.

    Raises:
        TypeError: ``pieces`` is a string or holds a non-string.
    """
    if isinstance(pieces, str):
        raise TypeError("pieces must be a sequence of token strings, not one string")
    for i, p in enumerate(pieces):
        if not isinstance(p, str):
            raise TypeError(f"pieces[{i}] must be a str, got {type(p).__name__}")
    # One byte-level piece (a stand-in for a space or a control byte) marks the whole
    # sequence as byte-level, so pieces like "Ã©" (é) decode too.
    byte_level = any(_looks_byte_level(p) for p in pieces)
    return [readable_token(p, byte_level) for p in pieces]
