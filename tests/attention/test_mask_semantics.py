"""Mask semantics defined once (qkv.attention.masks), validated once (make_call), used by all."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import qkv
from helpers import assert_close, backend_names
from qkv.attention import masks
from qkv.attention.call import AttentionCall, make_call
from qkv.attention.sdpa import run_call

BACKENDS = backend_names()  # "auto" and every registered backend


def test_qkv_masks_is_a_module():
    module = importlib.import_module("qkv.masks")
    import qkv.masks as again

    assert again is module
    for name in module.__all__:  # the user's names are the core's own objects
        if hasattr(masks, name):
            assert getattr(module, name) is getattr(masks, name), name
    assert torch.equal(module.causal(3), masks.causal(3))


@pytest.mark.parametrize(
    ("shape", "full", "expected"),
    [
        ((4, 6), (2, 3, 4, 6), (1, 1, 4, 6)),
        ((2, 1, 1, 6), (2, 3, 4, 6), (2, 1, 1, 6)),
        ((3, 4, 6), (2, 3, 4, 6), (1, 3, 4, 6)),
        ((5, 1, 3, 1, 6), (5, 2, 3, 4, 6), (10, 3, 1, 6)),
        ((1, 1, 1, 4, 6), (5, 2, 3, 4, 6), (1, 1, 4, 6)),
        ((6,), (2, 3, 4, 6), (1, 1, 1, 6)),
    ],
)
def test_check_attn_mask_returns_the_4d_layout(shape, full, expected):
    m = torch.randn(shape)
    out = masks.check_attn_mask(m, full, dtype=torch.float64)
    assert out.shape == expected and out.dtype == torch.float64
    dense = out.expand(math.prod(full[:-3]), *full[-3:])  # (B, H, T, S)
    assert torch.equal(dense, m.double().expand(full).reshape(dense.shape))  # (B, H, T, S)


def test_check_attn_mask_refusals():
    full = (2, 3, 4, 6)
    cases = [
        (torch.full((4, 6), float("nan")), ValueError, r"attn_mask contains NaN"),
        (torch.full((4, 6), float("inf")), ValueError, r"attn_mask contains \+inf"),
        (torch.ones(4, 5, dtype=torch.bool), ValueError, r"does not broadcast"),
        (torch.ones(4, 6, dtype=torch.int8), TypeError, r"must be boolean .* got dtype torch.int8"),
        ("mask", TypeError, r"must be a torch.Tensor or None"),
    ]
    for mask, kind, message in cases:
        for catch in (kind, RuntimeError):
            with pytest.raises(catch, match=message):
                masks.check_attn_mask(mask, full)
    with pytest.raises(ValueError, match=r"key_padding_mask is on meta but query is on cpu"):
        masks.check_attn_mask(
            torch.ones(4, 6, device="meta"), full, name="key_padding_mask", device=torch.device("cpu")
        )


def _call(mask_kind: str, need_weights=False, T=13, S=21, H=4, Hkv=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, T, 8, generator=g, dtype=dtype)
    k = torch.randn(2, Hkv, S, 8, generator=g, dtype=dtype)
    v = torch.randn(2, Hkv, S, 5, generator=g, dtype=dtype)
    mask = None
    if mask_kind in ("bool", "float"):
        mask = torch.rand(2, 1, T, S, generator=g) > 0.3
        if mask_kind == "float":
            mask = torch.randn(H, T, S, generator=g, dtype=dtype).masked_fill(mask[0], 0.0)
    kwargs = {"is_causal": "bottom-right", "window": 6, "alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05])}
    return q, k, v, mask, kwargs


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_run_call_on_a_record_built_directly(backend, mask_kind, need_weights):
    """The lead's path: already 4-D inputs, a mask from check_attn_mask, a record built by
    hand; run_call gives what scaled_dot_product_attention gives, in the 4-D layout."""
    if backend == "torch" and need_weights:
        pytest.skip("torch's kernel returns no weights (test_errors)")
    q, k, v, mask, kw = _call(mask_kind, need_weights)
    B, H, T, _ = q.shape
    S = k.shape[2]
    call = AttentionCall(
        query=q, key=k, value=v,
        mask=None if mask is None else masks.check_attn_mask(mask, (B, H, T, S), dtype=q.dtype),
        causal=S - T, window=kw["window"], alibi=kw["alibi_slopes"], scale=1 / math.sqrt(8),
        dropout_p=0.0, need_weights=need_weights, batch_shape=(B,),
    )
    out, w = run_call(call, backend)
    want = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True, need_weights=need_weights, backend="math", **kw
    )
    want_out, want_w = want if need_weights else (want, None)
    assert out.shape == (B, H, T, 5)
    assert_close(out, want_out, atol=1e-10, name=f"run_call output [{backend}, {mask_kind}]")
    if need_weights:
        assert_close(w, want_w, atol=1e-12, name=f"run_call weights [{backend}, {mask_kind}]")
    else:
        assert w is None


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_tiles_of_apply_mask_equal_dense_mask(mask_kind):
    """Every tile (and head selection) of apply_mask is the same slice of dense_mask."""
    q, k, v, mask, kw = _call(mask_kind)
    call = make_call(q, k, v, mask, 0.0, kw["is_causal"], None, True, False, kw["window"],
                     kw["alibi_slopes"])
    dense = masks.dense_mask(call)  # (B|1, H|1, T, S)
    full = torch.zeros(2, 4, call.T, call.S, dtype=torch.float64)
    whole = (full.masked_fill(~dense, float("-inf")) if dense.dtype == torch.bool else full + dense)
    heads = torch.tensor([3, 1])
    for rows in (slice(0, 5), slice(5, 13)):
        for cols in (slice(0, 7), slice(7, 21)):
            tile = torch.zeros(2, 2, rows.stop - rows.start, cols.stop - cols.start, dtype=torch.float64)
            got = masks.apply_mask(tile, call, rows, cols, heads)
            want = whole[:, heads, rows, cols]
            assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"hidden keys {rows} {cols}"
            fin = torch.isfinite(want)
            assert_close(got[fin], want[fin], atol=1e-12, name=f"tile {rows} {cols}")


def test_dead_row_helpers():
    keep = torch.tensor([[True, False], [False, False]])
    assert masks.dead_rows(keep).tolist() == [[False], [True]]
    assert masks.dead_rows(masks.to_additive(keep)).tolist() == [[False], [True]]
    m = masks.safe_row_max(torch.tensor([[1.0], [float("-inf")]]))
    assert m.tolist() == [[1.0], [0.0]]
    assert masks.safe_total(torch.tensor([0.0, 2.0])).tolist() == [1.0, 2.0]
    assert masks.safe_lse(torch.tensor([float("-inf"), 1.0])).tolist() == [float("inf"), 1.0]


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_is_validated_once_per_call(monkeypatch, backend, need_weights):
    """Validation (and its host syncs) happens in make_call only, never again below it."""
    if backend == "torch" and need_weights:
        pytest.skip("torch's kernel returns no weights")
    from qkv.attention import call as call_module

    seen = []
    real = call_module.check_attn_mask

    def counting(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(call_module, "check_attn_mask", counting)
    monkeypatch.setattr(masks, "check_attn_mask", counting)
    q, k, v, mask, _ = _call("float")
    qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, backend=backend,
                                     need_weights=need_weights)
    assert len(seen) == 1, f"attn_mask validated {len(seen)} times [{backend}]"
