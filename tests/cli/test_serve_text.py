"""``qkv serve``'s streamed text (:class:`qkv.pretrained.stop_text.TextStream`) on a byte-level
decoder (one token = one byte): the pieces are always valid text, join to the decoded whole cut
at the first stop string, and never show the start of a stop string before it is known not to
be one."""

from __future__ import annotations

import pytest

from qkv.pretrained.stop_text import TextStream


def _decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def _pieces(text: str, stops: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    stream = TextStream(_decode, stops)
    pieces = [stream.push(b) for b in text.encode()]
    return [*pieces, stream.close()], stream


def _cut(text: str, stops: tuple[str, ...]) -> str:
    found = [text.index(s) for s in stops if s in text]
    return text[: min(found)] if found else text


CASES = [
    ("plain ascii", ()),
    ("snow ☃ and 😀 faces", ()),
    ("one two\n\nthree", ("\n\n",)),
    ("a 😀😀 b", ("😀",)),
    ("abab abc", ("abc",)),
    ("no stop here ab", ("abc",)),  # a held tail "ab" that the end releases
    ("x END y STOP z", ("STOP", "END")),  # the first stop in the text wins, not the first listed
    ("aaab", ("aab",)),  # overlapping prefixes
]


@pytest.mark.parametrize(("text", "stops"), CASES)
def test_pieces_are_whole_characters_and_join_to_the_cut_text(text, stops):
    pieces, stream = _pieces(text, stops)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == stream.text == _cut(text, stops)
    assert stream.stopped == any(s in text for s in stops)


@pytest.mark.parametrize(("text", "stops"), CASES)
def test_no_piece_shows_text_past_a_stop(text, stops):
    """What was sent before each push never goes past the cut (a held prefix of a stop is
    sent only once the text shows it is not one)."""
    stream, cut = TextStream(_decode, stops), _cut(text, stops)
    for b in text.encode():
        stream.push(b)
        assert cut.startswith(stream.text), (stream.text, cut)


def test_a_stop_prefix_is_held_until_the_text_decides():
    stream = TextStream(_decode, ("STOP",))
    assert [stream.push(b) for b in b"go ST"] == ["g", "o", " ", "", ""]
    assert stream.push(ord("a")) == "STa"
    assert [stream.push(b) for b in b" STOP!"] == [" ", "", "", "", "", ""]
    assert stream.stopped and stream.text == "go STa " and stream.close() == ""


def test_stops_must_be_non_empty_strings():
    with pytest.raises(ValueError, match="stops must be non-empty strings"):
        TextStream(_decode, ("",))
