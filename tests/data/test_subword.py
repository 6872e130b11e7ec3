"""BPE and WordPiece through the `tokenizers` library: train, save, load, same ids."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("tokenizers", reason="the tokenizers extra: pip install 'qkv[tokenizers]'")

from qkv.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    BPETokenizer,
    Tokenizer,
    WordPieceTokenizer,
    load_tokenizer,
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "attention is all you need, said the transformer",
    "queries keys and values: the three projections of attention",
    "Grüße aus Köln, naïve café",
] * 20


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(CORPUS, vocab_size=320)


@pytest.fixture(scope="module")
def wordpiece():
    return WordPieceTokenizer.train(CORPUS, vocab_size=120)


def test_special_tokens_have_the_shared_ids(bpe, wordpiece):
    for tok in (bpe, wordpiece):
        assert isinstance(tok, Tokenizer)
        assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
        specials = [tok.backend.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<unk>")]
        assert specials == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "text",
    [
        "the quick brown fox",
        "unseen words: xylophone zebra",
        "emoji 😀👍🏽 CJK 中文字符, tabs\tand\nnewlines",
        "  leading and trailing spaces  ",
        "text that spells <eos> and <pad>",
    ],
)
def test_bpe_round_trip_is_lossless(bpe, text):
    ids = bpe.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    body = ids[1:-1]
    assert not {PAD_ID, BOS_ID, EOS_ID, UNK_ID} & set(body), "specials inside the text"
    assert bpe.decode(ids) == text


def test_bpe_merges_frequent_words(bpe):
    assert len(bpe.encode("attention")) < len("attention")
    assert 260 < bpe.vocab_size <= 320


def test_wordpiece_round_trip_of_ids(wordpiece):
    text = "the quick fox said attention"
    ids = wordpiece.encode(text)
    assert UNK_ID not in ids
    assert wordpiece.decode(ids) == text
    assert wordpiece.encode(wordpiece.decode(ids)) == ids


def test_wordpiece_unknown_characters_give_unk(wordpiece):
    ids = wordpiece.encode("the 😀")
    assert ids[-1] == UNK_ID
    assert wordpiece.decode(ids) == "the <unk>"


@pytest.mark.parametrize("which", ["bpe", "wordpiece"])
def test_save_load_gives_same_ids(which, request, tmp_path):
    tok = request.getfixturevalue(which)
    path = tok.save(tmp_path)
    assert path == tmp_path / "tokenizer.json"
    on_disk = json.loads(path.read_text())
    assert [t["content"] for t in on_disk["added_tokens"]] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    loaded = load_tokenizer(path)
    assert type(loaded) is type(tok)
    assert loaded.vocab_size == tok.vocab_size
    for text in [*CORPUS[:4], "text that spells <eos>", "zebra 😀"]:
        assert loaded.encode(text, add_eos=True) == tok.encode(text, add_eos=True)
        assert loaded.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_decode_skip_special(bpe):
    ids = [BOS_ID, *bpe.encode("fox"), UNK_ID, EOS_ID, PAD_ID]
    assert bpe.decode(ids) == "fox<unk>"
    assert bpe.decode(ids, skip_special=False) == "<bos>fox<unk><eos><pad>"


def test_train_from_files_and_folders(tmp_path):
    (tmp_path / "a.txt").write_text("\n".join(CORPUS[:4]))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("more attention text")
    from_folder = BPETokenizer.train(tmp_path, vocab_size=300)
    from_texts = BPETokenizer.train(["\n".join(CORPUS[:4]) + "\n\nmore attention text"], 300)
    assert from_folder.encode(CORPUS[0]) == from_texts.encode(CORPUS[0])
    from_file = WordPieceTokenizer.train([tmp_path / "a.txt"], vocab_size=80)
    assert UNK_ID not in from_file.encode("the quick brown fox")


def test_errors(bpe, tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size must be an int >= 260.*got 100"):
        BPETokenizer.train(CORPUS, vocab_size=100)
    with pytest.raises(ValueError, match=r"vocab_size must be an int > 4, got 4"):
        WordPieceTokenizer.train(CORPUS, vocab_size=4)
    with pytest.raises(TypeError, match=r"str texts or pathlib.Path files, got int"):
        BPETokenizer.train(["ok", 7], vocab_size=300)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab_size=\d+\), got 100000"):
        bpe.decode([100000])
    path = bpe.save(tmp_path / "bpe.json")
    with pytest.raises(ValueError, match=r"bpe.json holds a BPE tokenizer, expected WordPiece"):
        WordPieceTokenizer.load(path)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer file at"):
        BPETokenizer.load(tmp_path / "none.json")


def test_foreign_special_ids_are_refused(tmp_path):
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    trainer = tokenizers.trainers.WordPieceTrainer(
        vocab_size=50, special_tokens=["[UNK]", "<pad>"], show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    pattern = r"tokenizer\.json: the tokenizer must give \[.<pad>.*the ids \[0, 1, 2, 3\], got \[1,"
    with pytest.raises(ValueError, match=pattern):
        load_tokenizer(tmp_path)


def test_missing_library_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match=r"pip install 'qkv\[tokenizers\]'"):
        BPETokenizer.train(CORPUS, vocab_size=300)
    with pytest.raises(ImportError, match=r"pip install 'qkv\[tokenizers\]'"):
        WordPieceTokenizer.train(CORPUS, vocab_size=50)
