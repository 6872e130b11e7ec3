"""Training data from TSV, CSV and JSONL files, the format chosen by the file's extension.

* :func:`load_pairs`: ``(source, target)`` string pairs for an encoder-decoder.

  - ``.tsv``: without column names, one ``source<TAB>target`` line per pair
    (:func:`~qkv.data.parallel.load_pairs_tsv`); with ``source=``/``target=`` names, the
    first line is a header and the pairs are those columns.
  - ``.csv``: a header row, then rows (quoting as Python's :mod:`csv` reads it); the columns
    ``source`` and ``target`` unless named.
  - ``.jsonl``: one JSON object per line; the keys ``source`` and ``target`` unless named.

* :func:`load_chats`: conversations of a ``.jsonl`` file, one ``{"messages": [{"role": ...,
  "content": ...}, ...]}`` per line (the chat format of transformers' and TRL's datasets),
  each with at least one assistant turn (what fine-tuning learns).

* :func:`load_records_text`: the text of one column (``.csv``, ``.tsv``) or key (``.jsonl``)
  of every record, records joined by a blank line (so ``qkv train --pack`` sees each record
  as its own document).

Empty lines are skipped. A malformed row raises :class:`~qkv.data.files.BadFileError` (a
ValueError) whose message starts ``<file>:<line>:`` and says what was expected and found.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qkv.data.files import BadFileError, MissingFileError
from qkv.data.parallel import load_pairs_tsv

__all__ = ["PAIR_SUFFIXES", "RECORD_SUFFIXES", "load_chats", "load_pairs", "load_records_text"]

PAIR_SUFFIXES = (".tsv", ".csv", ".jsonl")
RECORD_SUFFIXES = (".csv", ".tsv", ".jsonl")
_SHOWN = 120  # characters of a bad line shown in an error


def _file(path: str | os.PathLike, suffixes: tuple[str, ...], what: str) -> Path:
    file = Path(path)
    if file.suffix.lower() not in suffixes:
        raise BadFileError(
            f"{file}: unknown {what} format {file.suffix or '(no extension)'!r}; expected a "
            f"file ending in {', '.join(suffixes)}",
            path=file,
        )
    if not file.is_file():
        raise MissingFileError(f"no {file.suffix[1:].upper()} file at {file}", path=file)
    return file


def _bad(file: Path, line: int, message: str) -> BadFileError:
    return BadFileError(f"{file}:{line}: {message}", path=file)


def _rows(file: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of a CSV/TSV file with a header, or a JSONL file."""
    # utf-8-sig: a byte-order mark (spreadsheet exports) is not part of the first column name
    with file.open(encoding="utf-8-sig", errors="replace", newline="") as f:
        if file.suffix.lower() == ".jsonl":
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise _bad(file, number, f"expected one JSON object per line, got invalid "
                               f"JSON ({err}) in {line.strip()[:_SHOWN]!r}") from None  # fmt: skip
                if not isinstance(record, dict):
                    raise _bad(file, number, f"expected a JSON object ({{...}}), got "
                               f"{type(record).__name__} {line.strip()[:_SHOWN]!r}")  # fmt: skip
                yield number, record
            return
        delimiter = "\t" if file.suffix.lower() == ".tsv" else ","
        reader = csv.reader(f, delimiter=delimiter)
        header: list[str] | None = None
        try:
            for row in reader:
                number = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if header is None:
                    header = row
                    continue
                if len(row) != len(header):
                    raise _bad(file, number, f"expected {len(header)} fields (the header's "
                               f"{header}), got {len(row)}: {row}"[: 2 * _SHOWN])  # fmt: skip
                yield number, dict(zip(header, row, strict=True))
        except csv.Error as err:
            raise _bad(file, reader.line_num, f"malformed CSV ({err})") from None
        if header is None:
            raise BadFileError(f"{file}: empty; expected a header row and rows", path=file)


def _field(file: Path, number: int, record: dict[str, Any], key: str, option: str) -> str:
    if key not in record:
        raise _bad(file, number, f"no {key!r} field (set it with {option}); the record has "
                   f"{sorted(record)}")  # fmt: skip
    value = record[key]
    if not isinstance(value, str) or not value:
        raise _bad(file, number, f"expected {key!r} to be a non-empty string, got {value!r}"
                   [: 2 * _SHOWN])  # fmt: skip
    return value


def load_pairs(
    path: str | os.PathLike, *, source: str | None = None, target: str | None = None
) -> list[tuple[str, str]]:
    """``(source, target)`` pairs of a ``.tsv``, ``.csv`` or ``.jsonl`` file, in file order.

    Args:
        path: the file; its extension picks the format (see the module docstring).
        source, target: the column (CSV, TSV with a header) or key (JSONL) names; None =
            ``"source"`` and ``"target"`` (a TSV without names has no header: two fields a
            line).

    Raises:
        qkv.data.files.MissingFileError (a FileNotFoundError): no file.
        qkv.data.files.BadFileError (a ValueError): an unknown extension, or a malformed row:
            ``<file>:<line>: expected ..., got ...``.
    """
    file = _file(path, PAIR_SUFFIXES, "pairs")
    if file.suffix.lower() == ".tsv" and source is None and target is None:
        return load_pairs_tsv(file)
    src, tgt = source or "source", target or "target"
    pairs = [
        (_field(file, n, r, src, "--source-column"), _field(file, n, r, tgt, "--target-column"))
        for n, r in _rows(file)
    ]
    if not pairs:
        raise BadFileError(f"{file}: no records; expected {src!r}/{tgt!r} pairs", path=file)
    return pairs


def load_records_text(path: str | os.PathLike, *, key: str = "text") -> str:
    """The ``key`` column (CSV, TSV with a header) or key (JSONL) of every record, joined by a
    blank line.

    Raises:
        qkv.data.files.MissingFileError (a FileNotFoundError): no file.
        qkv.data.files.BadFileError (a ValueError): an unknown extension, or a malformed row:
            ``<file>:<line>: expected ..., got ...``.
    """
    file = _file(path, RECORD_SUFFIXES, "text records")
    texts = [_field(file, n, r, key, "--text-column") for n, r in _rows(file)]
    if not texts:
        raise BadFileError(f"{file}: no records; expected records with a {key!r} field",
                           path=file)  # fmt: skip
    return "\n\n".join(texts)


def load_chats(path: str | os.PathLike) -> list[tuple[int, list[dict[str, str]]]]:
    """``(line number, messages)`` of every conversation of a ``.jsonl`` chat file.

    Each line is ``{"messages": [{"role": "system" | "user" | "assistant", "content": str},
    ...]}`` with at least one ``"assistant"`` message (other keys are ignored).

    Raises:
        qkv.data.files.MissingFileError (a FileNotFoundError): no file.
        qkv.data.files.BadFileError (a ValueError): not ``.jsonl``, no conversation, or a
            malformed line: ``<file>:<line>: expected ..., got ...``.
    """
    file = _file(path, (".jsonl",), "chat")
    chats = [(n, _messages(file, n, r)) for n, r in _rows(file)]
    if not chats:
        raise BadFileError(f"{file}: no conversations; expected one {{\"messages\": [...]}} "
                           "per line", path=file)  # fmt: skip
    return chats


def _messages(file: Path, number: int, record: dict[str, Any]) -> list[dict[str, str]]:
    """The checked ``messages`` of one chat record."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad(file, number, f"expected a non-empty 'messages' list, got "
                   f"{messages!r}"[: 2 * _SHOWN])  # fmt: skip
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):  # fmt: skip
            raise _bad(file, number, f"expected messages[{i}] to be {{'role': str, 'content': "
                       f"str}}, got {m!r}"[: 2 * _SHOWN])  # fmt: skip
    if not any(m["role"] == "assistant" for m in messages):
        roles = [m["role"] for m in messages]
        raise _bad(file, number, f"no assistant turn to learn (roles {roles}); every "
                   "conversation needs at least one {'role': 'assistant', ...} message")
    return [{"role": m["role"], "content": m["content"]} for m in messages]
