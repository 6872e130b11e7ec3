"""Shared test helpers: one ``assert_close`` that always reports the max error."""

from __future__ import annotations

import numpy as np
import torch

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
