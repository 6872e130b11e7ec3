"""qkv.generate.beam_search_hf against transformers' beam search on the same random-weight
BART, Marian and T5 folders (built by tests/pretrained/test_hf_seq2seq.py's helpers): identical
token ids for length penalties 0, 1 and 2 and every early_stopping setting."""

from __future__ import annotations

import pytest
import torch
from test_hf_seq2seq import FAMILIES, SOURCES, _batch, _cut, _folder, _load

from qkv.generate import beam_search, beam_search_hf


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("beam_hf")


@pytest.mark.parametrize("family", ["bart", "marian", "t5"])
@pytest.mark.parametrize(("lp", "early"), [(1.0, False), (2.0, False), (1.0, True),
                                           (2.0, "never"), (0.0, "never"), (-1.0, False)])
def test_equals_transformers_beam_search(root, family, lp, early):
    folder, ref = _folder(family, root)
    bundle = _load(folder)
    rows, src, keep = _batch(bundle)
    eos, n = bundle.config.eos_id, 16
    for K in (2, 4):
        with torch.no_grad():
            out = ref.generate(src, attention_mask=keep, num_beams=K, length_penalty=lp,
                               early_stopping=early, do_sample=False, forced_bos_token_id=None,
                               forced_eos_token_id=None, no_repeat_ngram_size=0, min_length=0,
                               max_new_tokens=n)  # fmt: skip
        expected = _cut(out[:, 1:], eos)
        ours = _cut(beam_search_hf(bundle.model, rows, beam_size=K, max_new_tokens=n,
                                   length_penalty=lp, early_stopping=early), eos)  # fmt: skip
        assert ours == expected, f"{family} K={K} length_penalty={lp} early_stopping={early}"


def test_differs_from_gnmt_search_where_the_penalty_matters(root):
    """The two searches are different definitions: on BART with length_penalty 2 at least one
    output differs from the GNMT-penalised search with the same exponent (else this test file
    would prove nothing beyond test_hf_seq2seq)."""
    folder, _ = _folder("bart", root)
    bundle = _load(folder)
    rows, _, _ = _batch(bundle)
    eos = bundle.config.eos_id
    differ = False
    for K in (2, 3, 4):
        ours = _cut(beam_search_hf(bundle.model, rows, beam_size=K, max_new_tokens=16,
                                   length_penalty=2.0), eos)  # fmt: skip
        gnmt = _cut(beam_search(bundle.model, rows, beam_size=K, max_new_tokens=16,
                                alpha=2.0), eos)  # fmt: skip
        differ |= ours != gnmt
    assert differ


@pytest.mark.parametrize(("kw", "match"), [
    (dict(early_stopping="always"), "early_stopping must be one of"),
    (dict(early_stopping=1), "early_stopping must be one of"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(beam_size=0), "beam_size"),
    (dict(num_return=3, beam_size=2), "num_return=3 must be <= beam_size=2"),
])
def test_bad_arguments(root, kw, match):
    folder, _ = _folder("marian", root)
    bundle = _load(folder)
    with pytest.raises(ValueError, match=match):
        beam_search_hf(bundle.model, [[5, 6, 0]], **kw)


def test_families_fixture_is_shared():
    assert {"bart", "marian", "t5"} <= set(FAMILIES)


def test_bundle_translate_follows_transformers_with_length_penalty(root):
    folder, ref = _folder("marian", root)
    bundle = _load(folder)
    _, src, keep = _batch(bundle)
    with torch.no_grad():
        out = ref.generate(src, attention_mask=keep, num_beams=4, length_penalty=1.0,
                           early_stopping=True, do_sample=False, forced_bos_token_id=None,
                           forced_eos_token_id=None, no_repeat_ngram_size=0, min_length=0,
                           max_new_tokens=12, bad_words_ids=None)  # fmt: skip
    expected = [bundle.tokenizer.decode(r, skip_special_tokens=True)
                for r in _cut(out[:, 1:], bundle.config.eos_id)]  # fmt: skip
    got = bundle.translate(SOURCES, beam_size=4, length_penalty=1.0, early_stopping=True,
                           max_new_tokens=12)  # fmt: skip
    assert got == expected
    with pytest.raises(ValueError, match="needs beam_size and excludes alpha"):
        bundle.translate(SOURCES, length_penalty=1.0)
