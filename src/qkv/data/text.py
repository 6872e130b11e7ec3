"""Language-model text: any user file or folder, or the running Python's own standard library.

Corpora are read at run time from where they already are; qkv never copies one into the repo.

* :func:`load_text` reads a file, or every text file under a folder (recursively).
* :func:`stdlib_corpus` reads the source (or only the docstrings) of the standard library of
  the interpreter running qkv: found through ``sysconfig``, read in sorted path order, so the
  same Python gives the same text every time.
* :func:`train_valid_split` holds out a seeded random set of contiguous chunks for validation.
"""

from __future__ import annotations

import ast
import itertools
import os
import random
import sysconfig
from pathlib import Path

__all__ = [
    "TEXT_SUFFIXES",
    "MissingData",
    "load_text",
    "stdlib_corpus",
    "train_valid_split",
]

TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".py", ".json", ".toml", ".cfg", ".ini", ".csv", ".tsv", ".html",
    ".xml", ".yaml", ".yml", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java", ".sh", ".tex",
})  # fmt: skip
# Folders skipped while walking: version control, caches, environments, stdlib test suites.
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})
_STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SEPARATOR = "\n\n"  # between files, so one file's end does not run into the next's start


class MissingData(LookupError):  # noqa: N818 (the name the issue and callers use)
    """A corpus qkv reads from the machine (stdlib, gettext catalogues) is not there."""


def _walk(root: Path, suffixes: frozenset[str], skip: frozenset[str]) -> list[Path]:
    """Files under ``root`` with a suffix in ``suffixes``, sorted by relative path."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk descending; hidden folders (.git, .venv) are skipped.
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        files += [Path(dirpath, f) for f in filenames if Path(f).suffix.lower() in suffixes]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_text(
    path: str | os.PathLike, *, suffixes: frozenset[str] | set[str] = TEXT_SUFFIXES
) -> str:
    """Read a text file, or every text file under a folder, as one string.

    Files are decoded as UTF-8 with ``errors="replace"`` (a stray byte becomes U+FFFD instead
    of failing). A folder is walked recursively in sorted path order, skipping hidden folders,
    ``__pycache__``, ``site-packages`` and ``node_modules``; files are joined by a blank line.

    Args:
        path: a file (read whatever its suffix) or a folder.
        suffixes: lower-case suffixes of the files to read from a folder.

    Returns:
        the text.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: a folder with no file of the given suffixes.
    """
    root = Path(path)
    if root.is_file():
        return root.read_text(encoding="utf-8", errors="replace")
    if not root.is_dir():
        raise FileNotFoundError(f"no file or folder at {root}")
    files = _walk(root, frozenset(suffixes), _SKIP_DIRS)
    if not files:
        raise ValueError(f"folder {root} holds no file with a suffix in {sorted(suffixes)}")
    return _SEPARATOR.join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def _docstrings(source: str) -> list[str]:
    """Module, class and function docstrings of ``source``, in order of appearance."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a few files are deliberately not valid Python
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, kinds) and (doc := ast.get_docstring(node)):
            found.append((getattr(node, "lineno", 0), doc))
    return [doc for _, doc in sorted(found, key=lambda pair: pair[0])]


def stdlib_corpus(max_chars: int | None = 2_000_000, *, kind: str = "source") -> str:
    """Text from the standard library of the running interpreter, read at run time.

    The ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` are read in sorted path order
    (test suites and ``site-packages`` left out) until ``max_chars`` characters are
    gathered. The text depends on the Python version, never on the run.

    Args:
        max_chars: stop after this many characters (the last file is cut); ``None`` reads all.
        kind: ``"source"`` for whole files (code, comments and docstrings), ``"docstrings"`` for
            module, class and function docstrings only (English prose).

    Returns:
        the text, at most ``max_chars`` characters.

    Raises:
        ValueError: ``max_chars < 1`` or an unknown ``kind``.
        MissingData: the interpreter has no readable standard library source.
    """
    if max_chars is not None and (not isinstance(max_chars, int) or max_chars < 1):
        raise ValueError(f"max_chars must be a positive int or None, got {max_chars!r}")
    if kind not in ("source", "docstrings"):
        raise ValueError(f"kind must be 'source' or 'docstrings', got {kind!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk(root, frozenset({".py"}), _SKIP_DIRS | _STDLIB_TEST_DIRS) if root.is_dir() else []
    if not files:
        raise MissingData(f"no standard library source (*.py) found under {root}")
    pieces: list[str] = []
    total = 0
    for file in files:
        source = file.read_text(encoding="utf-8", errors="replace")
        texts = [source] if kind == "source" else _docstrings(source)
        for text in texts:
            pieces.append(text)
            total += len(text) + len(_SEPARATOR)
        if max_chars is not None and total >= max_chars:
            break
    text = _SEPARATOR.join(pieces)
    return text if max_chars is None else text[:max_chars]


def train_valid_split(
    text: str, valid_fraction: float = 0.1, seed: int = 0, *, chunk_chars: int = 4096
) -> tuple[str, str]:
    """Split ``text`` into training and validation text by seeded random chunks.

    The text is cut into ``ceil(len / chunk_chars)`` contiguous chunks (at least 2); a seeded
    random ``valid_fraction`` of them (at least one, never all) goes to validation. Each side
    keeps its chunks in their original order, so both read like the source, and every
    character lands on exactly one side.

    Args:
        text: the corpus, at least 2 characters.
        valid_fraction: share of chunks held out, in ``(0, 1)``.
        seed: chooses the chunks; the same seed gives the same split.
        chunk_chars: chunk length in characters.

    Returns:
        ``(train, valid)`` strings.

    Raises:
        TypeError: ``text`` not a str.
        ValueError: ``valid_fraction`` outside ``(0, 1)``, ``chunk_chars < 1``, or a text
            shorter than 2 characters.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must lie in (0, 1), got {valid_fraction!r}")
    if not isinstance(chunk_chars, int) or chunk_chars < 1:
        raise ValueError(f"chunk_chars must be a positive int, got {chunk_chars!r}")
    if len(text) < 2:
        raise ValueError(f"text must have at least 2 characters to split, got {len(text)}")
    n_chunks = max(2, -(-len(text) // chunk_chars))
    bounds = [len(text) * i // n_chunks for i in range(n_chunks + 1)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    n_valid = min(n_chunks - 1, max(1, round(valid_fraction * n_chunks)))
    held_out = set(random.Random(seed).sample(range(n_chunks), n_valid))
    train = "".join(c for i, c in enumerate(chunks) if i not in held_out)
    valid = "".join(c for i, c in enumerate(chunks) if i in held_out)
    return train, valid
