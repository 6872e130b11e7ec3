"""Reading small JSON and TOML files with errors that name the file: one reader of each.

Tokenizer files, checkpoint configs, Hugging Face ``config.json`` and run-spec TOML files all go
through these, so a missing file is a :class:`FileNotFoundError` and a malformed one a
:class:`ValueError`, each one line naming the file. Callers that have their own error type
(:class:`qkv.checkpoint.CheckpointError`) wrap these two.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["read_json", "read_toml", "toml_module"]


def read_json(path: str | os.PathLike, *, what: str = "file") -> dict[str, Any]:
    """The JSON object in ``path``.

    Args:
        path: the file.
        what: how the missing-file message names it (``"no <what> at <path>"``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not UTF-8, not valid JSON, or not a JSON object.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no {what} at {file}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def read_toml(path: str | os.PathLike, *, what: str = "file") -> dict[str, Any]:
    """The TOML document in ``path`` as a dict.

    Raises:
        FileNotFoundError: no such file (``"no <what> at <path>"``).
        ValueError: not UTF-8 or not valid TOML.
        ImportError: Python 3.10 without the ``tomli`` package.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no {what} at {file}")
    toml = toml_module()
    try:
        return toml.loads(file.read_text(encoding="utf-8"))
    except toml.TOMLDecodeError as err:
        raise ValueError(f"{file} is not valid TOML: {err}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not a UTF-8 text file") from None


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
