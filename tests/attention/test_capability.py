"""The forced-AVX2 pass of ``make test`` really runs torch's AVX2 kernels."""

from __future__ import annotations

import os

import torch


def test_aten_cpu_capability_is_honoured():
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    got = torch.backends.cpu.get_cpu_capability()
    if forced:
        assert got == forced.upper(), f"ATEN_CPU_CAPABILITY={forced} but torch runs {got}"
    else:
        assert got in ("AVX2", "AVX512", "DEFAULT", "NO AVX", "ZVECTOR", "VSX"), got
