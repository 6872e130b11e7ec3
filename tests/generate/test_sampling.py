"""Logit filters and the seeded sampler: top-k, top-p (nucleus), temperature, reproducibility,
the sampled frequencies, and clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.generate import Sampler, filter_logits, top_p_keep


def _probs(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


@pytest.mark.parametrize(
    "p, kept",
    [
        (0.3, {0}),  # the most probable token alone already has mass 0.5 >= 0.3
        (0.5, {0}),  # exactly 0.5: still one token
        (0.75, {0, 1}),  # 0.5 < 0.75 <= 0.8
        (0.81, {0, 1, 2}),  # 0.8 < 0.81 <= 0.95
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, kept):
    # Unsorted on purpose: token 2 has 0.5, token 0 has 0.3, token 3 has 0.15, token 1 has 0.05.
    probs = _probs(0.3, 0.05, 0.5, 0.15)
    rank_to_token = {0: 2, 1: 0, 2: 3, 3: 1}
    expected = {rank_to_token[r] for r in kept}
    keep = top_p_keep(probs, p)[0]
    assert set(torch.nonzero(keep).flatten().tolist()) == expected, f"p={p}: kept {keep.tolist()}"


def test_top_p_mass_of_kept_set_reaches_p_and_no_smaller_set_does():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(64, 37, dtype=torch.float64) * 2, -1)
    for p in (0.1, 0.5, 0.9, 0.99):
        keep = top_p_keep(probs, p)
        mass = (probs * keep).sum(-1)
        assert bool((mass >= p - 1e-12).all()), f"p={p}: min kept mass {mass.min():.6f}"
        # Dropping the least probable kept token falls below p: the set is the smallest.
        least = probs.masked_fill(~keep, math.inf).min(-1).values
        assert bool((mass - least < p).all()), f"p={p}: a smaller set would do"


def test_top_p_with_equal_probabilities_takes_index_order():
    keep = top_p_keep(_probs(0.25, 0.25, 0.25, 0.25), 0.5)[0]
    assert keep.tolist() == [True, True, False, False]


def test_top_k_keeps_the_k_largest_and_ties_at_the_kth():
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, -2.0]])
    out = filter_logits(logits, top_k=2)
    assert torch.isfinite(out).tolist() == [[False, True, True, True, False]]
    out = filter_logits(logits, top_k=1)
    assert torch.isfinite(out).tolist() == [[False, True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=99)).all()


def test_temperature_divides_logits():
    logits = torch.tensor([[1.0, -2.0, 0.5]])
    assert torch.equal(filter_logits(logits, temperature=0.5), logits / 0.5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(top_k=0), "top_k must be a positive int"),
    (dict(top_k=2.5), "top_k must be a positive int"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
])  # fmt: skip
def test_filter_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        filter_logits(torch.zeros(1, 3), **kwargs)


def test_sampler_frequencies_match_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = probs.log().expand(4000, 4)  # log 0 = -inf: never drawn
    sampler = Sampler(4000, seed=123)
    draws = torch.cat([sampler(logits) for _ in range(5)])
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert freq[1] == 0, "a token of probability 0 was drawn"
    err = (freq - probs.double()).abs().max().item()
    # 20000 draws: the standard error of each frequency is <= 0.0035; 0.02 is ~6 sigma.
    assert err < 0.02, f"sampled frequencies {freq.tolist()} vs {probs.tolist()} (max err {err:.4f})"


def test_sampler_rows_depend_only_on_their_own_seed():
    torch.manual_seed(0)
    logits = torch.randn(3, 11)
    batch = torch.stack([Sampler(3, seed=7)(logits) for _ in range(1)])[0]
    alone = [Sampler(1, seed=7 + b)(logits[b : b + 1])[0] for b in range(3)]
    assert batch.tolist() == [int(t) for t in alone]
    listed = Sampler(3, seed=[7, 8, 9])(logits)
    assert listed.tolist() == batch.tolist()


def test_sampler_same_seed_same_draws_and_seed_none_follows_torch_seed():
    logits = torch.zeros(8, 50)
    a = [Sampler(8, seed=5)(logits) for _ in range(3)]
    b = [Sampler(8, seed=5)(logits) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    torch.manual_seed(1)
    c = Sampler(8)(logits)
    torch.manual_seed(1)
    d = Sampler(8)(logits)
    assert torch.equal(c, d)
    assert not torch.equal(Sampler(8, seed=5)(logits), Sampler(8, seed=6)(logits))


def test_sampler_top_k_1_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 30)
    assert torch.equal(Sampler(16, seed=0, top_k=1)(logits), logits.argmax(-1))


def test_sampler_seed_list_of_wrong_length():
    with pytest.raises(ValueError, match=r"seed must be an int or 3 ints \(one per row\)"):
        Sampler(3, seed=[1, 2])
