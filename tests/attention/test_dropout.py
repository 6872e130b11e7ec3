"""Attention dropout's two sources (qkv.attention.dropout): torch's draw on the CPU, the
counter-based Philox mask elsewhere.

The Philox4x32-10 words are held to Random123's published known-answer vectors (Salmon et al.,
kat_vectors), so the torch implementation is checked against the generator's definition, not
against Triton's copy of it; the triton tests (test_triton.py) then hold the kernels' tiles to
this implementation bit for bit. The counter-based mask is then tested for what a dropout mask
must be: the rate, independence from the seed's other draws, reproducibility from
``torch.manual_seed``, and the same weights on the math and flash backends.
"""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from helpers import assert_close
from qkv.attention import dropout

# Random123 kat_vectors, philox4x32 10 rounds: counter (4 words), key (2 words), output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KAT, ids=["zeros", "ones", "pi"])
def test_philox_words_equal_random123_known_answers(counter, key, expected):
    words = dropout.philox4x32(tuple(torch.tensor(k) for k in key),
                               tuple(torch.tensor(c) for c in counter))
    got = tuple(int(w) for w in words)
    assert got == expected, f"philox4x32-10 {[hex(w) for w in got]} != {[hex(w) for w in expected]}"


def _state(seed: int, p: float) -> torch.Tensor:
    return torch.tensor([seed, round(p * 2**16)])


def test_the_mask_is_the_definition_entry_by_entry_and_chunking_changes_nothing(monkeypatch):
    """Weight (b, h, i, j): Philox at counter (j // 8, i, b·H + h, 0), key j's 16 bits the
    half j % 2 of word (j // 2) % 4, kept when they reach round(p · 2¹⁶)."""
    B, H, T, S = 2, 3, 5, 21  # S not a multiple of 8: the last group is cut
    state = _state(0x123456789ABCDEF, 0.4)
    keep = dropout.philox_keep(state, B, H, T, S)
    seed = int(state[0])
    key = (torch.tensor(seed & 0xFFFFFFFF), torch.tensor(seed >> 32))
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 20), (0, 1, 3, 9), (1, 0, 2, 7), (0, 2, 1, 14)]:
        words = dropout.philox4x32(key, tuple(torch.tensor(c) for c in (j // 8, i, b * H + h, 0)))
        bits = (int(words[(j // 2) % 4]) >> (16 * (j % 2))) & 0xFFFF
        assert bool(keep[b, h, i, j]) == (bits >= int(state[1])), (b, h, i, j)
    monkeypatch.setattr(dropout, "_CHUNK", 3)  # one row a chunk
    assert torch.equal(dropout.philox_keep(state, B, H, T, S), keep)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_counter_based_mask_drops_at_the_rate_asked(p):
    B, H, T, S = 2, 4, 64, 128
    n = B * H * T * S
    keep = dropout.philox_keep(_state(2024, p), B, H, T, S)
    kept = float(keep.float().mean())
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 6 * sigma, f"kept {kept:.5f}, expected {1 - p} ± {6 * sigma:.5f}"
    # Neighbours along each axis are as often equal as independent draws would be.
    agree = 1 - 2 * p * (1 - p)
    for dim in range(4):
        a, b = keep.narrow(dim, 0, keep.shape[dim] - 1), keep.narrow(dim, 1, keep.shape[dim] - 1)
        same = float((a == b).float().mean())
        sd = math.sqrt(agree * (1 - agree) / a.numel())
        assert abs(same - agree) < 8 * sd, f"p={p} axis {dim}: neighbours agree {same:.4f}, {agree:.4f} expected"


def test_seeds_give_different_masks_and_the_generator_reproduces_them():
    torch.manual_seed(3)
    a = dropout.dropout_state(0.3, torch.device("cpu"))
    b = dropout.dropout_state(0.3, torch.device("cpu"))
    torch.manual_seed(3)
    again = dropout.dropout_state(0.3, torch.device("cpu"))
    assert torch.equal(a, again) and not torch.equal(a[:1], b[:1])
    assert 0 <= int(a[0]) < 2**62 and int(a[1]) == round(0.3 * 2**16)
    ka, kb = (dropout.philox_keep(s, 1, 2, 16, 16) for s in (a, b))
    assert not torch.equal(ka, kb)


def test_the_rule_counter_based_off_the_cpu_only():
    assert not dropout.counter_based(torch.device("cpu"))
    assert dropout.counter_based(torch.device("cuda"))
    assert dropout.counter_based(torch.device("meta"))


@pytest.fixture
def counter_on_cpu(monkeypatch):
    """The GPU rule on this machine: CPU calls take the counter-based mask."""
    monkeypatch.setattr(dropout, "counter_based", lambda device: True)


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_counter_based_dropout_is_the_definition_on_math_and_flash(backend, counter_on_cpu):
    """out = (softmax(s) ∘ keep / (1 - p)) · V with keep the philox mask of the state the call
    drew: the mask is rebuilt from the same seed and the output recomputed in float64."""
    B, H, T, S, D = 2, 3, 11, 13, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (T, S, S))
    p = 0.35
    torch.manual_seed(11)
    out = qkv.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, backend=backend)
    torch.manual_seed(11)
    keep = dropout.philox_keep(dropout.dropout_state(p, q.device), B, H, T, S)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(), float("-inf"))
    applied = scores.softmax(-1) * keep / (1 - p)
    assert_close(out, applied @ v, atol=1e-12, name=f"{backend} out vs the philox definition")


def test_counter_based_weights_are_the_ones_applied(counter_on_cpu):
    q = k = v = torch.randn(1, 2, 9, 8, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(4)
    out, w = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5, need_weights=True,
                                              backend="math")
    assert_close(out, w @ v, atol=1e-6, name="out vs the weights returned, after dropout")
    torch.manual_seed(4)
    keep = dropout.philox_keep(dropout.dropout_state(0.5, q.device), 1, 2, 9, 9)
    assert torch.equal(w != 0, keep), "the weights returned are zero exactly where dropped"


def test_counter_based_dropout_equal_on_math_and_flash_with_gradients(counter_on_cpu):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, n, 16, generator=g).requires_grad_() for n in (37, 45, 45))
    results = {}
    for backend in ("math", "flash"):
        torch.manual_seed(5)
        out = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.2, backend=backend)
        results[backend] = (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))
    for name, a, e in zip(("out", "dq", "dk", "dv"), *results.values(), strict=True):
        assert_close(a, e, atol=1e-5, rtol=1e-5, name=f"counter-based dropout {name}")


def test_a_counter_based_mask_too_large_is_refused_before_it_is_drawn(counter_on_cpu,
                                                                       monkeypatch):
    monkeypatch.setattr(dropout, "_memory_bytes", lambda: 2 << 30)
    q = k = v = torch.zeros(1, 4, 16384, 8, device="cpu")  # (the limit stood in is the CPU's)
    with pytest.raises(qkv.attention.AttentionArgumentError,
                       match=r"dropout_p=0.1 draws the counter-based keep mask of \(B, H, T, "
                             r"S\) = \(1, 4, 16384, 16384\), 1.2 GiB .* more than the 1.0 GiB"):
        qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.1, backend="flash")


def test_counter_based_dropout_compiles_whole_and_equals_eager(counter_on_cpu):
    """A training step compiled with fullgraph=True on a GPU takes the counter-based mask on
    the math backend: its ops trace without a graph break, and with inductor drawing random
    numbers as eager does (fallback_random), the compiled mask is the eager one."""
    import torch._inductor.config as inductor_config

    q, k, v = (torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n))
               for n in (24, 20, 20))

    def step(q, k, v):
        return qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.3, backend="math")

    torch.manual_seed(0)
    eager = step(q, k, v)
    with inductor_config.patch(fallback_random=True):  # (torch's own way: restored after)
        torch.manual_seed(0)
        compiled = torch.compile(step, fullgraph=True)(q, k, v)
    assert_close(compiled, eager, atol=1e-5, name="compiled counter-based dropout vs eager")
