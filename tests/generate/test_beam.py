"""Beam search: beam 1 is greedy, a wide beam equals exhaustive search (with and without the
length penalty), it beats greedy on a hand-built model where greedy fails, num_return and
scores, and clear errors."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from torch import nn

from qkv.generate import beam_search, greedy, length_penalty
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.nn import KVCache

PAD, BOS, EOS, A, B, C = range(6)


class TableLM(nn.Module):
    """A decoder-only "model" whose next-token distribution is a table of the real prefix.

    It follows the DecoderLM calling convention: the token ids stand in for keys in a one-layer
    KVCache, so ``KVCache.reorder`` moves them with their beams, and left padding is dropped
    through ``attention_mask``.

    After BOS: A 0.5, B 0.4, EOS 0.1. After A: A 0.34, B 0.33, C 0.33. After B: C 0.9, EOS 0.1.
    Anything longer: EOS. Greedy takes A A EOS (p = 0.17); the best sequence is B C EOS
    (p = 0.36).
    """

    TABLE: ClassVar[dict] = {
        (BOS,): {A: 0.5, B: 0.4, EOS: 0.1},
        (BOS, A): {A: 0.34, B: 0.33, C: 0.33},
        (BOS, B): {C: 0.9, EOS: 0.1},
    }

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=6, eos_id=EOS, pad_id=PAD, bos_id=BOS, max_len=None)
        self.dummy = nn.Parameter(torch.zeros(()))

    def new_cache(self) -> KVCache:
        return KVCache(1)

    def forward(self, input_ids, *, attention_mask=None, cache=None, positions=None):
        k = input_ids.float()[:, None, :, None]  # (B, 1, T, 1)
        ids = cache[0].update(k, k)[0][:, 0, :, 0].long() if cache is not None else input_ids
        keep = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        T, S = input_ids.shape[1], ids.shape[1]
        logits = torch.full((ids.shape[0], T, 6), math.log(1e-9))
        for b in range(ids.shape[0]):
            for t in range(T):
                upto = S - T + t + 1
                prefix = tuple(i for i, k in zip(ids[b, :upto].tolist(), keep[b, :upto].tolist(), strict=True) if k)
                for tok, p in self.TABLE.get(prefix, {EOS: 1.0}).items():
                    logits[b, t, tok] = math.log(p)
        return logits


def test_greedy_fails_where_beam_search_succeeds():
    model = TableLM()
    assert greedy(model, [[BOS]], max_new_tokens=5).tolist() == [[A, A, EOS]]
    tokens, score = beam_search(model, [[BOS]], beam_size=2, alpha=0.0, max_new_tokens=5,
                                return_scores=True)  # fmt: skip
    assert tokens.tolist() == [[B, C, EOS]]
    assert abs(float(score[0]) - math.log(0.36)) < 1e-5


def test_hand_built_model_batched_with_left_padding():
    model = TableLM()
    # Row 1 is padded on the left by the session; the table only sees real tokens.
    out = beam_search(model, [[PAD, BOS], [BOS]], beam_size=2, alpha=0.0, max_new_tokens=5)
    assert out[1].tolist() == [B, C, EOS]


def _lm(V=5, seed=6):
    torch.manual_seed(seed)
    config = DecoderLMConfig(V, d_model=16, num_layers=1, num_heads=2, max_len=32)
    model = DecoderLM(config).eval()
    with torch.no_grad():  # sharper distributions, so that the search has something to find
        model.lm_head.weight.mul_(3.0)
    return model


@torch.no_grad()
def _exhaustive(model, prompt, L, eos, alpha):
    """Best (score, tokens) over every continuation of <= L tokens (ending at EOS or at L)."""
    V = model.config.vocab_size
    best = (-math.inf, None)
    for n in range(1, L + 1):
        for seq in itertools.product(range(V), repeat=n):
            if eos in seq[:-1] or (n < L and seq[-1] != eos):
                continue
            ids = torch.tensor([prompt + list(seq)])
            logp = model(ids)[0].log_softmax(-1)  # (P + n, V)
            total = sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(seq))
            score = total / length_penalty(n, alpha)
            if score > best[0]:
                best = (score, list(seq))
    return best


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_wide_beam_equals_exhaustive_search(alpha):
    model = _lm()
    prompt, L, eos = [1, 3], 3, 2
    score, tokens = _exhaustive(model, prompt, L, eos, alpha)
    # This model was picked so the search matters: greedy says 3 3 3, the best sequence is
    # EOS at once without a length penalty and 4 4 4 with a strong one.
    assert greedy(model, [prompt], max_new_tokens=L, eos_id=eos).tolist() == [[3, 3, 3]]
    assert tokens == ([2] if alpha < 1 else [4, 4, 4])
    out, got = beam_search(model, [prompt], beam_size=5**L, max_new_tokens=L, alpha=alpha,
                           eos_id=eos, pad_id=0, return_scores=True)  # fmt: skip
    row = out[0].tolist()
    row = row[: row.index(eos) + 1] if eos in row else row
    assert row == tokens, f"alpha={alpha}: beam {row} vs exhaustive {tokens}"
    assert abs(float(got[0]) - score) < 1e-4, f"score {float(got[0])} vs {score}"


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_beam_one_without_length_penalty_is_greedy(kind):
    torch.manual_seed(1)
    if kind == "lm":
        model = DecoderLM(DecoderLMConfig(30, d_model=32, num_layers=2, num_heads=4, max_len=64)).eval()
        inputs = [[1, 4, 5], [1, 9, 9, 9, 9], [1]]
    else:
        config = Seq2SeqConfig(30, 30, d_model=32, num_heads=4, d_ff=64, dropout=0.0)
        model = Seq2SeqTransformer(config).eval()
        inputs = [[4, 5, 2], [9, 9, 9, 9, 2], [2]]
    free = greedy(model, inputs, max_new_tokens=8, eos_id=None)
    eos = int(free[0, 2])  # a token greedy emits, so that rows stop at different steps
    expected = greedy(model, inputs, max_new_tokens=8, eos_id=eos, pad_id=0)
    got = beam_search(model, inputs, beam_size=1, alpha=0.0, max_new_tokens=8, eos_id=eos, pad_id=0)
    L = max(expected.shape[1], got.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, L - t.shape[1]))  # noqa: E731
    assert torch.equal(pad(got), pad(expected)), f"{got.tolist()} vs {expected.tolist()}"


def test_num_return_gives_sorted_distinct_hypotheses():
    model = _lm(V=7, seed=3)
    tokens, scores = beam_search(model, [[1, 3], [1]], beam_size=4, num_return=3, max_new_tokens=4,
                                 eos_id=2, pad_id=0, return_scores=True)  # fmt: skip
    assert tokens.shape[:2] == (2, 3) and scores.shape == (2, 3)
    assert bool((scores[:, :-1] >= scores[:, 1:]).all()), scores
    for b in range(2):
        rows = {tuple(r) for r in tokens[b].tolist()}
        assert len(rows) == 3, f"input {b}: hypotheses repeat {tokens[b].tolist()}"


def test_length_penalty_formula():
    assert length_penalty(1, 0.0) == 1.0
    assert length_penalty(1, 1.0) == 1.0
    assert abs(length_penalty(7, 0.6) - 2.0**0.6) < 1e-12


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_size=0), "beam_size must be a positive int, got 0"),
    (dict(num_return=0), "num_return must be a positive int, got 0"),
    (dict(beam_size=2, num_return=3), "num_return=3 must be <= beam_size=2"),
    (dict(alpha=-0.5), "alpha must be a finite number >= 0 \\(0 = no length penalty\\), got -0.5"),
])  # fmt: skip
def test_beam_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        beam_search(_lm(), [[1, 2]], **kwargs)
