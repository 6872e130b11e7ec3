"""Launch plans kept for a call's shapes (:mod:`qkv.attention.triton.plan`): calls that share
shapes but differ in what the plan does not hold (causal offset, window, scale, ALiBi slopes,
mask values) each get their own right answer, and what decides a plan (the mask's kind, the
causal flag, the tile function a sweep puts in) makes a new one.

Run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, tests/conftest.py), against
the math backend in float64; under ``QKV_TEST_DEVICE=cuda`` on the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from helpers import DEVICE, assert_close
from qkv.attention import triton as triton_env
from qkv.attention.triton import launch as triton_launch
from qkv.attention.triton import plan as triton_plan

pytestmark = pytest.mark.skipif(
    not triton_env.installed(), reason="the triton package is not installed"
)


def _qkv(B=1, H=4, Hkv=2, T=5, S=70, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE, torch.float32)
                 for s in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D)))


def _check(q, k, v, name, **kw):
    out = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="triton", **kw)
    ref = qkv.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                           enable_gqa=True, backend="math", **kw)
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name=name)


def test_calls_of_one_shape_that_differ_outside_the_plan_each_get_their_answer():
    """One shape, one kept plan per set of flags; the causal offset, window width, scale,
    slopes and mask values travel with each call."""
    q, k, v = _qkv()
    T, S = q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(3)
    slopes = [torch.rand(4, generator=g).to(DEVICE) for _ in range(2)]
    bools = [torch.rand(1, 1, T, S, generator=g).to(DEVICE) > p for p in (0.3, 0.7)]
    calls = [
        ("plain", {}),
        ("scale 0.5", {"scale": 0.5}),
        ("top-left causal", {"is_causal": True}),
        ("bottom-right causal", {"is_causal": "bottom-right"}),
        ("window 9", {"is_causal": "bottom-right", "window": 9}),
        ("window 30", {"is_causal": "bottom-right", "window": 30}),
        ("alibi a", {"alibi_slopes": slopes[0]}),
        ("alibi b", {"alibi_slopes": slopes[1]}),
        ("bool mask a", {"attn_mask": bools[0]}),
        ("bool mask b", {"attn_mask": bools[1]}),
        ("float mask", {"attn_mask": torch.randn(1, 1, T, S, generator=g).to(DEVICE)}),
    ]
    for _ in range(2):  # the second round runs on the kept plans
        for name, kw in calls:
            _check(q, k, v, name, **kw)


def test_a_plan_is_kept_per_shape_and_made_anew_for_other_flags_or_tiles(monkeypatch):
    """The same call twice takes one plan; a causal call, a longer key sequence, or another
    tile function (as the tile sweep puts in) each take their own."""
    monkeypatch.setattr(triton_plan, "_PLANS", {})
    q, k, v = _qkv()
    grids = []

    def run(q, k, v, **kw):
        qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="triton", **kw)
        return len(triton_plan._PLANS)

    assert run(q, k, v) == 1
    assert run(q, k, v) == 1, "the same shapes and flags must reuse their plan"
    assert run(q, k, v, is_causal=True) == 2
    k2, v2 = (torch.cat([t, t], dim=2) for t in (k, v))
    assert run(q, k2, v2) == 3
    chosen = triton_plan.tiles

    def forced(kind, rows, width, dtype, *rest):
        return triton_plan.Tiles(16, 32, 1, 1) if kind == "forward" else chosen(
            kind, rows, width, dtype, *rest)

    launch = triton_launch._launch

    def record(kernel, grid, args, options):
        grids.append((kernel.__name__, grid, options.get("BLOCK_N")))
        launch(kernel, grid, args, options)

    monkeypatch.setattr(triton_launch, "_launch", record)
    run(q, k, v)
    monkeypatch.setattr(triton_plan, "tiles", forced)
    assert run(q, k, v) == 4, "another tile function must make another plan"
    forward = [g for g in grids if g[0] == "attention_forward"]
    assert [g[2] for g in forward] == [16, 32], forward
    _check(q, k, v, "forced 16x32 tiles")


def test_the_splits_scratch_is_one_buffer_of_aligned_views():
    """Key splits write float32 partials into views of one allocation, each 16-byte aligned
    (Triton specialises a pointer on it): Dv and row counts that are not multiples of 4."""
    q = torch.empty(1, 3, 1, 5, device=DEVICE)
    for n, rows, Dv in ((3, (1, 3, 1), 5), (7, (2, 3, 1), 7), (1, (1, 3, 1), 5)):
        o, lse = triton_launch._split_outputs(n, rows, Dv, q)
        assert o.shape == (n, *rows, Dv) and lse.shape == (n, *rows)
        assert o.is_contiguous() and lse.is_contiguous()
        assert o.data_ptr() % 16 == 0 and lse.data_ptr() % 16 == 0, (n, rows, Dv)
        if n > 1:
            assert o.untyped_storage().data_ptr() == lse.untyped_storage().data_ptr()
            end = o.data_ptr() + o.numel() * o.element_size()
            assert lse.data_ptr() >= end, "the lse must not overlap the partial outputs"


def test_loop_bodies_are_read_off_a_sass_listing():
    """:func:`qkv.bench.triton_static.loop_bodies`, which the static report's loop column
    and docs/gpu.md's instruction counts come from: a branch back to an earlier address is a
    loop, its body the instructions from the target to the branch; local loads and stores
    (spilled registers) are counted in it; a forward branch is no loop."""
    from qkv.bench.triton_static import loop_bodies

    def line(at, text):
        return f"        /*{at:04x}*/                   {text} ;          /* 0x000fe20000000800 */"
    sass = "\n".join([
        line(0x00, "ULDC UR4, c[0x0][0x28]"),
        line(0x10, "@P0 BRA 0x90"),  # forward: no loop
        line(0x20, "LDL.64 R2, [R1+0x8]"),  # the outer loop starts here
        line(0x30, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        line(0x40, "STL [R1+0x10], R5"),
        line(0x50, "FMUL R6, R6, R7"),  # the inner loop: 0x50..0x60
        line(0x60, "@P1 BRA 0x50"),
        line(0x70, "@P2 BRA 0x20"),
        line(0x80, "EXIT"),
        line(0x90, "BRA 0x90"),  # a branch to itself: a one-instruction loop is not "earlier"
    ])
    assert loop_bodies(sass) == ((6, 2), (2, 0))
