"""Pairs and text from TSV, CSV and JSONL files: the format from the extension, named columns,
and one-line errors naming the file, the line and what was expected."""

from __future__ import annotations

import json

import pytest

from qkv.data.files import BadFileError
from qkv.data.records import load_pairs, load_records_text

PAIRS = [("hello, world", "bonjour"), ('say "hi"', "dis\tsalut"), ("é", "ü")]


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_the_three_formats_give_the_same_pairs(tmp_path):
    import csv

    with (tmp_path / "p.csv").open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["source", "target", "note"])
        w.writerows([(s, t, "x") for s, t in PAIRS])
    lines = [json.dumps({"source": s, "target": t, "id": i}) for i, (s, t) in enumerate(PAIRS)]
    _write(tmp_path / "p.jsonl", "\n".join(lines[:1]) + "\n\n" + "\n".join(lines[1:]) + "\n")
    assert load_pairs(tmp_path / "p.csv") == PAIRS
    assert load_pairs(tmp_path / "p.jsonl") == PAIRS
    plain = [(s, t) for s, t in PAIRS if "\t" not in s + t]
    _write(tmp_path / "p.tsv", "".join(f"{s}\t{t}\r\n" for s, t in plain))
    assert load_pairs(tmp_path / "p.tsv") == plain


def test_named_columns_and_keys(tmp_path):
    _write(tmp_path / "p.csv", "id,en,fr\n1,cat,chat\n2,dog,chien\n")
    assert load_pairs(tmp_path / "p.csv", source="en", target="fr") == [("cat", "chat"),
                                                                        ("dog", "chien")]
    _write(tmp_path / "p.tsv", "en\tfr\ncat\tchat\n")
    assert load_pairs(tmp_path / "p.tsv", source="en", target="fr") == [("cat", "chat")]
    (tmp_path / "bom.csv").write_bytes("\ufeffsource,target\nx,y\n".encode())  # Excel export
    assert load_pairs(tmp_path / "bom.csv") == [("x", "y")]
    _write(tmp_path / "p.jsonl", '{"q": "2+2", "a": "4"}\n')
    assert load_pairs(tmp_path / "p.jsonl", source="q", target="a") == [("2+2", "4")]


def test_text_from_records(tmp_path):
    _write(tmp_path / "t.jsonl", '{"text": "one"}\n{"text": "two\\nlines"}\n')
    assert load_records_text(tmp_path / "t.jsonl") == "one\n\ntwo\nlines"
    _write(tmp_path / "t.csv", "title,body\na,first\nb,second\n")
    assert load_records_text(tmp_path / "t.csv", key="body") == "first\n\nsecond"


@pytest.mark.parametrize(("name", "text", "kwargs", "message"), [
    ("p.jsonl", '{"source": "a", "target": "b"}\n{"source": "a"\n', {},
     r"p.jsonl:2: expected one JSON object per line, got invalid JSON"),
    ("p.jsonl", '["a", "b"]\n', {}, r"p.jsonl:1: expected a JSON object \(\{...\}\), got list"),
    ("p.jsonl", '{"source": "a", "tgt": "b"}\n', {},
     r"p.jsonl:1: no 'target' field \(set it with --target-column\); the record has "
     r"\['source', 'tgt'\]"),
    ("p.jsonl", '{"source": "a", "target": 3}\n', {},
     r"p.jsonl:1: expected 'target' to be a non-empty string, got 3"),
    ("p.csv", "source,target\na,b\nc,d,e\n", {},
     r"p.csv:3: expected 2 fields \(the header's \['source', 'target'\]\), got 3"),
    ("p.csv", "en,fr\na,b\n", {}, r"p.csv:2: no 'source' field \(set it with --source-column\)"),
    ("p.csv", "source,target\na,\n", {}, r"p.csv:2: expected 'target' to be a non-empty string"),
    ("p.csv", "", {}, r"p.csv: empty; expected a header row and rows"),
    ("p.csv", "source,target\n", {}, r"p.csv: no records; expected 'source'/'target' pairs"),
    ("p.tsv", "a\tb\nc\n", {}, r"p.tsv:2: expected 'source<TAB>target'"),
    ("p.tsv", "en\tfr\na\tb\n", {"source": "de"}, r"p.tsv:2: no 'de' field"),
    ("p.txt", "a\tb\n", {}, r"p.txt: unknown pairs format '.txt'; expected a file ending in "
     r".tsv, .csv, .jsonl"),
])  # fmt: skip
def test_malformed_files_name_file_and_line(tmp_path, name, text, kwargs, message):
    path = _write(tmp_path / name, text)
    with pytest.raises(ValueError, match=message) as info:
        load_pairs(path, **kwargs)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_files_and_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no CSV file at"):
        load_pairs(tmp_path / "nope.csv")
    path = _write(tmp_path / "t.jsonl", '{"body": "x"}\n')
    with pytest.raises(BadFileError, match=r"t.jsonl:1: no 'text' field \(set it with "
                       r"--text-column\)"):  # fmt: skip
        load_records_text(path)


def test_chat_files_are_checked_line_by_line(tmp_path):
    from qkv.data.records import load_chats

    good = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"}], "id": 7}  # fmt: skip
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n", encoding="utf-8")
    assert load_chats(path) == [(1, good["messages"]), (3, good["messages"])]
    cases = [
        ({"messages": []}, "expected a non-empty 'messages' list"),
        ({"text": "hi"}, "expected a non-empty 'messages' list, got None"),
        ({"messages": [{"role": "user"}]}, "expected messages\\[0\\] to be"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn to learn"),
    ]  # fmt: skip
    for record, message in cases:
        path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n", encoding="utf-8")
        with pytest.raises(BadFileError, match=f"{path.name}:2: {message}"):
            load_chats(path)
    with pytest.raises(BadFileError, match=r"expected a file ending in \.jsonl"):
        load_chats(tmp_path / "chats.csv")
