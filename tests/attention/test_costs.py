"""qkv.explain's cost model: predicted peak memory against peak RSS measured in a subprocess.

Each probe runs one forward call in a fresh interpreter (``benchmarks/memprobe.py``) and
compares the growth of its peak RSS with ``qkv.explain(...).costs[backend].peak_bytes``. The
sizes make every peak tens of MiB or more, well above the allocator's noise (< 1 MiB).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.attention.costs import _causal_pairs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from memprobe import peak_extra_bytes  # benchmarks/ is not a package

MiB = 2**20
TOLERANCE = 0.25  # |measured / predicted - 1|

linux_only = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(),
    reason="the peak-RSS mark can only be reset on Linux (/proc/self/clear_refs)",
)


def predicted(backend, *, B, H, Hkv, T, S, D, dtype, causal=False, need_weights=False,
              alibi=False):
    """``explain``'s prediction on zero-stride inputs of the probe's shapes."""
    zero = torch.zeros((), dtype=dtype)
    q = zero.expand(B, H, T, D)  # (B, H, T, D)
    kv = zero.expand(B, Hkv, S, D)  # (B, Hkv, S, D)
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H) if alibi else None  # (H,)
    e = qkv.explain(q, kv, kv, is_causal=causal, enable_gqa=H != Hkv,
                    need_weights=need_weights, alibi_slopes=slopes, backend=backend)
    return e.costs[backend].peak_bytes


# Two sizes per backend, plus the terms that only some calls have (weights rebuilt from the
# lse, a dense ALiBi mask, the bf16 upcast of a long cache). Flash probes are causal: the
# same memory as full attention for half the time.
PROBES = [
    ("math", dict(B=1, H=8, Hkv=8, T=1024, S=1024, D=64, dtype=torch.float32)),
    ("math", dict(B=1, H=8, Hkv=8, T=2048, S=2048, D=64, dtype=torch.float32)),
    ("flash", dict(B=4, H=8, Hkv=8, T=2048, S=2048, D=64, dtype=torch.float32, causal=True)),
    ("flash", dict(B=1, H=8, Hkv=8, T=4096, S=4096, D=64, dtype=torch.float32, causal=True)),
    ("flash", dict(B=1, H=8, Hkv=8, T=1024, S=1024, D=64, dtype=torch.float32,
                   need_weights=True)),
    ("flash", dict(B=1, H=8, Hkv=8, T=1, S=16384, D=64, dtype=torch.bfloat16)),
    ("torch", dict(B=1, H=8, Hkv=8, T=1024, S=1024, D=64, dtype=torch.float32, alibi=True)),
]


def _id(probe):
    backend, kw = probe
    flags = [k for k in ("causal", "need_weights", "alibi") if kw.get(k)]
    dtype = str(kw["dtype"]).removeprefix("torch.")
    return "-".join([backend, f"B{kw['B']}", f"T{kw['T']}", f"S{kw['S']}", dtype, *flags])


@linux_only
@pytest.mark.parametrize("probe", PROBES, ids=[_id(p) for p in PROBES])
def test_predicted_peak_matches_measured(probe):
    backend, kw = probe
    expected = predicted(backend, **kw)
    assert expected > 8 * MiB, "choose a size well above the allocator's noise"
    measured = peak_extra_bytes(backend, **kw, threads=1)
    ratio = measured / expected
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{_id(probe)}: measured peak {measured / MiB:.1f} MiB, predicted "
        f"{expected / MiB:.1f} MiB, ratio {ratio:.3f} (tolerance {TOLERANCE:.0%})"
    )


def test_math_peak_at_16k_is_three_score_matrices():
    """The figure ``qkv bench`` uses to skip math at T = 16384: 16384² × 8 heads × 4 B × 3."""
    kw = dict(B=1, H=8, Hkv=8, T=16384, S=16384, D=64, dtype=torch.float32)
    out = 8 * 16384 * 64 * 4
    assert predicted("math", **kw) == 3 * 16384**2 * 8 * 4 + out


def test_flash_peak_grows_linearly_with_length():
    kw = dict(B=1, H=1, Hkv=1, D=64, dtype=torch.float32, causal=True)
    small = predicted("flash", **kw, T=16384, S=16384)
    large = predicted("flash", **kw, T=65536, S=65536)
    assert large < 4.5 * small, f"flash peak {small} -> {large} bytes for 4x the length"
    assert large < 64 * MiB


def test_need_weights_costs_the_weights():
    kw = dict(B=1, H=8, Hkv=8, T=1024, S=1024, D=64, dtype=torch.float32)
    weights = 8 * 1024 * 1024 * 4
    plain, with_weights = predicted("flash", **kw), predicted("flash", **kw, need_weights=True)
    assert with_weights - plain >= weights, f"{plain} -> {with_weights}"


def test_causal_flops_count_the_visible_pairs():
    for T, S, shift in itertools.product(range(7), range(7), range(-8, 8)):
        brute = sum(max(0, min(S, i + shift + 1)) for i in range(T))
        assert _causal_pairs(T, S, shift) == brute, (T, S, shift)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(backend="fast"), "backend must be one of"),
        (dict(dtype="float17"), "dtype must be a torch dtype"),
        (dict(T=0), "T must be an int >= 1, got 0"),
        (dict(backend="sdpa", need_weights=True), "cannot return weights"),
    ],
)
def test_probe_rejects_bad_arguments(kwargs, match):
    args = dict(backend="flash", B=1, H=1, Hkv=1, T=4, S=4, D=4, dtype="float32") | kwargs
    with pytest.raises(ValueError, match=match):
        peak_extra_bytes(args.pop("backend"), **args)
