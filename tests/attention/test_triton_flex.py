"""Block-sparse ``qkv.flex_attention`` on Triton (``kernel_options={"backend": "triton"}``)
against the tile loop (``"tiles"``) and the math backend in float64.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py); the shapes are small and the block sizes 16 and 32, so every case crosses
empty, partial and full tiles. Tolerances as in test_triton.py: float32 within 1e-5 of the
float64 truth; half precision within twice the tile loop's own error plus one rounding.
"""

from __future__ import annotations

import os

import pytest
import torch

import qkv
from helpers import (
    DEVICE,
    assert_close,
    assert_lse_and_grads_close,
    max_error,
    run_compile_check,
)
from qkv.attention import triton as triton_env
from qkv.attention.errors import AttentionArgumentError
from qkv.attention.flex import flex_path
from qkv.attention.flex import triton_path as flex_triton
from qkv.attention.flex.blocks import and_masks, create_block_mask
from qkv.attention.mods import causal_mask, document_mask, prefix_lm, sliding_window_mask
from qkv.attention.score_mods import alibi, relative_bias, soft_cap

pytestmark = pytest.mark.skipif(not triton_env.installed(), reason="triton is not installed")

TRITON = {"backend": "triton"}


def _docs(T: int) -> torch.Tensor:
    ids = torch.zeros(T, dtype=torch.long, device="cpu")
    for cut in (T // 5, T // 2, T - 3):
        ids[cut:] += 1
    return ids.to(DEVICE)


def _mask(kind: str, B: int, H: int, T: int, S: int):
    """``(mask_mod, B or None, H or None)`` of each kind (None: shared by every row/head)."""
    if kind == "causal":
        return causal_mask, None, None
    if kind == "window":
        return sliding_window_mask(9, offset=S - T), None, None
    if kind == "document":
        ids = _docs(max(T, S))
        return and_masks(document_mask(ids), causal_mask), None, None
    if kind == "prefix-lm per row":
        return prefix_lm(torch.tensor([5, 20], device=DEVICE)[:B]), B, None
    if kind == "per head":  # head h sees keys j with (i - j) % (h + 2) == 0, and j <= i
        def every_other(b, h, q_idx, kv_idx):
            return ((q_idx - kv_idx) % (h + 2) == 0) & (kv_idx <= q_idx)
        return every_other, None, H
    if kind == "dead rows":  # queries below 7 see nothing
        def late(b, h, q_idx, kv_idx):
            return (q_idx >= 7) & (kv_idx <= q_idx)
        return late, None, None
    raise AssertionError(kind)


KINDS = ["causal", "window", "document", "prefix-lm per row", "per head", "dead rows"]
# B, H, Hkv, T, S, D, Dv, (bq, bk). The last: T and S whole blocks (T != S), where the
# kernels read and score with no edge masks (``EVEN``); the others end inside a block.
SHAPES = [(2, 2, 2, 45, 45, 16, 16, (16, 16)), (2, 4, 2, 50, 50, 24, 16, (32, 16)),
          (1, 3, 1, 37, 70, 32, 32, (16, 32)), (2, 4, 2, 64, 48, 16, 16, (32, 16))]
WHOLE = SHAPES[3]


def _inputs(shape, dtype=torch.float32, seed=0):
    B, H, Hkv, T, S, D, Dv, _ = shape
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64, device="cpu").to(DEVICE, dtype)
            for s in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv))]


def _block_mask(kind, shape):
    B, H, _, T, S, _, _, block = shape
    mod, b, h = _mask(kind, B, H, T, S)
    return create_block_mask(mod, b, h, T, S, device=DEVICE, BLOCK_SIZE=block)


def _flex(q, k, v, bm, backend, **kw):
    return qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True,
                              kernel_options={"backend": backend}, **kw)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_lse_and_gradients_equal_float64(kind, shape):
    bm = _block_mask(kind, shape)
    q, k, v = (t.requires_grad_() for t in _inputs(shape))
    out, lse = _flex(q, k, v, bm, "triton")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _flex(q64, k64, v64, bm, "tiles")
    assert_lse_and_grads_close((out, lse), (ref, ref_lse), (q, k, v), (q64, k64, v64), kind)


def _ready_mod(mod: str, H: int, T: int, S: int):
    if mod == "alibi":
        return alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE), offset=S - T)
    if mod == "softcap":
        return soft_cap(2.0)
    g = torch.Generator().manual_seed(3)  # T5's table: 8 buckets, distances up to 20
    table = torch.randn(8, H, generator=g, dtype=torch.float64).to(DEVICE, torch.float32)
    return relative_bias(table, 8, 20, bidirectional=mod == "relative")


# Alone (no block mask) every tile is full and none is skipped: the interpreter's slowest
# case (12 s a call), run in blocks that end past the sequences, where the edge masks meet
# the mod; whole blocks are run with the two block masks.
_MOD_CASES = [(kind, shape) for kind in ("document", "per head") for shape in ("edges", "whole")]
_MOD_CASES.append(("no block mask", "edges"))


@pytest.mark.parametrize(("kind", "shape"), _MOD_CASES, ids=[f"{k}-{s}" for k, s in _MOD_CASES])
@pytest.mark.parametrize("mod", ["alibi", "softcap", "relative", "relative causal"])
def test_ready_score_mods_run_in_the_kernel_and_equal_float64(mod, kind, shape):
    """With a block mask, or alone (every tile full, no mask read); in blocks that end past
    the sequences, and in whole ones."""
    shape = {"edges": SHAPES[1], "whole": WHOLE}[shape]
    H, T, S = shape[1], shape[3], shape[4]
    bm = None if kind == "no block mask" else _block_mask(kind, shape)
    score_mod = _ready_mod(mod, H, T, S)
    q, k, v = (t.requires_grad_() for t in _inputs(shape))
    assert flex_path(q, v, score_mod, bm, TRITON)[0] == "triton"
    out, _ = _flex(q, k, v, bm, "triton", score_mod=score_mod)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = _flex(q64, k64, v64, bm, "tiles", score_mod=score_mod)
    assert_close(out, ref, atol=2e-5, rtol=2e-5, name=f"out {mod} {kind}")
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), g.float())
    refs = torch.autograd.grad(ref, (q64, k64, v64), g)
    for name, a, e in zip("qkv", grads, refs, strict=True):
        assert_close(a, e, atol=3e-5, rtol=3e-5, name=f"d{name} {mod} {kind}")
    assert H == 4


def test_equals_sdpa_with_the_same_dense_mask():
    """The document mask through flex equals qkv's SDPA (math, float64) given it densely."""
    shape = SHAPES[1]
    T, S = shape[3:5]
    bm = _block_mask("document", shape)
    q, k, v = _inputs(shape)
    out, _ = _flex(q, k, v, bm, "triton")
    ids = _docs(T)
    i, j = torch.arange(T, device=DEVICE)[:, None], torch.arange(S, device=DEVICE)[None, :]
    dense = (ids[:, None] == ids[None, :]) & (j <= i)
    ref = qkv.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=dense,
                                           enable_gqa=True, backend="math")
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name="document flex vs dense SDPA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_the_tile_loops_error(dtype):
    shape = SHAPES[0]
    bm = _block_mask("document", shape)
    q, k, v = _inputs(shape, dtype)
    out, _ = _flex(q, k, v, bm, "triton")
    exact, _ = _flex(q.double(), k.double(), v.double(), bm, "tiles")
    tiles, _ = _flex(q, k, v, bm, "tiles")
    bound = 2 * max_error(tiles, exact) + torch.finfo(dtype).eps * float(exact.abs().max())
    assert max_error(out, exact) <= bound, f"{dtype}: {max_error(out, exact):.3e} > {bound:.3e}"


def test_weights_and_non_finite_rows():
    shape = SHAPES[0]
    bm = _block_mask("dead rows", shape)
    q, k, v = _inputs(shape)
    q[0, 1, 20, 3] = float("nan")
    out, lse, w = _flex(q, k, v, bm, "triton", need_weights=True)
    assert out[0, 1, 20].isnan().all() and w[0, 1, 20].isnan().any()
    ref, _, w_ref = _flex(q, k, v, bm, "tiles", need_weights=True)
    ok = torch.ones(out.shape[:3], dtype=torch.bool, device=out.device)
    ok[0, 1, 20] = False
    assert_close(out[ok], ref[ok], atol=1e-5, rtol=1e-5, name="finite rows")
    assert_close(w[ok], w_ref[ok], atol=1e-6, name="weights")
    assert (out[:, :, :7] == 0).all() and torch.isneginf(lse[:, :, :7]).all()


def test_tables_are_built_once_per_block_mask_and_device():
    bm = _block_mask("document", SHAPES[0])
    first = flex_triton.tables(bm, torch.device(DEVICE))
    assert flex_triton.tables(bm, torch.device(DEVICE)) is first
    visited = (bm.state > 0).sum().item()
    assert int(first.kv_count.sum()) == visited == int(first.q_count.sum())
    assert first.keep.shape[0] == int((bm.state == 1).sum())


def test_path_says_which_kernel_runs_and_why(monkeypatch):
    shape = SHAPES[0]
    bm = _block_mask("causal", shape)
    q, k, v = _inputs(shape)
    def bias(s, b, h, i, j):
        return s + 0.1
    assert flex_path(q, v, bias, bm, TRITON)[1].startswith("a Python score_mod cannot run")
    assert flex_path(q, v, bias, None, TRITON)[1].startswith("a Python score_mod cannot run")
    assert flex_path(q, v, soft_cap(20.0), None, TRITON)[0] == "triton"
    table = torch.zeros(32, 2, device=DEVICE)
    assert flex_path(q, v, relative_bias(table, 32, 64), bm, TRITON)[0] == "triton"
    learned_table = table.clone().requires_grad_()
    assert flex_path(q, v, relative_bias(learned_table, 32, 64), bm, TRITON)[0] == "triton"
    learned = torch.tensor([0.5, 0.25], device=DEVICE, requires_grad=True)
    assert flex_path(q, v, alibi(learned), bm, TRITON)[0] == "triton"
    assert flex_path(q, v, None, None, TRITON)[0] == "tiles"
    assert flex_path(q, v, None, bm, {"backend": "tiles"})[0] == "tiles"
    assert flex_path(q, v, None, bm, TRITON)[0] == "triton"
    assert flex_path(q.double(), v.double(), None, bm, TRITON)[1].endswith("not torch.float64")
    with pytest.raises(AttentionArgumentError, match="cannot serve this call: a Python score_mod"):
        qkv.flex_attention(q, k, v, bias, bm, kernel_options=TRITON)
    with pytest.raises(AttentionArgumentError, match="kernel_options backend must be one of"):
        qkv.flex_attention(q, k, v, block_mask=bm, kernel_options={"backend": "cuda"})
    with pytest.raises(AttentionArgumentError, match="kernel_options must be None or"):
        qkv.flex_attention(q, k, v, block_mask=bm, kernel_options={"BLOCK_M": 64})
    if DEVICE.type == "cpu":  # auto keeps the tile loop on the CPU; the interpreter is for tests
        assert flex_path(q, v, None, bm)[1] == "Triton runs on CUDA tensors"


@pytest.mark.skipif(bool(os.environ.get("ATEN_CPU_CAPABILITY")),
                    reason="compiling does not depend on the CPU's kernels: the first pass did it")
def test_flex_kernels_compile_for_hopper_without_a_gpu():
    """Forward, δ, dQ and dK/dV for six masks and mods and a document mask with dropout (its
    Philox mask computed in the kernels), compiled as launched on Hopper: loads pipelined, at
    most 256 bytes a thread spilled."""
    out = run_compile_check("--flex")
    assert out.count("ok sm_90 flex") == 28 and out.count("flex row_deltas") == 7 and "flex_backward_dkdv document dropout" in out, out


@pytest.mark.parametrize("mod", ["alibi", "relative"])
def test_a_mod_for_other_heads_is_refused_on_the_kernel_path_as_on_the_tile_loop(mod):
    """A table or slopes for 4 heads on an attention of 2: the same error on both paths (the
    kernel would read past the data)."""
    shape = SHAPES[0]  # H = 2
    bm = _block_mask("causal", shape)
    q, k, v = _inputs(shape)
    score_mod = _ready_mod(mod, 4, shape[3], shape[4])
    for backend in ("triton", "tiles"):
        with pytest.raises(AttentionArgumentError, match="has 4 heads but the attention has H=2"):
            _flex(q, k, v, bm, backend, score_mod=score_mod)


@pytest.mark.parametrize("shape", [SHAPES[1], WHOLE], ids=["edges", "whole"])
@pytest.mark.parametrize("mod", ["alibi", "relative", "relative causal"])
@pytest.mark.parametrize("kind", ["document", "per head"])
def test_learned_slopes_and_tables_get_the_tile_loops_gradient(mod, kind, shape):
    """Learned ALiBi slopes and a learned T5 table run in the kernel; their gradients (from
    the dQ kernel's atomic adds) equal the tile loop's in float64, as do q, k and v's."""
    H, T, S = shape[1], shape[3], shape[4]
    bm = _block_mask(kind, shape)
    values = _ready_mod(mod, H, T, S).kernel_params[1]

    def run(dtype, backend):
        learned = values.detach().to(dtype).requires_grad_()
        score_mod = (alibi(learned, offset=S - T) if mod == "alibi" else
                     relative_bias(learned, 8, 20, bidirectional=mod == "relative"))
        ins = [t.to(dtype).requires_grad_() for t in _inputs(shape)]
        out, _ = _flex(*ins, bm, backend, score_mod=score_mod)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5),
                        dtype=torch.float64).to(out)
        return torch.autograd.grad(out, [*ins, learned], g)
    got, want = run(torch.float32, "triton"), run(torch.float64, "tiles")
    for name, a, e in zip(["dq", "dk", "dv", f"d {mod}"], got, want, strict=True):
        assert_close(a, e, atol=5e-5, rtol=5e-5, name=f"{name} {kind}")


@pytest.mark.parametrize("bidirectional", [True, False])
def test_learned_relative_bias_with_t_unequal_s_and_odd_heads(bidirectional):
    """T = 37 queries over S = 70 keys, 3 query heads over 1 key/value head, 16×32 blocks:
    the kernel's bias index ``j - i + T - 1`` and its gradient's, against the tile loop in
    float64."""
    shape = SHAPES[2]
    H, T, S = shape[1], shape[3], shape[4]
    bm = _block_mask("window", shape)
    table = _ready_mod("relative" if bidirectional else "relative causal", H, T, S
                       ).kernel_params[1]

    def run(dtype, backend):
        learned = table.detach().to(dtype).requires_grad_()
        score_mod = relative_bias(learned, 8, 20, bidirectional=bidirectional)
        ins = [t.to(dtype).requires_grad_() for t in _inputs(shape)]
        out, _ = _flex(*ins, bm, backend, score_mod=score_mod)
        return (out, *torch.autograd.grad(out, [*ins, learned], torch.ones_like(out)))
    got, want = run(torch.float32, "triton"), run(torch.float64, "tiles")
    for name, a, e in zip(["out", "dq", "dk", "dv", "d table"], got, want, strict=True):
        assert_close(a, e, atol=5e-5, rtol=5e-5, name=f"{name} T={T} S={S}")


@pytest.fixture
def counter_on_cpu(monkeypatch):
    """Dropout as on a GPU, on this machine too: the counter-based mask (qkv.attention.dropout),
    which the flex kernels compute themselves and the dense definition draws."""
    from qkv.attention import dropout

    monkeypatch.setattr(dropout, "counter_based", lambda device: True)


@pytest.mark.parametrize("kind, mod, shape", [
    ("document", None, SHAPES[1]), ("per head", "alibi", SHAPES[1]),
    ("dead rows", "softcap", SHAPES[1]), ("document", "softcap", SHAPES[1]),
    ("document", None, WHOLE)], ids=str)
def test_dropout_in_the_flex_kernels_equals_the_dense_definition(kind, mod, shape,
                                                                 counter_on_cpu):
    """Block-sparse flex with dropout (what a qkv.nn module with a block mask trains with on a
    GPU): the kernels' output and gradients equal the dense definition's (flex_dense: every
    score, the mask_mod everywhere, the same seed's mask drawn (B, H, T, S)). GQA, 32 x 16
    blocks; the last in whole blocks."""
    from qkv.nn.core import flex_dense
    from qkv.nn.hooks import AttentionInputs

    H, T, S = shape[1], shape[3], shape[4]
    bm = _block_mask(kind, shape)
    score_mod = None if mod is None else _ready_mod(mod, H, T, S)
    q, k, v = (t.requires_grad_() for t in _inputs(shape))
    scale = q.shape[-1] ** -0.5
    results = {}
    for path in ("kernels", "dense"):
        torch.manual_seed(21)
        if path == "kernels":
            out, _ = flex_triton.attend(q, k, v, bm, scale, score_mod, dropout_p=0.25)
        else:
            inputs = AttentionInputs(q, k, v, enable_gqa=True, dropout_p=0.25, scale=scale)
            out, _ = flex_dense(inputs, score_mod, bm)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
        results[path] = (out, *torch.autograd.grad(out, (q, k, v), g))
    for name, a, e in zip(("out", "dq", "dk", "dv"), *results.values(), strict=True):
        assert_close(a, e, atol=3e-5, rtol=3e-5, name=f"flex dropout {kind} {mod} {name}")


def test_a_module_with_a_block_mask_trains_with_dropout_on_the_kernels(counter_on_cpu,
                                                                      monkeypatch):
    """The routing: a flex record with dropout goes to the kernels where they serve it (on a
    GPU; here the interpreter stands in), to the dense definition when weights are asked."""
    from qkv.nn import core
    from qkv.nn.hooks import AttentionInputs

    shape = SHAPES[0]
    bm = _block_mask("document", shape)
    q, k, v = _inputs(shape)
    inputs = AttentionInputs(q, k, v, dropout_p=0.1, block_mask=bm)
    monkeypatch.setattr(flex_triton, "why_not", lambda *a, named: None)  # as on a GPU
    assert core.drops_in_kernel(inputs, None, bm, need_weights=False)
    assert not core.drops_in_kernel(inputs, None, bm, need_weights=True)
    monkeypatch.undo()  # the CPU rule again: torch's draw, the dense definition
    assert not core.drops_in_kernel(inputs, None, bm, need_weights=False)


@pytest.mark.parametrize("shape, whole", [(SHAPES[0], False), (SHAPES[1], False),
                                          (SHAPES[2], False), (WHOLE, True),
                                          ((1, 2, 2, 64, 50, 16, 16, (32, 16)), False)],
                         ids=str)
def test_the_kernels_drop_the_edge_masks_exactly_when_t_and_s_are_whole_blocks(shape, whole):
    """``EVEN``: every tile inside ``T × S`` (torch's flex kernels' ``IS_DIVISIBLE``), so the
    loads and scores take no edge mask; a sequence that ends inside a block keeps them."""
    from qkv.attention.triton import launch as triton_launch

    bm = _block_mask("document", shape)
    q, k, v = _inputs(shape)
    tab = flex_triton.tables(bm, q.device)
    mod = flex_triton.score_mod_params(None, q, shape[3])
    for kind in ("forward", "dq", "dkdv"):
        options = triton_launch._flex_args(q, k, v, tab, bm, mod, kind)[3]
        assert options["EVEN"] is whole, (kind, shape)
