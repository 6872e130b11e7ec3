"""Parallel text: TSV files with line-numbered errors, gettext catalogues built in tmp_path."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from qkv.data import MissingData, gettext_catalogues, gettext_pairs, load_pairs_tsv
from qkv.data.parallel import locale_dirs

HEADER = "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n != 1);\n"
ENTRIES = {
    "": HEADER,  # metadata: dropped
    "File not found": "Datei nicht gefunden",
    "Open": "Öffnen",
    "menu\x04Quit": "Beenden",  # with a message context: the context is dropped
    "Untranslated": "",  # empty translation: dropped
    "file\x00files": "Datei\x00Dateien",  # plural: dropped
    "two\nlines": "zwei\nZeilen",  # kept only with single_line=False
}


def write_mo(path: Path, entries: dict[str, str]) -> Path:
    """Pack a GNU .mo file by hand: header, two offset tables, then the strings."""
    keys = sorted(entries)  # .mo requires msgids in sorted (byte) order
    ids = [k.encode() for k in keys]
    strs = [entries[k].encode() for k in keys]
    n = len(keys)
    header_size, table_size = 7 * 4, n * 8
    offset = header_size + 2 * table_size
    id_table, str_table, blob = [], [], b""
    for s in ids:
        id_table += [len(s), offset + len(blob)]
        blob += s + b"\0"
    for s in strs:
        str_table += [len(s), offset + len(blob)]
        blob += s + b"\0"
    head = struct.pack("<7I", 0x950412DE, 0, n, header_size, header_size + table_size, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + struct.pack(f"<{4 * n}I", *id_table, *str_table) + blob)
    return path


@pytest.fixture
def locale(tmp_path) -> Path:
    root = tmp_path / "locale"
    write_mo(root / "de" / "LC_MESSAGES" / "app.mo", ENTRIES)
    tool = {"": HEADER, "Open": "Öffnen", "Save": "Speichern"}
    write_mo(root / "de" / "LC_MESSAGES" / "tool.mo", tool)
    write_mo(root / "fr" / "LC_MESSAGES" / "app.mo", {"": HEADER, "Open": "Ouvrir"})
    (root / "de" / "LC_MESSAGES" / "broken.mo").write_bytes(b"not a catalogue")
    return root


def test_gettext_pairs_reads_singular_entries(locale):
    pairs = gettext_pairs("de", search=[locale])
    # app.mo first (sorted paths), its entries sorted; tool.mo's duplicate "Open" kept once.
    assert pairs == [
        ("File not found", "Datei nicht gefunden"),
        ("Open", "Öffnen"),
        ("Quit", "Beenden"),
        ("Save", "Speichern"),
    ]
    assert gettext_pairs("fr", search=[locale]) == [("Open", "Ouvrir")]


def test_gettext_options(locale):
    tool = gettext_pairs("de", ["tool"], search=[locale])
    assert tool == [("Open", "Öffnen"), ("Save", "Speichern")]
    assert gettext_pairs("de", "tool", search=[locale]) == tool  # one name, not its letters
    multi = gettext_pairs("de", ["app"], search=[locale], single_line=False)
    assert ("two\nlines", "zwei\nZeilen") in multi
    names = [p.name for p in gettext_catalogues("de", search=[locale])]
    assert names == ["app.mo", "broken.mo", "tool.mo"]


def test_gettext_missing_gives_empty_or_raises(locale, tmp_path):
    assert gettext_pairs("it", search=[locale]) == []
    assert gettext_pairs("de", ["nope"], search=[locale]) == []
    with pytest.raises(MissingData, match=r"no gettext catalogue pairs for lang='it'.*locale"):
        gettext_pairs("it", search=[locale], required=True)
    assert gettext_pairs("de", search=[tmp_path / "absent"]) == []


def test_gettext_bad_lang():
    with pytest.raises(ValueError, match=r"lang must be a locale code .*got '../de'"):
        gettext_pairs("../de")


def test_system_catalogues_when_present():
    # Runs everywhere: the machine's catalogues give str pairs, or none at all.
    files = gettext_catalogues("de", ["coreutils", "apt"])
    pairs = gettext_pairs("de", ["coreutils", "apt"])
    assert all(isinstance(s, str) and isinstance(t, str) and s and t for s, t in pairs)
    assert bool(pairs) == bool(files), f"{len(files)} catalogues gave {len(pairs)} pairs"
    assert all(d.is_dir() for d in locale_dirs())


def test_load_pairs_tsv(tmp_path):
    f = tmp_path / "pairs.tsv"
    f.write_bytes(b"hello\thallo\r\n\nthe cat\tdie Katze\n")
    assert load_pairs_tsv(f) == [("hello", "hallo"), ("the cat", "die Katze")]


@pytest.mark.parametrize(
    ("content", "line", "tabs"),
    [
        ("a\tb\nno tab here\n", 2, 0),
        ("a\tb\nc\td\n\nx\ty\tz\n", 4, 2),
        ("\tmissing source\n", 1, 1),
        ("missing target\t\n", 1, 1),
    ],
)
def test_load_pairs_tsv_errors_name_file_and_line(tmp_path, content, line, tabs):
    f = tmp_path / "bad.tsv"
    f.write_text(content)
    pattern = rf"bad\.tsv:{line}: expected 'source<TAB>target'.*got {tabs} tab"
    with pytest.raises(ValueError, match=pattern):
        load_pairs_tsv(f)


def test_load_pairs_tsv_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no TSV file at .*none.tsv"):
        load_pairs_tsv(tmp_path / "none.tsv")
