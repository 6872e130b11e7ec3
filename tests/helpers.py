"""Shared test helpers: one ``assert_close`` that always reports the max error, and the one
list of attention backends every test grid runs (read from the registry)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

# The device tests create tensors on: "cpu", or "cuda" under QKV_TEST_DEVICE=cuda (conftest.py
# then makes it torch's default device too).
DEVICE = torch.device(os.environ.get("QKV_TEST_DEVICE", "cpu"))

# Tolerances per dtype for comparisons against a float64 reference or torch's own kernel.
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}


def to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def max_error(actual, expected) -> float:
    a, e = to_numpy(actual), to_numpy(expected)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - e)))


def dot_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far a float32 ``x (..., K) @ w (N, K)ᵀ`` may fall from the exact one in any
    summation order: ``K·eps·(|x| @ |w|ᵀ)`` elementwise, ``(..., N)`` in float64."""
    eps = torch.finfo(torch.float32).eps
    return x.shape[-1] * eps * (x.double().abs() @ w.double().abs().T) + 1e-30


def assert_close(actual, expected, *, atol: float, rtol: float = 0.0, name: str = "value"):
    """Assert ``|actual - expected| <= atol + rtol·|expected|`` elementwise, with shapes equal.

    The message always names the quantity, the max absolute error and where it occurs.
    """
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    assert not np.isnan(a).any(), f"{name}: {int(np.isnan(a).sum())} NaN entries"
    if a.size == 0:
        return
    err = np.abs(a - e)
    bound = atol + rtol * np.abs(e)
    bad = err > bound
    if bad.any():
        idx = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(
            f"{name}: max abs error {err.max():.3e} (atol {atol:g}, rtol {rtol:g}); "
            f"{int(bad.sum())}/{a.size} entries out of tolerance; worst at {idx}: "
            f"{a[idx]!r} vs {e[idx]!r}"
        )


def assert_lse_and_grads_close(got, want, inputs, inputs64, kind: str) -> None:
    """``got = (out, lse)`` of float32 ``inputs (q, k, v)`` against ``want``, the same of
    their float64 copies ``inputs64``: outputs and lse within 1e-5, the same rows with no
    visible key (lse -inf), and the gradients of ``out`` and ``lse`` together within 2e-5."""
    (out, lse), (ref, ref_lse) = got, want
    assert_close(out, ref, atol=1e-5, rtol=1e-5, name=f"out {kind}")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"rows with no key differ ({kind})"
    assert_close(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5, name=f"lse {kind}")
    g_out = torch.randn_like(ref)
    g_lse = torch.randn_like(ref_lse).masked_fill(~finite, 0.0)
    grads = torch.autograd.grad((out * g_out.float()).sum() + (lse * g_lse.float()).sum(),
                                inputs)
    refs = torch.autograd.grad((ref * g_out).sum() + (ref_lse * g_lse).sum(), inputs64)
    for name, a, e in zip("qkv", grads, refs, strict=True):
        assert_close(a, e, atol=2e-5, rtol=2e-5, name=f"d{name} {kind}")


def backend_names(*, auto: bool = True) -> list[str]:
    """The attention backends a grid runs: ``["auto", *registry]``, fastest first.

    Read from :data:`qkv.attention.backends.REGISTRY` when a test module is collected (less
    ``triton`` off CUDA), so a
    backend registered before that (``QKV_TEST_EXTRA_BACKEND=1``, tests/attention/conftest.py)
    joins every grid with no test file edited. ``auto=False`` leaves out ``"auto"``.
    """
    from qkv.attention.backends import REGISTRY

    # On CPU the triton backend runs in Triton's interpreter, far too slow for every grid: its
    # own grid (tests/attention/test_triton.py) checks it there. On CUDA it joins every grid.
    names = [n for n in REGISTRY if n != "triton" or DEVICE.type == "cuda"]
    return ["auto", *names] if auto else names


def skip_if_refused(backend: str, *args, **kwargs) -> None:
    """Skip a grid cell whose backend, one registered from outside qkv, refuses the call
    ``qkv.scaled_dot_product_attention(*args, backend=backend, **kwargs)`` by contract (its
    ``why_not``, e.g. no dropout). qkv's own backends are never skipped: what they refuse is
    pinned by test_explain.py and test_errors.py, so a new refusal of theirs fails here."""
    import qkv
    from qkv.attention.backends import REGISTRY
    from qkv.attention.errors import AttentionArgumentError

    module = REGISTRY.get(backend)
    if module is None or getattr(module, "__name__", "").startswith("qkv."):
        return
    try:
        qkv.explain(*args, backend=backend, **kwargs)
    except AttentionArgumentError as e:
        if "cannot honour this call" not in str(e):
            raise  # an invalid call, not a refusal: the test must see it
        pytest.skip(str(e))


def run_compile_check(*args: str) -> str:
    """Run tests/attention/triton_compile_check.py (Triton compiling for GPUs this machine
    may lack; TRITON_INTERPRET unset, as it must be before triton is imported) with ``args``;
    its output, after asserting it succeeded. Skipped on a GPU: there the kernels compile and
    run for real in the tests beside it, under that machine's triton, while the check's bounds
    (spills, tile counts) are set for the triton this checkout pins."""
    if DEVICE.type != "cpu":
        pytest.skip("a GPU compiles and runs the kernels themselves (the other tests here)")
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "attention" / "triton_compile_check.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def run_interpreted(script, *args: str, timeout: float = 600):
    """Run a benchmark script as ``python script args`` under Triton's interpreter, with the
    tests' once-per-launch language patching (tests/interpreter_speed.py) installed first:
    the ``subprocess.CompletedProcess`` (text)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    boot = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); import interpreter_speed; "
            "interpreter_speed.install(); sys.argv.pop(0); "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", boot, str(here), str(script), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
