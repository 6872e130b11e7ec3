"""The triton backend against the math backend (float64) and the NumPy reference.

Without a GPU its kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``,
set by tests/conftest.py), on small shapes with 16×16 tiles, so every shape below crosses
tiles: odd T and S, T != S, grouped and multi-query heads, decoding (T = 1, key splits merged
by log-sum-exp), every mask part, dead rows, the lse and gradients. Under
``QKV_TEST_DEVICE=cuda`` (make test-gpu) the same grid runs the compiled kernels.

Tolerances: float32 results against float64 within 1e-5 (sums of at most a few hundred
products of unit-size numbers: error ~ sqrt(S)·2⁻²⁴ ≈ 1e-6). Half precision: within twice the
error torch's own math kernel has in the same dtype against float64, plus one unit in the last
place of the output's magnitude (the kernel rounds P to the dtype once more than torch's
math, as FlashAttention does).
"""

from __future__ import annotations

import math
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
    run_interpreted,
)
from qkv.attention import triton as triton_env
from qkv.reference.attention import attention, attention_backward

pytestmark = pytest.mark.skipif(
    not triton_env.installed(), reason="the triton package is not installed"
)

# (B, H, Hkv, T, S, D, Dv)
SHAPES = [
    (2, 4, 4, 37, 45, 24, 24),  # odd sizes, T != S
    (1, 4, 2, 33, 17, 16, 20),  # GQA, T > S, Dv != D
    (2, 6, 1, 21, 50, 8, 8),  # multi-query, D below a tile
    (1, 8, 2, 1, 150, 32, 32),  # decoding: packed group rows, key splits
    (1, 4, 4, 3, 70, 16, 16),  # a few rows, splits
]

MASKS = ["none", "causal", "bottom-right", "window", "alibi", "bool", "float", "padding",
         "alibi+bool+window"]


def _inputs(shape, dtype=torch.float32, seed=0):
    B, H, Hkv, T, S, D, Dv = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64, device="cpu").to(DEVICE, dtype)
               for s in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv)))
    return q, k, v


def _mask_kwargs(kind: str, shape) -> dict:
    B, H, _, T, S, _, _ = shape
    g = torch.Generator().manual_seed(1)
    kw: dict = {}
    if kind in ("causal", "window"):
        kw["is_causal"] = True
    if kind == "bottom-right" or "window" in kind:
        kw["is_causal"] = "bottom-right"
    if "window" in kind:
        kw["window"] = 7
    if "alibi" in kind:
        kw["alibi_slopes"] = torch.tensor([2.0 ** -(i + 1) for i in range(H)]).to(DEVICE)
    if "bool" in kind:
        keep = torch.rand(B, 1, T, S, generator=g, device="cpu") > 0.3
        keep[:, :, T // 2] = False  # a dead row
        kw["attn_mask"] = keep.to(DEVICE)
    if kind == "float":
        bias = torch.randn(1, H, T, S, generator=g, device="cpu")
        bias[0, 0, :, : S // 3] = float("-inf")
        kw["attn_mask"] = bias.to(DEVICE)
    if kind == "padding":  # (B, 1, 1, S): broadcast over heads and queries
        keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
        keep[..., S - S // 4:] = False
        kw["attn_mask"] = keep.to(DEVICE)
    return kw


def _sdpa(q, k, v, backend, **kw):
    return qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend, **kw)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", MASKS)
def test_forward_and_gradients_equal_math_float64(shape, kind):
    kw = _mask_kwargs(kind, shape)
    q, k, v = (t.requires_grad_() for t in _inputs(shape))
    out, lse = _sdpa(q, k, v, "triton", return_lse=True, **kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _sdpa(q64, k64, v64, "math", return_lse=True, **kw)
    assert_lse_and_grads_close((out, lse), (ref, ref_lse), (q, k, v), (q64, k64, v64), kind)


def test_forward_and_backward_equal_numpy_reference():
    shape = (2, 3, 3, 19, 29, 16, 16)
    q, k, v = _inputs(shape)
    keep = torch.rand(1, 1, 19, 29, generator=torch.Generator().manual_seed(3), device="cpu") > 0.4
    qr = q.detach().requires_grad_()
    out = _sdpa(qr, k, v, "triton", attn_mask=keep.to(DEVICE))
    a = [t.detach().cpu().double().numpy() for t in (q, k, v)]
    expected = attention(*a, mask=keep.numpy())[0]
    assert_close(out, expected, atol=1e-5, rtol=1e-5, name="out vs NumPy")
    g = torch.randn(2, 3, 19, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64,
                    device="cpu")
    (dq,) = torch.autograd.grad(out, qr, g.to(DEVICE, torch.float32))
    dq_ref = attention_backward(*a, g.numpy(), mask=keep.numpy())[0]
    assert_close(dq, dq_ref, atol=2e-5, rtol=2e-5, name="dq vs NumPy")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["none", "causal", "alibi+bool+window"])
def test_half_precision_within_twice_torch_math_error(dtype, kind):
    shape = (2, 4, 2, 40, 56, 32, 32)
    kw = _mask_kwargs(kind, shape)
    q, k, v = (t.requires_grad_() for t in _inputs(shape, dtype))
    out = _sdpa(q, k, v, "triton", **kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = _sdpa(q64, k64, v64, "math", **kw)
    torch_out = _sdpa(*(t.detach() for t in (q, k, v)), "math", **kw)  # same dtype
    ulp = torch.finfo(dtype).eps * float(exact.detach().abs().max())
    err, bound = max_error(out, exact), 2 * max_error(torch_out, exact) + ulp
    assert err <= bound, f"{dtype} {kind}: out error {err:.3e} > {bound:.3e}"
    g = torch.randn_like(exact)
    grads = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    exact_grads = torch.autograd.grad(exact, (q64, k64, v64), g)
    qh, kh, vh = (t.detach().requires_grad_() for t in (q, k, v))
    torch_grads = torch.autograd.grad(_sdpa(qh, kh, vh, "math", **kw), (qh, kh, vh), g.to(dtype))
    for name, a, e, t in zip("qkv", grads, exact_grads, torch_grads, strict=True):
        ulp = torch.finfo(dtype).eps * float(e.abs().max())
        err, bound = max_error(a, e), 2 * max_error(t, e) + 2 * ulp
        assert err <= bound, f"{dtype} {kind}: d{name} error {err:.3e} > {bound:.3e}"


def test_dropout_drops_what_flash_drops_with_the_same_seed():
    shape = (1, 2, 2, 20, 24, 16, 16)
    q, k, v = (t.requires_grad_() for t in _inputs(shape))
    results = {}
    for backend in ("triton", "flash"):
        torch.manual_seed(7)
        out = _sdpa(q, k, v, backend, dropout_p=0.3, is_causal=True)
        results[backend] = (out, *torch.autograd.grad(out.sum(), (q, k, v)))
    for name, a, e in zip(("out", "dq", "dk", "dv"), *results.values(), strict=True):
        assert_close(a, e, atol=1e-5, rtol=1e-5, name=f"dropout {name}")


@pytest.fixture
def counter_on_cpu(monkeypatch):
    """Dropout as on a GPU, on this machine too: the counter-based mask, which the kernels
    compute from a seed (qkv.attention.dropout)."""
    from qkv.attention import dropout

    monkeypatch.setattr(dropout, "counter_based", lambda device: True)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[3]], ids=str)
@pytest.mark.parametrize("kind", ["none", "causal", "alibi+bool+window"])
def test_dropout_computed_in_the_kernel_equals_math_with_gradients(shape, kind, counter_on_cpu):
    """The kernels compute the Philox mask per tile (forward, dQ, and transposed in dK/dV);
    math expands the same seed's mask dense: same output and gradients."""
    kw = _mask_kwargs(kind, shape)
    q, k, v = (t.requires_grad_() for t in _inputs(shape))
    results = {}
    for backend in ("triton", "math"):
        torch.manual_seed(7)
        out = _sdpa(q, k, v, backend, dropout_p=0.3, **kw)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
        results[backend] = (out, *torch.autograd.grad(out, (q, k, v), g))
    for name, a, e in zip(("out", "dq", "dk", "dv"), *results.values(), strict=True):
        assert_close(a, e, atol=2e-5, rtol=2e-5, name=f"in-kernel dropout {kind} {name}")


def test_the_kernel_drops_exactly_the_philox_mask(counter_on_cpu):
    """With V the identity the output is the applied weights: zero exactly where the kernel
    dropped, which must be the mask qkv.attention.dropout defines, bit for bit."""
    from qkv.attention import dropout

    B, H, Hkv, T, S = 2, 4, 2, 19, 40
    q, k, _ = _inputs((B, H, Hkv, T, S, 16, 16))
    v = torch.eye(S, device=DEVICE).expand(B, Hkv, S, S)
    torch.manual_seed(9)
    out = _sdpa(q, k, v, "triton", dropout_p=0.45)  # (B, H, T, S): the applied weights
    torch.manual_seed(9)
    keep = dropout.philox_keep(dropout.dropout_state(0.45, q.device), B, H, T, S)
    wrong = int(((out != 0) != keep).sum())
    assert wrong == 0, f"{wrong} of {keep.numel()} weights dropped differently from the mask"


def test_weights_are_exact_and_rows_with_no_key_are_zero():
    shape = (1, 2, 1, 9, 33, 16, 16)
    kw = _mask_kwargs("alibi+bool+window", shape)
    q, k, v = _inputs(shape)
    out, w = _sdpa(q, k, v, "triton", need_weights=True, **kw)
    _, w_ref = _sdpa(q.double(), k.double(), v.double(), "math", need_weights=True, **kw)
    assert_close(w, w_ref, atol=1e-6, name="weights")
    dead = w_ref.sum(-1) == 0
    assert dead.any(), "the mask must leave a row with no key"
    assert (out[dead] == 0).all() and (w[dead] == 0).all()


@pytest.mark.parametrize("shape", [(1, 2, 2, 17, 20, 16, 16), (1, 4, 2, 1, 150, 16, 16)],
                         ids=["prefill", "decode-splits"])
def test_non_finite_query_row_is_nan_and_others_are_unchanged(shape):
    q, k, v = _inputs(shape)
    row = min(3, shape[3] - 1)
    q[0, 1, row, 0] = float("inf")
    out = _sdpa(q, k, v, "triton")
    assert out[0, 1, row].isnan().all()
    ref = _sdpa(q.double(), k.double(), v.double(), "math")
    ok = torch.ones_like(out, dtype=torch.bool)
    ok[0, 1, row] = False
    assert_close(out[ok], ref[ok], atol=1e-5, rtol=1e-5, name="finite rows")


def test_empty_batch_gives_empty_results_and_gradients():
    q, k, v = (t[:0].requires_grad_() for t in _inputs((1, 2, 2, 5, 6, 16, 16)))
    out = _sdpa(q, k, v, "triton", is_causal=True)
    assert out.shape == (0, 2, 5, 16)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in (q, k, v)]


def test_gradient_of_a_sum_reads_an_expanded_output_gradient():
    """``out.sum()`` hands the backward a stride-0 gradient: the kernels must not read it as
    a contiguous one."""
    q, k, v = (t.requires_grad_() for t in _inputs((1, 2, 2, 20, 24, 16, 16)))
    grads = torch.autograd.grad(_sdpa(q, k, v, "triton").sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    refs = torch.autograd.grad(_sdpa(q64, k64, v64, "math").sum(), (q64, k64, v64))
    for name, a, e in zip("qkv", grads, refs, strict=True):
        assert_close(a, e, atol=2e-5, rtol=2e-5, name=f"d{name} of out.sum()")


def test_strided_inputs_and_a_long_key_sequence_with_splits():
    """Non-contiguous q/k/v (a (B, T, H, D) layout transposed) and S over many tiles."""
    B, H, T, S, D = 1, 2, 2, 300, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, T, H, D, generator=g, device="cpu").to(DEVICE).transpose(1, 2)
    k = torch.randn(B, S, H, D, generator=g, device="cpu").to(DEVICE).transpose(1, 2)
    v = torch.randn(B, S, H, D, generator=g, device="cpu").to(DEVICE).transpose(1, 2)
    out = _sdpa(q, k, v, "triton", is_causal="bottom-right", window=100)
    ref = _sdpa(q.double(), k.double(), v.double(), "math", is_causal="bottom-right", window=100)
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name="strided, windowed decode")



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dlse", ["none", "broadcast"])
def test_the_delta_kernel_equals_the_rowwise_product_in_float32(dtype, dlse):
    """``δ = rowsum(dO ∘ O) - dlse`` from one kernel: a (B, T, H, Dv) gradient transposed, Dv
    not a power of two, more rows than a program's block, an lse gradient with stride 0."""
    from qkv.attention.triton.launch import _delta

    B, H, T, Dv = 2, 3, 77, 40
    g = torch.Generator().manual_seed(9)
    out = torch.randn(B, H, T, Dv, generator=g).to(DEVICE, dtype)
    dout = torch.randn(B, T, H, Dv, generator=g).to(DEVICE, dtype).transpose(1, 2)
    g_lse = None
    if dlse == "broadcast":
        g_lse = torch.randn(1, H, T, generator=g).to(DEVICE).expand(B, H, T)
    want = (dout.double() * out.double()).sum(-1) - (0 if g_lse is None else g_lse.double())
    got = _delta(out, dout, g_lse)
    assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == (B, H, T)
    # float32 sums of Dv products of inputs exact in float32: error ~ Dv·2⁻²⁴·|terms|
    assert_close(got.double(), want, atol=1e-5, rtol=1e-5, name=f"delta {dtype} {dlse}")

def test_why_not_names_the_device_and_dtype(monkeypatch):
    q, k, v = _inputs((1, 2, 2, 4, 4, 16, 16))
    explanation = qkv.explain(q.double(), k.double(), v.double())
    assert "triton" in explanation.reasons
    assert "float64" in explanation.reasons["triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if DEVICE.type == "cpu":
        reason = qkv.explain(q, k, v).reasons["triton"]
        assert "runs on CUDA tensors" in reason, reason
        with pytest.raises(ValueError, match="backend='triton' cannot honour this call"):
            _sdpa(q, k, v, "triton")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="auto picks triton on CUDA by design")
def test_auto_never_picks_the_interpreter():
    q, k, v = _inputs((1, 2, 2, 4, 4, 16, 16))
    explanation = qkv.explain(q, k, v, alibi_slopes=torch.tensor([0.5, 0.25]))
    assert explanation.chosen != "triton"
    assert "for testing" in explanation.reasons["triton"]


def test_a_launch_that_overflows_shared_memory_retries_with_fewer_stages(monkeypatch):
    """A GPU with less shared memory than the tiles' stages need (Triton's OutOfResources,
    raised when compiling) gets the kernel again with one stage fewer, remembered."""
    from triton.runtime.errors import OutOfResources

    from qkv.attention.triton import launch as triton_launch

    monkeypatch.setattr(triton_launch, "_FEWER_STAGES", {})
    launched = []

    class Kernel:  # fits with at most ``fits`` stages, as Triton reports it
        def __init__(self, name, fits):
            self.__name__, self.fits = name, fits

        def __getitem__(self, grid):
            def run(*args, num_stages, **options):
                launched.append(num_stages)
                if num_stages > self.fits:
                    raise OutOfResources(262144, 232448, "shared memory")
            return run

    triton_launch._launch(Kernel("a", 2), (1,), (), {"num_stages": 4, "BLOCK_M": 128})
    triton_launch._launch(Kernel("a", 2), (1,), (), {"num_stages": 4, "BLOCK_M": 128})
    assert launched == [4, 3, 2, 2]  # the second launch starts where the first one fitted
    launched.clear()
    with pytest.raises(OutOfResources):  # one stage is the last try
        triton_launch._launch(Kernel("b", 0), (1,), (), {"num_stages": 2, "BLOCK_M": 128})
    assert launched == [2, 1]


def test_scale_and_large_scores_stay_exact():
    """A big scale pushes scores to ~1e3: the running max must keep every exp in range."""
    q, k, v = _inputs((1, 2, 2, 18, 40, 16, 16))
    kw = dict(scale=50.0 / math.sqrt(16), is_causal=True)
    out = _sdpa(q, k, v, "triton", **kw)
    ref = _sdpa(q.double(), k.double(), v.double(), "math", **kw)
    assert_close(out, ref, atol=5e-5, rtol=1e-4, name="large scores")


@pytest.mark.skipif(bool(os.environ.get("ATEN_CPU_CAPABILITY")),
                    reason="compiling does not depend on the CPU's kernels: the first pass did it")
def test_kernels_compile_for_hopper_and_ampere_without_a_gpu():
    """The interpreter never compiles: Triton's compiler, run here down to the GPU's code,
    catches what only it sees (the first GPU run found one: a ``None`` returned from a
    helper)."""
    out = run_compile_check()
    assert out.count("ok sm_90") == 7 and out.count("ok sm_80") == 3, out


@pytest.mark.skipif(bool(os.environ.get("ATEN_CPU_CAPABILITY")),
                    reason="compiling does not depend on the CPU's kernels: the first pass did it")
def test_dense_and_decoding_launches_compile_well_for_a_gpu_without_one():
    """The dense forward and backward (with dropout's Philox mask computed in the kernels
    too), a decoding step and a paged one, compiled as launched on Hopper (Triton's own
    argument specialisation): loads pipelined, at most 256 bytes a thread spilled; the
    decoding step's split kernel spills nothing and as many programs fit on a
    multiprocessor as its key splits are counted for; the loop-less merge and δ kernels
    spill nothing."""
    out = run_compile_check("--launched")
    assert "ok sm_90 decode attention_forward grid (1, 32, 12)" in out, out
    assert "ok sm_90 dropout attention_backward_dkdv" in out, out
    assert out.count("ok sm_90") == 18 and "ok sm_90 paged paged_forward" in out, out
    assert out.count("row_deltas grid") == 3, out  # each backward's δ, one kernel


def _offset(t: torch.Tensor, elements: int) -> torch.Tensor:
    """``t``'s values at an address ``elements`` past an aligned one (a misaligned pointer
    for 1 element of 2 bytes)."""
    flat = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    out = flat[elements:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.skipif(DEVICE.type != "cuda", reason="kept launches skip Triton's binding only "
                    "for compiled kernels; the CPU check is the one below")
def test_kept_launches_give_triton_launches_results_on_the_gpu(monkeypatch):
    """Bit for bit the output and lse of Triton's own launches (QKV_TRITON_FAST_LAUNCH=0),
    decoding and prefill, aligned and misaligned inputs, the kept launch taken on the second
    call."""
    from qkv.attention.triton import fast as triton_fast

    g = torch.Generator().manual_seed(0)
    for T, shift in ((1, 0), (1, 1), (37, 0), (37, 1)):
        q, k, v = (_offset(torch.randn(*s, generator=g).to(DEVICE, torch.bfloat16), shift)
                   for s in ((2, 8, T, 64), (2, 2, 300, 64), (2, 2, 300, 64)))

        def run(q=q, k=k, v=v):
            return qkv.scaled_dot_product_attention(
                q, k, v, enable_gqa=True, backend="triton", is_causal="bottom-right",
                return_lse=True)

        monkeypatch.setattr(triton_fast, "ENABLED", False)
        want = run()
        monkeypatch.setattr(triton_fast, "ENABLED", True)
        run()  # kept here
        got = run()  # launched from the kept kernel
        for name, a, b in zip(("out", "lse"), got, want, strict=True):
            error = (a.float() - b.float()).abs().max()
            assert torch.equal(a, b), f"T={T} offset {shift}: {name} max error {error}"


@pytest.mark.skipif(bool(os.environ.get("ATEN_CPU_CAPABILITY")),
                    reason="compiling does not depend on the CPU's kernels: the first pass did it")
def test_kept_launches_are_the_launches_triton_makes():
    """qkv.attention.triton.fast hands a kept compiled kernel its arguments without Triton's
    binding: for aligned and unaligned pointers and integers equal to 1, divisible by 16 and
    past 32 bits it must pick the kernel Triton picks and pass what Triton passes, and its
    specialisation key must split values as Triton's does (compiled for a stand-in sm_90)."""
    out = run_compile_check("--fast")
    assert out.count("ok fast") == 8 and "offset pointer" in out, out
    hashes = dict(line.split(": ")[0:2] for line in out.splitlines() if ": " in line)
    assert hashes["ok fast aligned"] != hashes["ok fast offset pointer"], out
    assert hashes["ok fast aligned"] == hashes["ok fast rows=16"], out


@pytest.mark.skipif(DEVICE.type != "cpu" or bool(os.environ.get("ATEN_CPU_CAPABILITY")),
                    reason="a dry run for machines without a GPU (gpu-check runs the sweeps "
                           "themselves), independent of the CPU's kernels")
@pytest.mark.parametrize("flex", [False, True], ids=["dense", "flex"])
def test_the_tile_sweeps_run_every_config_without_a_gpu(tmp_path, flex):
    """benchmarks/triton_tiles.py --dry-run: every config of the GPU tile sweep once, in the
    interpreter, tiny shapes. The sweep is otherwise only run on a lent GPU, where a config
    that fails is recorded as its error and the minutes are gone (its stand-in for
    triton_plan.tiles once took the launches' extras flag as the forced tile)."""
    import json
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "triton_tiles.py"
    out = tmp_path / "tiles.json"
    done = run_interpreted(script, "--dry-run", "--out", str(out), *(["--flex"] * flex),
                           timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    failed = [r for r in records if r["ms"] is None]
    assert records and not failed, f"configs that did not run: {failed}\n{done.stdout[-2000:]}"
    assert len(records) == (11 if flex else 24), done.stdout
