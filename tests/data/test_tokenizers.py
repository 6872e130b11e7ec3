"""Character and byte tokenizers, the shared special ids, and load_tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
)

TEXTS = [
    "hello world",
    "Grüße, naïve café — ½ ∑",
    "emoji 😀👍🏽 and CJK 中文字符 日本語",
    "tabs\tand\nnewlines\r\n and a NUL \x00 byte",
    "",
    "<eos> <pad> spelled out",
]


def test_special_ids_are_fixed():
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert SPECIAL_TOKENS == ("<pad>", "<bos>", "<eos>", "<unk>")
    for tok in (CharTokenizer.fit(TEXTS), ByteTokenizer()):
        assert isinstance(tok, Tokenizer)
        assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip_is_lossless(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == [b + 4 for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text
    assert tok.vocab_size == 260
    assert all(4 <= i < 260 for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_char_round_trip_on_its_corpus(text):
    tok = CharTokenizer.fit(TEXTS)
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID and len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    # The special-token spellings in the text stay ordinary characters.
    assert PAD_ID not in ids[1:-1] and EOS_ID not in ids[1:-1]


def test_char_vocab_is_sorted_and_deterministic():
    tok = CharTokenizer.fit(["cab", "bca"])
    assert tok.chars == ["a", "b", "c"]
    assert tok.vocab_size == 7
    assert tok.encode("abc") == [4, 5, 6]
    assert CharTokenizer.fit(["bca", "cab"]).chars == tok.chars
    assert CharTokenizer.fit("cab").chars == tok.chars  # one string is one text


def test_char_unknown_becomes_unk_and_decodes_as_unk_text():
    tok = CharTokenizer.fit(["abc"])
    ids = tok.encode("abz")
    assert ids == [4, 5, UNK_ID]
    assert tok.decode(ids) == "ab<unk>"


def test_char_min_count_drops_rare_characters():
    tok = CharTokenizer.fit(["aab"], min_count=2)
    assert tok.chars == ["a"]
    assert tok.encode("ab") == [4, UNK_ID]


@pytest.mark.parametrize("tok", [CharTokenizer.fit(["xyz"]), ByteTokenizer()], ids=repr)
def test_skip_special_drops_pad_bos_eos_keeps_unk(tok):
    body = tok.encode("xy")
    ids = [BOS_ID, *body, UNK_ID, EOS_ID, PAD_ID, PAD_ID]
    assert tok.decode(ids) == "xy<unk>"
    assert tok.decode(ids, skip_special=False) == "<bos>xy<unk><eos><pad><pad>"


def test_byte_decode_of_invalid_utf8_replaces_bad_bytes():
    tok = ByteTokenizer()
    ids = tok.encode("é")  # two bytes; drop the second
    assert tok.decode(ids[:1] + tok.encode("a")) == "\ufffda"
    # A special between the bytes of one character splits it the same way.
    assert tok.decode([ids[0], EOS_ID, ids[1]], skip_special=False) == "\ufffd<eos>\ufffd"


@pytest.mark.parametrize("tok", [CharTokenizer.fit(TEXTS), ByteTokenizer()], ids=repr)
def test_save_load_gives_same_ids(tok, tmp_path):
    path = tok.save(tmp_path / "tok.json")
    for loaded in (type(tok).load(path), load_tokenizer(path)):
        assert type(loaded) is type(tok)
        assert loaded.vocab_size == tok.vocab_size
        for text in TEXTS:
            assert loaded.encode(text) == tok.encode(text)
    # A folder means <folder>/tokenizer.json.
    assert tok.save(tmp_path) == tmp_path / "tokenizer.json"
    assert load_tokenizer(tmp_path).encode("hello") == tok.encode("hello")


@pytest.mark.parametrize("tok", [CharTokenizer.fit(["ab"]), ByteTokenizer()], ids=repr)
def test_decode_rejects_bad_ids(tok):
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab_size=\d+\), got 999"):
        tok.decode([4, 999])
    with pytest.raises(ValueError, match=r"got -1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match=r"1-D tensor \(T,\), got shape \(1, 2\)"):
        tok.decode(torch.tensor([[4, 5]]))
    with pytest.raises(TypeError, match=r"integer tensor, got dtype torch.float32"):
        tok.decode(torch.tensor([4.0]))
    with pytest.raises(TypeError, match=r"ids must be ints, got str"):
        tok.decode(["a"])


@pytest.mark.parametrize("tok", [CharTokenizer.fit(["ab"]), ByteTokenizer()], ids=repr)
def test_encode_rejects_non_text(tok):
    with pytest.raises(TypeError, match=r"text must be a str, got bytes"):
        tok.encode(b"ab")


def test_char_constructor_errors():
    with pytest.raises(ValueError, match=r"single characters, got \['ab'\]"):
        CharTokenizer(["a", "ab"])
    with pytest.raises(ValueError, match=r"distinct, got repeats \['a'\]"):
        CharTokenizer(["a", "b", "a"])
    with pytest.raises(ValueError, match=r"min_count must be an int >= 1, got 0"):
        CharTokenizer.fit(["a"], min_count=0)
    with pytest.raises(TypeError, match=r"text must be a str, got int"):
        CharTokenizer.fit(["a", 3])


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer file at .*missing.json"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json is not valid JSON"):
        load_tokenizer(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": {"type": "Unigram"}}))
    with pytest.raises(ValueError, match=r"other.json is not a qkv tokenizer.*'Unigram'"):
        load_tokenizer(other)
    ByteTokenizer().save(other)
    with pytest.raises(ValueError, match=r"other.json is not a qkv char tokenizer file"):
        CharTokenizer.load(other)
    CharTokenizer.fit("a").save(other)
    with pytest.raises(ValueError, match=r"other.json is not a qkv byte tokenizer file"):
        ByteTokenizer.load(other)
