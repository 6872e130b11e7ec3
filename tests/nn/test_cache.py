"""KVCache / LayerKVCache: contents equal plain concatenation, growth, views, errors."""

from __future__ import annotations

import pytest
import torch

from qkv.nn import KVCache, LayerKVCache


def steps(sizes, B=2, Hkv=3, D=5, Dv=7, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, Hkv, n, D, generator=g, dtype=dtype),
         torch.randn(B, Hkv, n, Dv, generator=g, dtype=dtype))
        for n in sizes
    ]


@pytest.mark.parametrize("max_len", [None, 30, 23])
@pytest.mark.parametrize("sizes", [[1] * 20, [7, 1, 1, 9, 2, 3]], ids=["tokens", "chunks"])
def test_update_returns_everything_cached(max_len, sizes):
    cache = LayerKVCache(max_len=max_len)
    seen_k, seen_v = [], []
    for k, v in steps(sizes):
        seen_k.append(k)
        seen_v.append(v)
        k_all, v_all = cache.update(k, v)
        assert torch.equal(k_all, torch.cat(seen_k, 2)) and torch.equal(v_all, torch.cat(seen_v, 2))
        assert cache.length == k_all.shape[2]
    assert cache.length == sum(sizes)


def test_grow_and_preallocated_agree():
    grow, pre = LayerKVCache(), LayerKVCache(max_len=64)
    for k, v in steps([3, 1, 1, 20, 1, 30]):
        a, b = grow.update(k, v), pre.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_capacity_grows_geometrically():
    cache = LayerKVCache()
    capacities = []
    for k, v in steps([1] * 100):
        cache.update(k, v)
        if cache.capacity not in capacities:
            capacities.append(cache.capacity)
    assert capacities == [16, 32, 64, 128]  # 4 allocations for 100 tokens
    big = LayerKVCache()
    k, v = steps([40])[0]
    big.update(k, v)
    assert big.capacity == 40  # one chunk larger than the doubling: exactly what it needs


def test_preallocated_update_returns_views_without_copying_the_past():
    cache = LayerKVCache(max_len=10)
    ptrs = set()
    for k, v in steps([2, 1, 1, 1]):
        k_all, v_all = cache.update(k, v)
        ptrs.add((k_all.data_ptr(), v_all.data_ptr()))
        assert k_all._base is not None  # a view of the buffer
    assert len(ptrs) == 1 and cache.capacity == 10


def test_tracked_updates_keep_autograd_correct():
    """With requires_grad the cache concatenates, so backward through several steps works."""
    cache = LayerKVCache(max_len=8)
    ks = [k.requires_grad_() for k, _ in steps([2, 1, 1])]
    vs = [v.requires_grad_() for _, v in steps([2, 1, 1], seed=1)]
    total = 0
    for k, v in zip(ks, vs, strict=True):
        k_all, v_all = cache.update(k, v)
        total = total + k_all.sum() + 2 * v_all.sum()
    total.backward()
    # step 1's keys appear in 3 returned tensors, step 2's in 2, step 3's in 1.
    for k, v, n in zip(ks, vs, (3, 2, 1), strict=True):
        assert torch.equal(k.grad, torch.full_like(k, n))
        assert torch.equal(v.grad, torch.full_like(v, 2 * n))
    with torch.no_grad():  # back to untracked: still correct
        k, v = steps([1], seed=5)[0]
        k_all, _ = cache.update(k, v)
    assert torch.equal(k_all, torch.cat([*ks, k], 2)) and cache.length == 5


@pytest.mark.parametrize("max_len", [None, 12])
def test_reorder_selects_batch_rows(max_len):
    cache = KVCache(2, max_len=max_len)
    data = steps([3, 1], B=3)
    for k, v in data:
        for layer in cache:
            layer.update(k, v)
    sk, sv = steps([4], B=3, seed=9)[0]
    cache[1].set_static(sk, sv)
    idx = torch.tensor([2, 2, 0, 1])
    cache.reorder(idx)
    full_k = torch.cat([k for k, _ in data], 2)
    k_next, v_next = steps([1], B=4, seed=3)[0]
    for layer in cache:
        k_all, v_all = layer.update(k_next, v_next)
        assert torch.equal(k_all, torch.cat([full_k[idx], k_next], 2))
        assert torch.equal(v_all[:, :, -1:], v_next)
    assert torch.equal(cache[1].static[0], sk[idx]) and torch.equal(cache[1].static[1], sv[idx])
    assert cache[0].static is None
    if max_len is not None:
        assert cache[0].capacity == max_len
    cache.reorder([0, 1])  # a plain list works too
    assert cache[0].update(*steps([1], B=2)[0])[0].shape == (2, 3, 6, 5)


def test_crop_then_continue():
    cache = KVCache(3)
    data = steps([5, 1, 1])
    for k, v in data:
        for layer in cache:
            layer.update(k, v)
    assert cache.length == 7
    cache.crop(4)
    assert cache.length == 4 and all(layer.length == 4 for layer in cache)
    k, v = steps([2], seed=4)[0]
    k_all, v_all = cache[2].update(k, v)
    assert torch.equal(k_all, torch.cat([data[0][0][:, :, :4], k], 2))
    assert torch.equal(v_all, torch.cat([data[0][1][:, :, :4], v], 2))


def test_reset_forgets_everything():
    cache = KVCache(2, max_len=8)
    cache[0].update(*steps([3])[0])
    cache[0].set_static(*steps([2])[0])
    cache.reset()
    assert cache.length == 0 and cache[0].static is None and cache[0].capacity == 0
    k, v = steps([1], B=5)[0]  # a new batch size is fine after reset
    assert cache[0].update(k, v)[0].shape == (5, 3, 1, 5)


def test_repr_len_iter_and_negative_index():
    cache = KVCache(2)
    cache[-1].update(*steps([3])[0])
    assert len(cache) == 2 and list(cache) == cache.layers and cache[1].length == 3
    assert "num_layers=2" in repr(cache) and "length=3" in repr(cache[1])


def _bad_updates():
    k, v = steps([2])[0]
    return [
        ([1.0], v, TypeError, "k must be a torch.Tensor, got list"),
        (k[0], v, ValueError, r"k must be 4-D \(B, Hkv, T, D\), got shape \(3, 2, 5\)"),
        (k, v.long(), TypeError, "v must be floating point, got dtype torch.int64"),
        (k, v[:, :, :1], ValueError, r"k and v must agree on \(B, Hkv, T\)"),
        (k, v.double(), TypeError, "k and v must share dtype and device"),
        (k[:1], v[:1], ValueError, "batch size B changed between steps: cached 2"),
        (k[:, :2], v[:, :2], ValueError, "key/value heads Hkv changed between steps: cached 3"),
        (k[..., :4], v, ValueError, "head width changed between steps: cached D=5, Dv=7"),
        (k, v[..., :6], ValueError, "head width changed between steps"),
        (k.double(), v.double(), TypeError, "dtype/device changed between steps"),
        (*steps([9])[0], ValueError, r"4 cached \+ 9 new tokens = 13 exceeds max_len=12"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_update_errors(case):
    cache = LayerKVCache(max_len=12)
    cache.update(*steps([4])[0])
    k, v, error, match = _bad_updates()[case]
    with pytest.raises(error, match=match):
        cache.update(k, v)
    assert cache.length == 4  # a rejected update changes nothing


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: KVCache(0), ValueError, "num_layers must be a positive int, got 0"),
        (lambda: KVCache(2, max_len=0), ValueError, "max_len must be a positive int or None"),
        (lambda: LayerKVCache(max_len=2.5), ValueError, "max_len must be a positive int"),
        (lambda: KVCache(2)[2], IndexError, r"layer index must be an int in \[0, 2\), got 2"),
        (lambda: _filled().crop(5), ValueError, r"n must be an int in \[0, 4\], got 5"),
        (lambda: _filled().crop(-1), ValueError, r"n must be an int in \[0, 4\], got -1"),
        (lambda: _filled()[0].crop(1.0), ValueError, r"n must be an int in \[0, 4\]"),
        (lambda: _filled().reorder(torch.tensor([0, 2])), ValueError,
         r"indices must lie in \[0, 2\) .* got min 0 and max 2"),
        (lambda: _filled().reorder(torch.tensor([[0]])), ValueError,
         r"indices must be a 1-D integer tensor \(B',\)"),
        (lambda: _filled().reorder(torch.tensor([0.0])), ValueError, "dtype torch.float32"),
        (lambda: LayerKVCache().set_static(torch.randn(2, 3, 4), torch.randn(2, 3, 4)),
         ValueError, "set_static: k must be 4-D"),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _filled():
    cache = KVCache(2)
    for layer in cache:
        layer.update(*steps([4])[0])
    return cache


def test_failed_reorder_or_crop_changes_no_layer():
    cache = _filled()
    cache[1].update(*steps([1])[0])  # layer 1 is one token ahead (mid-step)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        cache.crop(5)
    assert [layer.length for layer in cache] == [4, 5]
    cache[1].reset()
    cache[1].update(*steps([4], B=3)[0])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        cache.reorder([2, 0])
    assert cache[0].update(*steps([1])[0])[0].shape[0] == 2
