"""Where a command's texts come from: arguments, standard input (``-``) or a file (``--input``).

Every command that takes text (``qkv generate``, ``translate``, ``embed``, ``inspect``) and
``qkv transcribe`` (audio paths) reads its items through :func:`read_items`:

* the items given on the command line, as they are;
* ``-`` among them: standard input, one item per non-empty line (``per_line``), or the whole
  of it as one item (``qkv generate -p -``, ``qkv inspect MODEL -``: a multi-line prompt);
* ``--input FILE``: a UTF-8 file, one item per non-empty line (``-`` as the file: stdin),
  or, with ``whole_file`` (``qkv inspect``, which draws one text), the whole file as one item.

Errors name the option and the file, and say what was expected.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["read_items", "read_stdin"]


def read_stdin(*, per_line: bool, what: str) -> list[str]:
    """Standard input as items: non-empty lines, or one item (trailing newline removed).

    Raises:
        ValueError: standard input is a terminal (nothing piped) or holds no text.
    """
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError(f"{what} '-' reads standard input, but nothing is piped in (e.g. "
                         f"echo TEXT | qkv ... -)")  # fmt: skip
    text = sys.stdin.read()
    items = _lines(text) if per_line else ([text.rstrip("\n")] if text.strip() else [])
    if not items:
        raise ValueError(f"{what}: standard input holds no text")
    return items


def _lines(text: str) -> list[str]:
    return [line.rstrip("\r") for line in text.split("\n") if line.strip()]


def _read_file(path: Path, what: str, whole: bool = False) -> list[str]:
    layout = "the whole file as one" if whole else "one"
    each = "" if whole else " per line"
    if str(path) == "-":
        return read_stdin(per_line=not whole, what=what)
    if not path.is_file():
        raise ValueError(f"--input {path}: no such file (expected a UTF-8 text file, {layout} "
                         f"{what}{each})")  # fmt: skip
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--input {path}: not UTF-8 text (byte {err.start}); expected {layout} "
                         f"{what}{each}") from None  # fmt: skip
    items = ([text.rstrip("\n")] if text.strip() else []) if whole else _lines(text)
    if not items:
        raise ValueError(f"--input {path}: the file holds no {what} (no non-empty line)")
    return items


def read_items(given: Sequence[str] | None, input_file: Path | None, *, what: str,
               per_line: bool = True, given_as: str = "as an argument",
               whole_file: bool = False) -> list[str]:  # fmt: skip
    """The items of a command: ``given`` on the command line (``-`` reads stdin) and/or the
    lines of ``input_file``, in that order.

    Args:
        given: the items typed (None or empty: none).
        input_file: ``--input FILE`` or None.
        what: what an item is, for messages (``"prompt"``, ``"text"``, ``"audio file"``).
        per_line: ``-`` reads one item per line (True) or all of stdin as one item.
        given_as: how items are typed, for the message (``"--prompt TEXT"``).
        whole_file: ``input_file`` is one item (its whole text, trailing newlines removed),
            not one per line.

    Raises:
        ValueError: no item at all, ``-`` twice, an unreadable or empty file or stdin.
    """
    given = list(given or [])
    dashes = given.count("-") + (input_file is not None and str(input_file) == "-")
    if dashes > 1:
        raise ValueError(f"'-' (standard input) may be given once, got it {dashes} times")
    items: list[str] = []
    for item in given:
        if item == "-":
            items.extend(read_stdin(per_line=per_line, what=what))
        else:
            items.append(item)
    if input_file is not None:
        items.extend(_read_file(Path(input_file), what, whole=whole_file))
    if not items:
        each = "" if whole_file else " (one per line)"
        raise ValueError(f"give at least one {what}: {given_as} ('-' for standard input), "
                         f"or --input FILE{each}")  # fmt: skip
    return items
