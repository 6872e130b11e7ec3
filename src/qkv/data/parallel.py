"""Parallel text for translation: a user's TSV file, or the machine's own gettext catalogues.

Linux systems ship compiled translations of their programs' interface strings
(``/usr/share/locale/<lang>/LC_MESSAGES/*.mo``): thousands of English -> German or French
pairs such as ``"File not found"`` -> ``"Datei nicht gefunden"``. :func:`gettext_pairs` reads
them at run time; nothing is copied into the repo, and a machine without them gives ``[]``.
"""

from __future__ import annotations

import gettext
import os
import re
import struct
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from qkv.data.text import MissingData

__all__ = ["gettext_catalogues", "gettext_pairs", "load_pairs_tsv", "locale_dirs"]

_LANG = re.compile(r"[a-z]{2,3}(_[A-Z]{2})?(@[a-z]+)?")
_CONTEXT_SEPARATOR = "\x04"  # msgctxt and msgid are joined by EOT in a .mo key


def load_pairs_tsv(path: str | os.PathLike) -> list[tuple[str, str]]:
    """Read ``source<TAB>target`` pairs, one per line, from a UTF-8 file.

    Empty lines are skipped; a trailing ``\\r`` (Windows line ends) is removed.

    Args:
        path: the file.

    Returns:
        the ``(source, target)`` pairs in file order.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a line without exactly one tab or with an empty side; the message names
            the file and the 1-based line number, and shows the line.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no TSV file at {file}")
    pairs = []
    with file.open(encoding="utf-8", errors="replace", newline="") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip("\n").rstrip("\r")
            if not line:
                continue
            fields = line.split("\t")
            if len(fields) != 2 or not fields[0] or not fields[1]:
                raise ValueError(
                    f"{file}:{number}: expected 'source<TAB>target' (one tab, both sides "
                    f"non-empty), got {len(fields) - 1} tab(s) in {line[:200]!r}"
                )
            pairs.append((fields[0], fields[1]))
    return pairs


def locale_dirs() -> list[Path]:
    """The folders searched for catalogues, in order, that exist on this machine.

    ``/usr/share/locale``, ``/usr/share/locale-langpack`` (Ubuntu language packs),
    ``/usr/local/share/locale`` and the running Python's ``<prefix>/share/locale`` (where
    :mod:`gettext` looks by default).
    """
    candidates = [
        Path("/usr/share/locale"),
        Path("/usr/share/locale-langpack"),
        Path("/usr/local/share/locale"),
        Path(sys.base_prefix, "share", "locale"),
    ]
    unique = dict.fromkeys(p for p in candidates if p.is_dir())
    return list(unique)


def _check_lang(lang: str) -> None:
    if not isinstance(lang, str) or not _LANG.fullmatch(lang):
        raise ValueError(f"lang must be a locale code such as 'de', 'fr' or 'pt_BR', got {lang!r}")


def gettext_catalogues(
    lang: str = "de",
    domains: Iterable[str] | None = None,
    *,
    search: Sequence[str | os.PathLike] | None = None,
) -> list[Path]:
    """The compiled catalogues ``<dir>/<lang>/LC_MESSAGES/<domain>.mo`` found, sorted by path.

    Args:
        lang: the locale code (exact match: ``"de"`` does not include ``"de_AT"``).
        domains: catalogue names to keep (e.g. ``["coreutils", "tar"]``); ``None`` keeps all.
        search: folders to search instead of :func:`locale_dirs`.

    Raises:
        ValueError: a malformed ``lang``.
    """
    _check_lang(lang)
    keep = None if domains is None else {domains} if isinstance(domains, str) else set(domains)
    roots = locale_dirs() if search is None else [Path(p) for p in search]
    found = []
    for root in roots:
        folder = root / lang / "LC_MESSAGES"
        if folder.is_dir():
            found += [f for f in folder.glob("*.mo") if keep is None or f.stem in keep]
    return sorted(found)


def _catalogue_pairs(file: Path) -> list[tuple[str, str]]:
    """Singular, non-empty, non-metadata entries of one ``.mo`` file, sorted by msgid."""
    with file.open("rb") as f:
        translations = gettext.GNUTranslations(f)
    # GNUTranslations offers no public way to list its entries; ``_catalog`` has been its
    # msgid -> msgstr dict since Python 2. Plural forms are keyed by (msgid, n) tuples.
    pairs = []
    for key, target in translations._catalog.items():
        if not isinstance(key, str) or not key or not target:
            continue  # plural forms, the metadata header (msgid ""), untranslated entries
        source = key.rpartition(_CONTEXT_SEPARATOR)[2]  # drop a "context\x04" prefix
        if source:
            pairs.append((source, target))
    return sorted(pairs)


def gettext_pairs(
    lang: str = "de",
    domains: Iterable[str] | None = None,
    *,
    single_line: bool = True,
    search: Sequence[str | os.PathLike] | None = None,
    required: bool = False,
) -> list[tuple[str, str]]:
    """English -> ``lang`` interface-string pairs from the machine's gettext catalogues.

    Catalogues are read with :class:`gettext.GNUTranslations` in sorted path order; inside a
    catalogue, entries are sorted by msgid. Plural entries, the metadata header, empty
    translations and message contexts are dropped; an exact pair seen twice is kept once.

    Args:
        lang: the target language's locale code, e.g. ``"de"`` or ``"fr"``.
        domains: catalogue names to read (e.g. ``["coreutils"]``); ``None`` reads all.
        single_line: drop pairs whose source or target holds a newline or a tab (they would
            not fit a one-line TSV).
        search: folders to search instead of :func:`locale_dirs` (tests use a tmp folder).
        required: raise :class:`MissingData` instead of returning ``[]`` when nothing is found.

    Returns:
        the ``(english, translation)`` pairs; ``[]`` when the machine has no catalogue for
        ``lang`` (minimal containers often strip them).

    Raises:
        ValueError: a malformed ``lang``.
        MissingData: nothing found and ``required=True``; the message lists the folders.
    """
    files = gettext_catalogues(lang, domains, search=search)
    pairs: dict[tuple[str, str], None] = {}  # an ordered set
    for file in files:
        try:
            entries = _catalogue_pairs(file)
        except (OSError, ValueError, LookupError, struct.error):
            continue  # one unreadable catalogue (bad magic, unknown charset) must not stop all
        for source, target in entries:
            if single_line and any(c in s for s in (source, target) for c in "\n\t"):
                continue
            pairs.setdefault((source, target), None)
    if not pairs and required:
        roots = locale_dirs() if search is None else list(search)
        raise MissingData(
            f"no gettext catalogue pairs for lang={lang!r}, domains={domains!r} under "
            f"{[str(r) for r in roots]} (<dir>/{lang}/LC_MESSAGES/*.mo); install the "
            f"system's language packs or pass a TSV file instead"
        )
    return list(pairs)
