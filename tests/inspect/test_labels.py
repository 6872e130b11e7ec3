"""Readable token labels: real tokenizers' pieces decode to the text, one marker per space kind."""

from __future__ import annotations

import pytest

import qkv.pretrained
from qkv.inspect.labels import readable_token, readable_tokens


def _unmark(labels):
    return "".join(labels).replace("·", " ").replace("↵", "\n").replace("→", "\t")


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"])
def test_real_tokenizer_pieces_read_as_the_text(name):
    tok = qkv.pretrained.load(name).tokenizer
    text = "Printing presses spread\nacross Europe: café, naïve\tdone."
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.id_to_token(i) for i in ids]
    labels = readable_tokens(pieces)
    assert len(labels) == len(pieces)
    if name.startswith("SmolLM2"):  # byte-level BPE: every character comes back
        assert any(p.startswith("Ġ") for p in pieces) and _unmark(labels) == text, labels
    else:  # WordPiece lower-cases and drops spacing; continuations lose their ##
        assert not any(lab.startswith("##") for lab in labels), labels
        assert "press" in labels or "presses" in labels, labels


def test_markers_and_special_tokens():
    assert readable_tokens(["<|im_start|>", "Ġthe", "Ċ", "ĉ", "<s>", "</s>", "[CLS]"]) == [
        "⟨im_start⟩", "·the", "↵", "→", "⟨s⟩", "⟨/s⟩", "⟨CLS⟩"]  # fmt: skip
    assert readable_tokens(["▁The", "▁cat", "<0x0A>", "play", "##ing"]) == [
        "·The", "·cat", "↵", "play", "ing"]  # fmt: skip
    # half of an emoji: its bytes, not a replacement character
    assert readable_tokens(["ĠðŁ", "ĺ", "Ģ"]) == ["·‹f0 9f›", "‹98›", "‹80›"]
    assert readable_tokens(["ĠcafÃ©"]) == ["·café"]  # é as two byte stand-ins


def test_plain_labels_unchanged_and_idempotent():
    plain = ["The", "cat", "42", "2015-03-03"]
    assert readable_tokens(plain) == plain
    once = readable_tokens(["Ġa", "Ġb", "<s>", "▁c"])
    assert readable_tokens(once) == once
    assert readable_token("") == ""


def test_errors():
    with pytest.raises(TypeError, match="not one string"):
        readable_tokens("abc")
    with pytest.raises(TypeError, match=r"pieces\[1\] must be a str, got int"):
        readable_tokens(["a", 3])
