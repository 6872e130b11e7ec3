"""Tokenizers: one small protocol, built-in character and byte tokenizers, and loading by file.

Every qkv tokenizer reserves the same four special ids, handled one way everywhere:

====  ==========  =========================================================================
 id    token       meaning
====  ==========  =========================================================================
 0     ``<pad>``   padding; :func:`qkv.masks.padding_from_ids` hides it
 1     ``<bos>``   begin of sequence (``encode(..., add_bos=True)``; decoder start token)
 2     ``<eos>``   end of sequence (``encode(..., add_eos=True)``)
 3     ``<unk>``   a piece of text the vocabulary cannot represent
====  ==========  =========================================================================

``decode(ids, skip_special=True)`` drops PAD, BOS and EOS; UNK always decodes to the text
``<unk>`` because it stands for real text that was there. Text that happens to contain
``"<eos>"`` encodes as ordinary characters, never as the special id.

Trained subword tokenizers (BPE, WordPiece) live in :mod:`qkv.data.subword`;
:func:`load_tokenizer` reads any of them back from the JSON file ``save`` wrote.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from qkv.data.files import BadFileError, read_json, reading
from qkv.data.subword import BPETokenizer, WordPieceTokenizer
from qkv.data.tokenizer_base import (
    BOS_ID,
    EOS_ID,
    FORMAT_KEY,
    NUM_SPECIAL,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    SpecialIds,
    Tokenizer,
    as_id_list,
    check_text,
    frame,
    json_path,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "ByteTokenizer",
    "CharTokenizer",
    "Tokenizer",
    "load_tokenizer",
]


class CharTokenizer(SpecialIds):
    """Character-level tokenizer: one id per character seen in a corpus.

    Ids 0-3 are the specials; characters follow in sorted order, so fitting the same corpus
    always gives the same ids. Characters not in the vocabulary encode to ``UNK_ID``.

    Args:
        chars: the vocabulary, distinct single characters (use :meth:`fit` to build one).

    Raises:
        ValueError: an entry that is not one character, or a repeated character.
    """

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"chars must be single characters, got {bad[:5]!r}")
        if len(set(chars)) != len(chars):
            dupes = sorted(c for c, n in Counter(chars).items() if n > 1)
            raise ValueError(f"chars must be distinct, got repeats {dupes[:5]!r}")
        self.chars = chars
        self._id = {c: i + NUM_SPECIAL for i, c in enumerate(chars)}

    @classmethod
    def fit(cls, texts: str | Iterable[str], *, min_count: int = 1) -> CharTokenizer:
        """Build the vocabulary from ``texts`` (one string or an iterable of strings).

        Args:
            texts: the corpus.
            min_count: characters seen fewer times than this are left out (they encode to UNK).

        Raises:
            TypeError: an element of ``texts`` that is not a str.
            ValueError: ``min_count < 1``.
        """
        if not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"min_count must be an int >= 1, got {min_count!r}")
        counts: Counter[str] = Counter()
        for text in [texts] if isinstance(texts, str) else texts:
            counts.update(check_text(text))
        return cls(sorted(c for c, n in counts.items() if n >= min_count))

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + len(self.chars)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of the characters of ``text`` (``UNK_ID`` for unseen ones), length ``len(text)``."""
        ids = [self._id.get(c, UNK_ID) for c in check_text(text)]
        return frame(ids, add_bos, add_eos)

    def decode(self, ids: Sequence[int] | torch.Tensor, *, skip_special: bool = True) -> str:
        """Text of ``ids (T,)``. Raises ValueError for an id outside the vocabulary."""
        pieces = []
        for i in as_id_list(ids, self.vocab_size):
            if i >= NUM_SPECIAL:
                pieces.append(self.chars[i - NUM_SPECIAL])
            elif i == UNK_ID or not skip_special:
                pieces.append(SPECIAL_TOKENS[i])
        return "".join(pieces)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``{"qkv_tokenizer": "char", "chars": [...]}`` as JSON; returns the file."""
        out = json_path(path)
        out.write_text(json.dumps({FORMAT_KEY: "char", "chars": self.chars}, ensure_ascii=False))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> CharTokenizer:
        """Read a tokenizer written by :meth:`save`."""
        data = _read_json(path)
        if data.get(FORMAT_KEY) != "char":
            raise BadFileError(f"{json_path(path)} is not a qkv char tokenizer file",
                               path=json_path(path))
        with reading(json_path(path), "a qkv char tokenizer"):
            return cls(data["chars"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class ByteTokenizer(SpecialIds):
    """Lossless UTF-8 byte tokenizer: byte ``b`` has id ``b + 4``; vocabulary 260.

    Any text round-trips exactly (emoji, CJK, control characters). Decoding a byte sequence
    that is not valid UTF-8 (for instance a sampled one) replaces the bad bytes with U+FFFD.
    """

    vocab_size = 256 + NUM_SPECIAL

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of the UTF-8 bytes of ``text``."""
        ids = [b + NUM_SPECIAL for b in check_text(text).encode("utf-8")]
        return frame(ids, add_bos, add_eos)

    def decode(self, ids: Sequence[int] | torch.Tensor, *, skip_special: bool = True) -> str:
        """Text of ``ids (T,)``. Raises ValueError for an id outside ``[0, 260)``."""
        pieces: list[str] = []
        run = bytearray()  # consecutive bytes decode together so multi-byte characters survive
        for i in as_id_list(ids, self.vocab_size):
            if i >= NUM_SPECIAL:
                run.append(i - NUM_SPECIAL)
                continue
            if i == UNK_ID or not skip_special:
                pieces.append(run.decode("utf-8", errors="replace") + SPECIAL_TOKENS[i])
                run.clear()
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``{"qkv_tokenizer": "byte"}`` as JSON; returns the file."""
        out = json_path(path)
        out.write_text(json.dumps({FORMAT_KEY: "byte"}))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> ByteTokenizer:
        """Read a tokenizer written by :meth:`save`."""
        if _read_json(path).get(FORMAT_KEY) != "byte":
            raise BadFileError(f"{json_path(path)} is not a qkv byte tokenizer file",
                               path=json_path(path))
        return cls()

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _read_json(path: str | os.PathLike) -> dict:
    return read_json(json_path(path), what="tokenizer file")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Read back any tokenizer written by ``save``: char, byte, BPE or WordPiece.

    Args:
        path: the JSON file, or a folder holding ``tokenizer.json``.

    Returns:
        a :class:`CharTokenizer`, :class:`ByteTokenizer`,
        :class:`~qkv.data.subword.BPETokenizer` or :class:`~qkv.data.subword.WordPieceTokenizer`.

    Raises:
        qkv.data.files.MissingFileError (a FileNotFoundError): nothing at ``path``.
        qkv.data.files.BadFileError (a ValueError): a file that is not one of these formats,
            or is one of them but malformed (the message names the file).
        ImportError: a BPE/WordPiece file without the ``tokenizers`` library installed.
    """
    file = json_path(path)
    data = _read_json(file)
    kind = data.get(FORMAT_KEY)
    if kind == "char":
        with reading(file, "a qkv char tokenizer"):
            return CharTokenizer(data["chars"])
    if kind == "byte":
        return ByteTokenizer()
    model = data.get("model")
    model_type = model.get("type") if isinstance(model, dict) else None
    if kind is None and model_type in ("BPE", "WordPiece"):
        cls = BPETokenizer if model_type == "BPE" else WordPieceTokenizer
        return cls.load(file)
    raise BadFileError(
        f"{json_path(path)} is not a qkv tokenizer: expected {FORMAT_KEY!r} 'char' or 'byte', "
        f"or a tokenizer.json with model type 'BPE' or 'WordPiece'; got {FORMAT_KEY}={kind!r}, "
        f"model type={model_type!r}",
        path=file,
    )
