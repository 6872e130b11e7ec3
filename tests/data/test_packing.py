"""``qkv.data.packing``: every token lands once; rows, ids, positions and targets.

The invariants are checked by reading the documents back out of the rows (hypothesis draws
the lengths), against the documents themselves.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data.packing import (
    IGNORE_INDEX,
    PAD_DOCUMENT,
    STRATEGIES,
    pack_documents,
    pack_lm,
    plan_rows,
    split_documents,
)

lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=30)


def make_docs(lengths):
    """Document d is ``[1000·d + 0, 1000·d + 1, ...]``: every token says where it came from."""
    return [[1000 * d + t for t in range(n)] for d, n in enumerate(lengths)]


def read_back(packed, with_targets=False):
    """``{document: [its tokens in row order]}`` from the rows, checking ids and positions."""
    found: dict[int, list[int]] = {}
    for r in range(len(packed)):
        ids, toks, pos = (packed.document_ids[r].tolist(), packed.tokens[r].tolist(),
                          packed.positions[r].tolist())  # fmt: skip
        seen_pad = False
        for t, (i, tok, p) in enumerate(zip(ids, toks, pos, strict=True)):
            if i == PAD_DOCUMENT:
                seen_pad = True
                if with_targets:
                    assert packed.targets[r, t] == IGNORE_INDEX, (r, t)
                continue
            assert not seen_pad, f"row {r}: a document after padding at {t}"
            first = t == 0 or ids[t - 1] != i
            assert p == (0 if first else pos[t - 1] + 1), f"row {r} position {t}: {p}"
            if with_targets:  # the next token of the same document
                assert packed.targets[r, t] == tok + 1, (r, t)
            found.setdefault(tok // 1000, []).append(tok)
        runs = [i for t, i in enumerate(ids) if i != PAD_DOCUMENT and (t == 0 or ids[t - 1] != i)]
        assert runs == list(range(len(runs))), f"row {r}: ids {runs} are not 0, 1, ... per run"
    return found


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, T=st.integers(1, 24), strategy=st.sampled_from(STRATEGIES))
def test_every_token_lands_once(lengths, T, strategy):
    docs = make_docs(lengths)
    packed = pack_documents(docs, T, strategy=strategy)
    assert packed.tokens.shape[1] == T
    found = read_back(packed)
    for d, doc in enumerate(docs):
        assert sorted(found.get(d, [])) == doc, f"document {d} (length {len(doc)})"
    assert packed.real_tokens == sum(lengths)
    total = packed.tokens.numel()
    assert packed.padding_fraction == pytest.approx(1 - sum(lengths) / total if total else 0.0)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, T=st.integers(1, 24))
def test_best_fit_keeps_short_documents_whole_and_sequential_does_not_pad(lengths, T):
    for row in plan_rows(lengths, T, strategy="best_fit"):
        assert sum(b - a for _, a, b in row) <= T
        for d, a, b in row:  # a piece starts at a multiple of T, whole unless it is long
            assert a % T == 0 and (b == min(a + T, lengths[d])), (d, a, b)
    rows = plan_rows(lengths, T, strategy="sequential")
    fills = [sum(b - a for _, a, b in row) for row in rows]
    assert all(f == T for f in fills[:-1]), fills  # only the last row is padded
    order = [(d, a) for row in rows for d, a, _ in row]
    assert order == sorted(order), "sequential keeps the documents' order"


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, T=st.integers(1, 24), packed=st.booleans())
def test_lm_rows_predict_the_next_token_inside_each_document(lengths, T, packed):
    docs = make_docs(lengths)
    rows = pack_lm(docs, T, packed=packed)
    found = read_back(rows, with_targets=True)
    for d, doc in enumerate(docs):  # each document's inputs are all its tokens but the last
        assert sorted(found.get(d, [])) == doc[:-1], f"document {d}"
    if not packed:
        assert bool((rows.document_ids <= 0).all()), "padded rows hold one document each"


def test_small_example_by_hand():
    rows = pack_lm([[5, 6, 7], [8, 9]], 4)
    assert rows.tokens.tolist() == [[5, 6, 8, 0]]
    assert rows.targets.tolist() == [[6, 7, 9, IGNORE_INDEX]]
    assert rows.document_ids.tolist() == [[0, 0, 1, PAD_DOCUMENT]]
    assert rows.positions.tolist() == [[0, 1, 0, 0]]
    assert rows.padding_fraction == 0.25
    padded = pack_lm([[5, 6, 7], [8, 9]], 4, packed=False)
    assert padded.tokens.tolist() == [[5, 6, 0, 0], [8, 0, 0, 0]]
    assert padded.padding_fraction == pytest.approx(5 / 8)


def test_long_documents_split_or_refused():
    rows = pack_documents([list(range(10))], 4)
    assert rows.num_pieces == 3 and rows.num_documents == 1
    assert rows.positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0, 1]]
    with pytest.raises(ValueError, match="document 1 has 10 tokens, more than the row length T=4"):
        pack_documents([[1], list(range(10))], 4, long="error")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="strategy must be one of"):
        pack_documents([[1]], 4, strategy="fast")
    with pytest.raises(ValueError, match="long must be one of"):
        pack_documents([[1]], 4, long="drop")
    with pytest.raises(ValueError, match="length"):
        pack_documents([[1]], 0)
    with pytest.raises(TypeError, match=r"documents\[1\] must be a sequence of int token ids"):
        pack_documents([[1], ["a"]], 4)
    with pytest.raises(TypeError, match=r"documents\[0\] must be a 1-D integer tensor"):
        pack_documents([torch.ones(2, 2, dtype=torch.long)], 4)
    with pytest.raises(TypeError, match="documents must be a sequence"):
        pack_documents("abc", 4)


def test_split_documents():
    assert split_documents("a b\n\n\n\nc\n\n  \n\nd") == ["a b", "c", "d"]
    with pytest.raises(ValueError, match="separator"):
        split_documents("abc", "")


def test_labeled_documents_learn_only_their_labelled_tokens():
    """A LabeledDocument's targets are its labels one later; the rest is IGNORE_INDEX, and
    its tokens still sit in the row (as context)."""
    from qkv.data.packing import LabeledDocument

    X = IGNORE_INDEX
    doc = LabeledDocument([5, 6, 7, 8, 9], [X, X, 7, 8, X])
    rows = pack_lm([doc, [1, 2, 3]], 8)
    assert rows.tokens.tolist() == [[5, 6, 7, 8, 1, 2, 0, 0]]
    assert rows.targets.tolist() == [[X, 7, 8, X, 2, 3, X, X]]
    assert doc.learned == 2
    with pytest.raises(ValueError, match="label 4 at position 1 is neither the token"):
        LabeledDocument([1, 2], [1, 4])
    with pytest.raises(ValueError, match="2 ids but 1 labels"):
        LabeledDocument([1, 2], [1])
    with pytest.raises(TypeError, match=r"LabeledDocument\.labels must be a sequence of ints"):
        LabeledDocument([1, 2], "ab")
