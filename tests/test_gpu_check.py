"""``make gpu-check`` runs only on a lent GPU, minutes at a time: what can be checked of it
without one is checked here, so a typo does not spend those minutes."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _subset() -> list[str]:
    return [line.strip() for line in (ROOT / "tests" / "cuda_subset.txt").read_text().splitlines()
            if line.strip()]


def test_every_entry_of_the_cuda_subset_is_a_test_here():
    for entry in _subset():
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), f"tests/cuda_subset.txt names {path}, which is not there"
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), f"{entry}: no such test"


def test_every_moved_model_test_is_in_the_subset():
    moved = {str(p.relative_to(ROOT)) for p in ROOT.glob("tests/*/test_*_moved.py")}
    assert moved and moved <= set(_subset()), moved - set(_subset())


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
