"""Context-parallel attention on real gloo process groups equals one process.

Each world size runs once (``cp_workers.py`` in a subprocess with a timeout: a hang fails the
test instead of blocking the suite); every case is its own test reading that run's results.
Tolerances: 1e-12 in float64, 1e-5 in float32 (the issue's bounds), against single-process
``qkv.scaled_dot_product_attention`` (or the same model on one process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import cp_workers
import pytest
import torch

from qkv.distributed import chunk_bounds, explain_parallel, shard_sequence
from qkv.distributed.context import choose_method

HERE = Path(__file__).resolve().parent
# Worlds of 3 and 4 ranks run the kernels (attention and its mask parts); the models run on 2.
WORLDS = {
    2: cp_workers.cases_for(2),
    3: [c for c in cp_workers.cases_for(3) if c not in cp_workers.MODEL_CASES],
    4: [c for c in cp_workers.cases_for(4) if c not in cp_workers.MODEL_CASES],
}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"cp{world}") / "results.json"
            proc = subprocess.run(
                [sys.executable, str(HERE / "cp_workers.py"), "--world", str(world), "--out",
                 str(out), "--only", ",".join(WORLDS[world])],
                capture_output=True, text=True, timeout=TIMEOUT_S,
            )
            assert proc.returncode == 0 and out.exists(), (
                f"{world}-rank run failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
            )
            cache[world] = json.loads(out.read_text())
        return cache[world]

    return get


CASES = [(w, c) for w, names in WORLDS.items() for c in names if c not in cp_workers.ERROR_CASES]


@pytest.mark.parametrize(("world", "case"), CASES, ids=[f"{w}ranks-{c}" for w, c in CASES])
def test_equals_one_process(results, world, case):
    errors = results(world)[case]
    tol = 1e-5 if "f32" in case else 1e-12
    worst = max(errors.values())
    assert worst <= tol, f"{case} on {world} ranks: max errors {errors} (tolerance {tol})"


EXPECTED_ERRORS = {
    "too-short": "at least 2 x 2 = 4 positions",
    "all-to-all-heads": "H must be divisible by the world size",
    "dense-mask": "key-padding mask",
    "dropout": "no attention dropout",
    "no-cache": "takes no KV cache",
    # issue 31: shards that make no sequence of the layout gave results, not an error
    "uneven-shards": "ring_attention: the ranks hold shards of [4, 3] positions, but the "
                     "layout of T=7 over 2 ranks gives [3, 4]",
    "all-to-all-uneven": "all-to-all attention: the ranks hold shards of [4, 3] positions",
    "other-sizes": "ring_attention: the ranks' shards differ beyond their lengths (rank 0: "
                   "(B, H, Hkv, D, Dv) = (1, 4, 4, 8, 8), torch.float64; rank 1: (B, H, Hkv, "
                   "D, Dv) = (1, 4, 4, 16, 16)",
}


@pytest.mark.parametrize("case", cp_workers.ERROR_CASES)
def test_refusals_are_clear(results, case):
    message = results(2)[case]["error"]
    assert message is not None, f"{case}: no error raised"
    assert EXPECTED_ERRORS[case] in message, message


def test_layout_is_zigzag_and_covers_every_position():
    T, N = 13, 3
    bounds = chunk_bounds(T, N)
    assert [e - s for s, e in bounds] == [3, 2, 2, 2, 2, 2]
    assert bounds[0][0] == 0 and bounds[-1][1] == T
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    with pytest.raises(ValueError, match="at least 2 x 3 = 6 positions"):
        chunk_bounds(5, 3)


def test_without_a_process_group_the_error_says_how_to_launch():
    with pytest.raises(RuntimeError, match="torchrun"):
        shard_sequence(torch.zeros(1, 8), 1)


def test_explain_picks_a_method_and_counts_bytes():
    e = explain_parallel(B=1, H=8, Hkv=8, T=4096, D=64, world_size=2)
    # ring forward: the K/V shard (B·Hkv·T/N·2D float32) sent N - 1 = 1 time
    assert e.ring_bytes[0] == 1 * 8 * 2048 * 128 * 4
    # ring backward: K/V once more and N = 2 hops of dK/dV
    assert e.ring_bytes[1] == 3 * 8 * 2048 * 128 * 4
    # all-to-all: half of Q (8 heads), K, V (8 heads), out (8 heads), each way
    assert e.all_to_all_bytes == (int(0.5 * 2048 * 4 * 8 * 256),) * 2
    assert e.method == "all_to_all" and "fewer bytes" in e.reason
    # grouped K/V heads make the ring's traffic small: the ring is chosen
    g = explain_parallel(B=1, H=8, Hkv=1, T=4096, D=64, world_size=2)
    assert g.method == "ring" and sum(g.ring_bytes) < sum(g.all_to_all_bytes), str(g)
    r = explain_parallel(B=1, H=6, Hkv=6, T=300, D=16, world_size=4)
    assert r.method == "ring" and r.all_to_all_bytes is None
    assert "does not split" in r.reason and "not possible" in str(r)
    assert choose_method("ring", 8, 2) == "ring"
    with pytest.raises(ValueError, match="divisible"):
        choose_method("all_to_all", 6, 4)
    with pytest.raises(ValueError, match="method must be one of"):
        choose_method("zigzag", 8, 2)


def test_explain_from_the_command_line():
    from typer.testing import CliRunner

    from qkv.cli.app import app

    res = CliRunner().invoke(app, ["explain", "--T", "65536", "--S", "65536", "--causal",
                                   "--world-size", "4"])
    assert res.exit_code == 0, res.output
    assert "context-parallel attention over 4 ranks" in res.output
    bad = CliRunner().invoke(app, ["explain", "--T", "64", "--S", "32", "--world-size", "2"])
    assert bad.exit_code != 0 and "--T (64) must equal --S (32)" in bad.output
