"""What every qkv tokenizer shares: the four special ids, the protocol, and small helpers.

:mod:`qkv.data.tokenizers` (char, byte) and :mod:`qkv.data.subword` (BPE, WordPiece) both build
on this module and on nothing of each other's, so neither imports the other.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "FORMAT_KEY",
    "NUM_SPECIAL",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "SpecialIds",
    "Tokenizer",
    "as_id_list",
    "check_text",
    "frame",
    "json_path",
]

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # index = id
NUM_SPECIAL = len(SPECIAL_TOKENS)
FORMAT_KEY = "qkv_tokenizer"  # marks qkv's own JSON files (char, byte) apart from tokenizer.json


@runtime_checkable
class Tokenizer(Protocol):
    """What every qkv tokenizer offers: text <-> ids with the four shared special ids."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by BOS and EOS."""
        ...

    def decode(self, ids: Sequence[int] | torch.Tensor, *, skip_special: bool = True) -> str:
        """Text of ``ids (T,)``; PAD/BOS/EOS dropped when ``skip_special``."""
        ...

    def save(self, path: str | os.PathLike) -> Path:
        """Write the tokenizer as JSON to ``path`` (a file, or a folder for ``tokenizer.json``)."""
        ...

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Read a tokenizer of this class back from what :meth:`save` wrote."""
        ...


def as_id_list(ids: Sequence[int] | torch.Tensor, vocab_size: int) -> list[int]:
    """Validate ``ids`` (a sequence of ints or a 1-D integer tensor) against ``vocab_size``.

    Raises:
        TypeError: a tensor that is not integer, or elements that are not ints.
        ValueError: a tensor that is not 1-D, or an id outside ``[0, vocab_size)``.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"ids must be a 1-D tensor (T,), got shape {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        ids = ids.tolist()
    out = list(ids)
    for i in out:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"ids must be ints, got {type(i).__name__} {i!r}")
        if not 0 <= i < vocab_size:
            raise ValueError(f"ids must lie in [0, vocab_size={vocab_size}), got {i}")
    return out


def frame(ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
    """``ids`` with BOS prepended and/or EOS appended."""
    return [BOS_ID] * add_bos + ids + [EOS_ID] * add_eos


def json_path(path: str | os.PathLike) -> Path:
    """The file to write: ``path`` itself, or ``path/tokenizer.json`` for a folder."""
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def check_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


class SpecialIds:
    """The four shared special ids as attributes (mixed into every tokenizer)."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    unk_id = UNK_ID
