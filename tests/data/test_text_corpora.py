"""Language-model text: user files and folders, the stdlib corpus, the train/valid split."""

from __future__ import annotations

import itertools
import re
import sysconfig
from pathlib import Path

import pytest

from qkv.data import load_text, stdlib_corpus, train_valid_split
from qkv.data import text as text_module


def test_load_text_file_with_bad_bytes(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes("caf\u00e9 ".encode() + b"\xff\xfe end")
    assert load_text(f) == "caf\u00e9 \ufffd\ufffd end"


def test_load_text_folder_recursive_sorted_and_filtered(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "c.py").write_text("third")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD.txt").write_text("hidden")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.txt").write_text("cache")
    assert load_text(tmp_path) == "first\n\nsecond\n\nthird"
    assert load_text(tmp_path, suffixes={".md"}) == "second"


def test_load_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no file or folder at .*nothing"):
        load_text(tmp_path / "nothing")
    (tmp_path / "x.png").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds no file with a suffix in \['.md'\]"):
        load_text(tmp_path, suffixes={".md"})


def test_stdlib_corpus_reads_this_python_in_sorted_order():
    text = stdlib_corpus(max_chars=50_000)
    assert len(text) == 50_000
    assert stdlib_corpus(max_chars=50_000) == text  # deterministic
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not skipped & set(p.relative_to(root).parts[:-1])
    )
    head = (root / files[0]).read_text(encoding="utf-8", errors="replace")[:1000]
    assert head and text.startswith(head)
    assert stdlib_corpus(max_chars=2_000_000).startswith(text)


def test_stdlib_corpus_leaves_out_tests(monkeypatch):
    seen = []
    original = text_module._walk

    def spy(root, suffixes, skip):
        files = original(root, suffixes, skip)
        seen.extend(files)
        return files

    monkeypatch.setattr(text_module, "_walk", spy)
    stdlib_corpus(max_chars=1000)
    parts = {part for f in seen for part in f.parts}
    assert seen and not parts & {"test", "tests", "site-packages", "__pycache__"}


def test_stdlib_docstrings_are_prose():
    docs = stdlib_corpus(max_chars=20_000, kind="docstrings")
    assert len(docs) == 20_000
    assert "def " not in docs[:2000] and "import " not in docs[:200]


def test_stdlib_corpus_errors(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"max_chars must be a positive int or None, got 0"):
        stdlib_corpus(max_chars=0)
    with pytest.raises(ValueError, match=r"kind must be 'source' or 'docstrings', got 'code'"):
        stdlib_corpus(kind="code")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "none")})
    with pytest.raises(text_module.MissingData, match=r"no standard library source"):
        stdlib_corpus()


@pytest.mark.parametrize("length", [2, 3, 997, 4096, 50_001])
@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.5, 0.9])
def test_train_valid_split_partitions_the_text(length, fraction):
    text = "".join(chr(0x4E00 + i % 5000) for i in range(length))  # every position unique-ish
    train, valid = train_valid_split(text, fraction, seed=1, chunk_chars=1000)
    assert train and valid
    assert len(train) + len(valid) == len(text)
    assert sorted(train + valid) == sorted(text)
    n_chunks = max(2, -(-length // 1000))
    if n_chunks >= 20:
        assert abs(len(valid) / length - fraction) < 0.05, (len(valid), length, fraction)


def test_train_valid_split_is_seeded():
    text = "".join(f"line {i}\n" for i in range(20_000))
    a = train_valid_split(text, 0.1, seed=0)
    assert train_valid_split(text, 0.1, seed=0) == a
    assert train_valid_split(text, 0.1, seed=1) != a
    # Chunks keep their order: the validation text is a few runs of consecutive lines.
    valid_lines = [int(n) for n in re.findall(r"line (\d+)\n", a[1])]
    assert len(valid_lines) > 1000
    jumps = sum(1 for p, q in itertools.pairwise(valid_lines) if q != p + 1)
    assert jumps < len(valid_lines) / 100


def test_train_valid_split_errors():
    with pytest.raises(ValueError, match=r"valid_fraction must lie in \(0, 1\), got 1.0"):
        train_valid_split("abc", 1.0)
    with pytest.raises(ValueError, match=r"at least 2 characters to split, got 1"):
        train_valid_split("a", 0.5)
    with pytest.raises(TypeError, match=r"text must be a str, got list"):
        train_valid_split(["a", "b"], 0.5)
    with pytest.raises(ValueError, match=r"chunk_chars must be a positive int, got 0"):
        train_valid_split("abc", 0.5, chunk_chars=0)
