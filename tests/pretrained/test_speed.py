"""qkv.pretrained.speed (the side-by-side pretrained timings) and ``qkv bench --pretrained``."""

from __future__ import annotations

import json

import pytest
from pretrained_refs import plain_view_gguf
from typer.testing import CliRunner

from qkv.cli.app import app
from qkv.pretrained import speed

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})


def _rate(per_s: float) -> dict:
    return {"items": 1, "min_s": 1 / per_s, "median_s": 1 / per_s, "best_per_s": per_s,
            "median_per_s": per_s}


def fake_records(smollm2: float = 1.6, minilm: float = 1.1, context: float = 1.2) -> list[dict]:
    """Records shaped as the bench functions make them, with the given ratios."""
    return [
        {"kind": "minilm", "label": "MiniLM", "what": "MiniLM", "qkv": _rate(100 * minilm),
         "reference": _rate(100.0), "reference_name": "st", "max_abs_diff": 1e-7},
        {"kind": "smollm2", "label": "SmolLM2", "what": "SmolLM2", "qkv": _rate(10 * smollm2),
         "reference": _rate(10.0), "reference_name": "tf", "tokens_equal_prefix": 8,
         "variants": {"qkv int8": {**_rate(30.0), "tokens_equal_prefix": 5}}},
        {"kind": "context", "label": "context", "ms_per_token": {128: {"min": 10, "median": 11}},
         "ratio_longest_over_shortest_min": context,
         "ratio_longest_over_shortest_median": context},
    ]


def test_check_targets_grades_each_ratio_against_its_bound():
    rows = {r["target"].split(":")[0]: r for r in speed.check_targets(fake_records())}
    assert rows["SmolLM2 greedy"]["met"] and rows["SmolLM2 greedy"]["measured"] == pytest.approx(1.6)
    assert not rows["all-MiniLM-L6-v2 encode"]["met"]
    assert rows["SmolLM2 decode step"]["met"]  # 1.2 <= 1.3
    worse = {r["target"].split(":")[0]: r for r in speed.check_targets(fake_records(context=1.4))}
    assert not worse["SmolLM2 decode step"]["met"]
    assert speed.check_targets([]) == []


@pytest.mark.self_check  # the bench's machinery; the agreement is test_pretrained_*'s property
def test_minilm_and_smollm2_side_by_side_agree_with_their_references():
    """A tiny real run: both sides are timed and their outputs agree (MiniLM embeddings to
    1e-4, SmolLM2's greedy tokens identical)."""
    minilm = speed.bench_minilm(8, 1)
    assert minilm["max_abs_diff"] < 1e-4, minilm["max_abs_diff"]
    assert minilm["qkv"]["best_per_s"] > 0 and minilm["reference"]["best_per_s"] > 0
    with plain_view_gguf():  # the reference's load, 5 s sooner (pretrained_refs)
        smol = speed.bench_smollm2(16, 6, 1, ("int8",))
    assert smol["tokens_equal_prefix"] == 6, smol
    assert "qkv int8" in smol["variants"]


def test_bench_pretrained_prints_ratios_and_targets_and_writes_json(tmp_path, monkeypatch):
    records = fake_records()
    monkeypatch.setattr(speed, "bench_minilm", lambda n, r: records[0])
    monkeypatch.setattr(speed, "bench_smollm2", lambda p, n, r, v: records[1])
    monkeypatch.setattr(speed, "bench_context", lambda c, s, r: records[2])
    args = ["bench", "--quick", "--no-memory", "--lengths", "16", "--dtypes", "float32",
            "--decode-lengths", "32", "--threads", "1", "--repeats", "1", "--pretrained",
            "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "1.60x" in result.output and "NOT MET" in result.output
    saved = json.loads((tmp_path / "bench-quick-pretrained.json").read_text())
    assert [r["kind"] for r in saved["results"]] == ["minilm", "smollm2", "context"]


def test_bench_pretrained_without_the_reference_library_is_one_error_line(monkeypatch):
    def missing(n, r):
        raise ImportError("qkv.pretrained needs the Python package 'sentence-transformers'")

    monkeypatch.setattr(speed, "bench_minilm", missing)
    args = ["bench", "--quick", "--no-memory", "--lengths", "16", "--dtypes", "float32",
            "--decode-lengths", "32", "--threads", "1", "--repeats", "1", "--pretrained"]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert "sentence-transformers" in result.output and "Traceback" not in result.output
