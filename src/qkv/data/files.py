"""Reading files qkv did not write itself: the one error type, one JSON and one TOML reader.

Every loader (tokenizer files, checkpoint folders, Hugging Face folders, GGUF files, run-spec
TOML files) reports a file it cannot use with :class:`BadFileError`, a ``ValueError`` whose
message starts with the file's path and says what was expected and what was found, and whose
``path`` attribute holds the file. A missing file is :class:`MissingFileError`, which is both a
``BadFileError`` and a ``FileNotFoundError``, so callers that catch either keep working.

:func:`reading` turns the errors Python raises while a loader interprets a file's contents (a
``KeyError`` for a missing key, a ``TypeError`` for a list where a number belongs, a library's
own parse error) into one ``BadFileError`` naming the file.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "BadFileError",
    "MissingFileError",
    "library_error",
    "read_json",
    "read_toml",
    "reading",
    "toml_module",
]


class BadFileError(ValueError):
    """A file qkv cannot use: missing, truncated, corrupt, inconsistent or refused.

    Args:
        message: one line saying what was expected and what was found; it should name the
            file (when it does not, ``"<path>: "`` is put in front).
        path: the file (or folder) at fault; kept as the ``path`` attribute.
    """

    def __init__(self, message: str, *, path: str | os.PathLike | None = None) -> None:
        # path is None only when an error is rebuilt from its pickle (see __reduce__)
        self.path = Path(path) if path is not None and str(path) else path
        text = str(message)
        if path is not None and str(path) not in text:
            text = f"{path}: {text}"
        super().__init__(text)

    def __reduce__(self) -> tuple:
        # Errors cross process boundaries (DataLoader workers, torchrun): keep the path.
        return type(self), (str(self),), {"path": self.path}


class MissingFileError(BadFileError, FileNotFoundError):
    """A file a loader needs is not there (also a ``FileNotFoundError``)."""


# What Python raises while code interprets decoded data of the wrong shape: a key that is not
# there, a value of another type, a bad number, an empty list, a division by a zero size.
CONTENT_ERRORS = (
    KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError,
    OverflowError, RecursionError, UnicodeError,
)


@contextmanager
def reading(path: str | os.PathLike, what: str, *, errors: tuple = CONTENT_ERRORS
            ) -> Iterator[None]:  # fmt: skip
    """Run a block that interprets ``path``'s contents; its errors become one BadFileError.

    Args:
        path: the file being interpreted.
        what: what the block makes of it, for the message (``"a BPE tokenizer"``).
        errors: the exception types to convert (default: :data:`CONTENT_ERRORS`; pass
            ``(Exception,)`` around a third-party parser whose error type is undocumented;
            a Rust library's panic is converted too).

    Raises:
        BadFileError: ``"<path>: <the error> (expected <what>)"``; a BadFileError raised
            inside passes through unchanged.
    """
    try:
        yield
    except BadFileError:
        raise
    except BaseException as err:
        if isinstance(err, MemoryError) or not (isinstance(err, errors) or is_panic(err)):
            raise
        detail = str(err) if type(err) is ValueError else f"{type(err).__name__}: {err}"
        text = detail if str(path) in detail else f"{path}: {detail}"
        raise BadFileError(f"{text} (expected {what})", path=path) from None


def is_panic(err: BaseException) -> bool:
    """A Rust library (safetensors, tokenizers) that panics on a file raises pyo3's
    ``PanicException``, a ``BaseException``: it is the library refusing the file too."""
    return type(err).__name__ == "PanicException"


def library_error(err: BaseException) -> bool:
    """Whether a third-party reader's exception means "this file is bad": any ``Exception``
    or a Rust panic, but not ``KeyboardInterrupt``, ``SystemExit`` or another
    ``BaseException`` (a caller's own timeout), and not ``MemoryError``."""
    return (isinstance(err, Exception) and not isinstance(err, MemoryError)) or is_panic(err)


def _text(file: Path, what: str) -> str:
    if not file.is_file():
        raise MissingFileError(f"no {what} at {file}", path=file)
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise BadFileError(f"{file} is not a UTF-8 text file ({err})", path=file) from None


def read_json(path: str | os.PathLike, *, what: str = "file", kind: type = dict) -> Any:
    """The JSON value in ``path``: an object by default.

    Args:
        path: the file.
        what: how the missing-file message names it (``"no <what> at <path>"``).
        kind: the JSON type expected at the top (``dict`` for an object, ``list``).

    Raises:
        MissingFileError (a FileNotFoundError): no such file.
        BadFileError (a ValueError): not UTF-8, not valid JSON, or not of type ``kind``.
    """
    file = Path(path)
    text = _text(file, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadFileError(f"{file} is not valid JSON: {err}", path=file) from None
    except (ValueError, RecursionError) as err:  # digits past Python's limit, deep nesting
        raise BadFileError(f"{file} is not valid JSON: {type(err).__name__}", path=file) from None
    if not isinstance(data, kind):
        expected = "a JSON object" if kind is dict else f"a JSON {kind.__name__}"
        raise BadFileError(f"{file} must hold {expected}, got {type(data).__name__}", path=file)
    return data


def read_toml(path: str | os.PathLike, *, what: str = "file") -> dict[str, Any]:
    """The TOML document in ``path`` as a dict.

    Raises:
        MissingFileError (a FileNotFoundError): no such file (``"no <what> at <path>"``).
        BadFileError (a ValueError): not UTF-8 or not valid TOML.
        ImportError: Python 3.10 without the ``tomli`` package.
    """
    file = Path(path)
    text = _text(file, what)
    toml = toml_module()
    try:
        return toml.loads(text)
    except toml.TOMLDecodeError as err:
        raise BadFileError(f"{file} is not valid TOML: {err}", path=file) from None
    except (ValueError, RecursionError) as err:  # nesting deeper than the parser's stack
        raise BadFileError(f"{file} is not valid TOML: {type(err).__name__}", path=file) from None


def toml_module() -> Any:
    """``tomllib`` (Python >= 3.11) or ``tomli``.

    Raises:
        ImportError: Python 3.10 without ``tomli`` (the message is the install command).
    """
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:  # pragma: no cover - Python 3.10 only
        import tomli
    except ImportError:  # pragma: no cover
        raise ImportError("reading TOML on Python 3.10 needs tomli: pip install tomli") from None
    return tomli  # pragma: no cover
