"""Trained subword tokenizers, BPE and WordPiece, through the Hugging Face ``tokenizers`` library.

The library is an optional extra (``pip install 'qkv[tokenizers]'``), imported only when one of
these classes is trained or loaded. Both classes speak the
:class:`~qkv.data.tokenizer_base.Tokenizer` protocol and register qkv's four special tokens
first, so ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>`` have ids 0, 1, 2, 3 as everywhere else.
``save`` writes the library's own ``tokenizer.json``, which any ``tokenizers`` user can read;
:func:`qkv.data.load_tokenizer` reads it back.

* :class:`BPETokenizer` is byte-level BPE (GPT-2 style): every byte is in the base alphabet,
  so encoding never needs UNK and decoding gives back the exact text.
* :class:`WordPieceTokenizer` is BERT-style: text is split on whitespace and punctuation,
  words into ``##``-continued pieces. Decoding joins words with single spaces, so it is lossy
  on whitespace; characters unseen in training make their word UNK.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from qkv.data.files import BadFileError, MissingFileError, reading
from qkv.data.tokenizer_base import (
    BOS_ID,
    EOS_ID,
    NUM_SPECIAL,
    PAD_ID,
    SPECIAL_TOKENS,
    SpecialIds,
    as_id_list,
    check_text,
    frame,
    json_path,
)

__all__ = ["BPETokenizer", "WordPieceTokenizer"]

TextsOrFiles = str | os.PathLike | Iterable[str | os.PathLike]


def import_tokenizers() -> Any:
    """The ``tokenizers`` library, or an ImportError that says how to install it."""
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError(
            "BPE and WordPiece tokenizers need the `tokenizers` library; "
            "install it with: pip install 'qkv[tokenizers]'"
        ) from err
    return tokenizers


def _texts(texts_or_files: TextsOrFiles) -> Iterator[str]:
    """Yield training texts: a ``str`` is text, a path (``os.PathLike``) is a file or folder."""
    from qkv.data.text import load_text

    items = [texts_or_files] if isinstance(texts_or_files, (str, os.PathLike)) else texts_or_files
    for item in items:
        if isinstance(item, str):
            yield item
        elif isinstance(item, os.PathLike):
            yield load_text(item)
        else:
            raise TypeError(
                f"texts_or_files must hold str texts or pathlib.Path files, "
                f"got {type(item).__name__}"
            )


class _LibraryTokenizer(SpecialIds):
    """Shared encode/decode/save/load over a ``tokenizers.Tokenizer`` (``backend``)."""

    model_type = ""  # the "model.type" of tokenizer.json this class reads

    def __init__(self, backend: Any):
        ids = [backend.token_to_id(t) for t in SPECIAL_TOKENS]
        if ids != list(range(NUM_SPECIAL)):
            raise ValueError(
                f"the tokenizer must give {list(SPECIAL_TOKENS)} the ids "
                f"{list(range(NUM_SPECIAL))}, got {ids}"
            )
        # Text that spells "<eos>" stays text: specials come only from add_bos/add_eos.
        backend.encode_special_tokens = True
        self.backend = backend

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by BOS and EOS."""
        ids = self.backend.encode(check_text(text), add_special_tokens=False).ids
        return frame(ids, add_bos, add_eos)

    def decode(self, ids: Sequence[int] | torch.Tensor, *, skip_special: bool = True) -> str:
        """Text of ``ids (T,)``; PAD/BOS/EOS dropped when ``skip_special``, UNK kept as ``<unk>``.

        Raises:
            ValueError: an id outside ``[0, vocab_size)`` (the library would skip it silently).
        """
        ids = as_id_list(ids, self.vocab_size)
        if skip_special:
            ids = [i for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)]
        return self.backend.decode(ids, skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the library's ``tokenizer.json`` to ``path`` (a file, or a folder); returns it."""
        out = json_path(path)
        self.backend.save(str(out))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike):
        """Read a ``tokenizer.json`` written by :meth:`save`.

        Raises:
            qkv.data.files.MissingFileError (a FileNotFoundError): nothing at ``path``.
            qkv.data.files.BadFileError (a ValueError): a file the library cannot parse, a
                different model type, or special tokens at other ids (naming the file).
            ImportError: the ``tokenizers`` library is not installed.
        """
        lib = import_tokenizers()
        file = json_path(path)
        if not file.is_file():
            raise MissingFileError(f"no tokenizer file at {file}", path=file)
        with reading(file, "a tokenizers library tokenizer.json", errors=(Exception,)):
            backend = lib.Tokenizer.from_file(str(file))
        found = type(backend.model).__name__
        if found != cls.model_type:
            raise BadFileError(f"{file} holds a {found} tokenizer, expected {cls.model_type}",
                               path=file)
        with reading(file, f"a qkv {cls.model_type} tokenizer"):
            return cls(backend)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class BPETokenizer(_LibraryTokenizer):
    """Byte-level BPE: lossless, never UNK. Build one with :meth:`train`."""

    model_type = "BPE"

    @classmethod
    def train(
        cls, texts_or_files: TextsOrFiles, vocab_size: int, *, min_frequency: int = 2
    ) -> BPETokenizer:
        """Learn merges from a corpus until the vocabulary has ``vocab_size`` entries.

        Args:
            texts_or_files: a ``str`` text, a ``pathlib.Path`` file or folder (read with
                :func:`qkv.data.load_text`), or an iterable of these. Plain strings are always
                text, never file names.
            vocab_size: target size, at least 260 (4 specials + 256 bytes); a small corpus may
                stop short of it.
            min_frequency: a pair must occur this often to be merged.

        Raises:
            ValueError: ``vocab_size < 260``.
            TypeError: an item that is neither str nor path.
            ImportError: the ``tokenizers`` library is not installed.
        """
        if not isinstance(vocab_size, int) or vocab_size < NUM_SPECIAL + 256:
            raise ValueError(
                f"vocab_size must be an int >= {NUM_SPECIAL + 256} (4 specials + 256 bytes) "
                f"for byte-level BPE, got {vocab_size!r}"
            )
        lib = import_tokenizers()
        backend = lib.Tokenizer(lib.models.BPE(unk_token=SPECIAL_TOKENS[3]))
        backend.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = lib.decoders.ByteLevel()
        trainer = lib.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),  # registered first: ids 0..3
            initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(_texts(texts_or_files), trainer=trainer)
        return cls(backend)


class WordPieceTokenizer(_LibraryTokenizer):
    """BERT-style WordPiece (``##`` continuation pieces). Build one with :meth:`train`."""

    model_type = "WordPiece"

    @classmethod
    def train(
        cls,
        texts_or_files: TextsOrFiles,
        vocab_size: int,
        *,
        min_frequency: int = 2,
        lowercase: bool = False,
    ) -> WordPieceTokenizer:
        """Learn a WordPiece vocabulary of ``vocab_size`` entries from a corpus.

        Args:
            texts_or_files: as for :meth:`BPETokenizer.train`.
            vocab_size: target size, at least 5.
            min_frequency: a piece must occur this often to be kept.
            lowercase: lower-case text before splitting (uncased BERT).

        Raises:
            ValueError: ``vocab_size < 5``.
            TypeError: an item that is neither str nor path.
            ImportError: the ``tokenizers`` library is not installed.
        """
        if not isinstance(vocab_size, int) or vocab_size <= NUM_SPECIAL:
            raise ValueError(f"vocab_size must be an int > {NUM_SPECIAL}, got {vocab_size!r}")
        lib = import_tokenizers()
        backend = lib.Tokenizer(lib.models.WordPiece(unk_token=SPECIAL_TOKENS[3]))
        if lowercase:
            backend.normalizer = lib.normalizers.Lowercase()
        backend.pre_tokenizer = lib.pre_tokenizers.BertPreTokenizer()
        backend.decoder = lib.decoders.WordPiece(prefix="##")
        trainer = lib.trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),  # registered first: ids 0..3
            show_progress=False,
        )
        backend.train_from_iterator(_texts(texts_or_files), trainer=trainer)
        return cls(backend)
