"""``qkv bench`` and the suite behind it (qkv.bench.suite, qkv.bench.targets): tiny sizes only."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import qkv
from qkv.bench import suite, targets
from qkv.cli.app import app

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})

TINY = suite.BenchConfig(
    lengths=(16, 32), dtypes=("float32",), decode_lengths=(48,), alibi_length=16, threads=1,
    repeats=2, warmup=0, min_repeat_s=0.0, memory=False,
)


@pytest.fixture(scope="module")
def records():
    return suite.run_suite(TINY, progress=lambda line: None)


def test_suite_times_every_backend_in_every_configuration(records):
    # 2 lengths x causal or not x (fwd, fwd_bwd) + 1 decode, 5 backends each (qkv's torch
    # backend beside torch's own call), + 2 ALiBi with 4 (there "torch" is qkv's already).
    assert len(records) == (2 * 2 * 2 + 1) * 5 + 2 * 4
    for r in records:
        assert r["skipped"] is None, r
        assert r["time"]["repeats"] == 2 and 0 < r["time"]["min_s"] <= r["time"]["median_s"]
        assert r["memory"] is None
    kinds = {(r["kind"], r["mode"]) for r in records}
    assert kinds == {("attention", "fwd"), ("attention", "fwd_bwd"), ("decode", "fwd"),
                     ("alibi", "fwd")}


def test_auto_is_graded_against_qkvs_backends_and_the_overhead_apart():
    def rec(backend, t, alibi=False):
        return {"kind": "decode", "dtype": "float32", "mode": "fwd", "T": 1, "S": 4096,
                "causal": False, "alibi": alibi, "backend": backend, "time": {"min_s": t}}

    records = [rec("flash", 3.0), rec("auto", 2.1), rec("math", 4.0), rec("qkv-torch", 2.0),
               rec("torch", 1.0)]
    records[1]["chosen"] = "torch"
    checks = {t.name: t for t in targets.check_targets(records)}
    choice = checks["auto's choice: its backend vs the best of qkv's backends (time ratio)"]
    assert choice.value == pytest.approx(1.0) and choice.status == "met"
    records[1]["chosen"] = "flash"  # a wrong choice shows
    wrong = {t.name: t for t in targets.check_targets(records)}
    assert wrong[choice.name].value == pytest.approx(1.5) and wrong[choice.name].status != "met"
    auto = checks["auto vs the best of qkv's backends (time ratio)"]
    assert auto.value == pytest.approx(1.05) and auto.status == "met"  # not 2.1 (raw torch)
    overhead = checks["qkv's call overhead: qkv's torch backend vs torch called directly"]
    assert overhead.value == pytest.approx(2.0) and overhead.status == "not met"


def test_suite_forward_errors_are_float32_small(records):
    for r in records:
        if r["mode"] == "fwd":
            assert r["error_vs_fp64"] < 1e-5, f"{r['backend']} {r['kind']} T={r['T']}: " \
                                             f"{r['error_vs_fp64']:.2e}"
            assert r["predicted_peak_bytes"] > 0
        else:
            assert r["error_vs_fp64"] is None


@pytest.mark.parametrize(("causal", "alibi"), [(False, False), (True, False), (False, True),
                                               (True, True)])
def test_reference_rows_match_the_math_backend_in_float64(causal, alibi):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (5, 7, 7))
    slopes = torch.tensor([0.5, 0.25]) if alibi else None
    rows = torch.tensor([0, 2, 4])
    got = suite.reference_rows(q, k, v, rows, causal, slopes)
    want = qkv.scaled_dot_product_attention(q, k, v, is_causal=causal, alibi_slopes=slopes,
                                            backend="math")[:, :, rows]
    err = float((got - want).abs().max())
    assert err < 1e-12, f"reference rows differ from math by {err:.2e}"


def test_suite_skips_what_cannot_fit_or_takes_too_long(monkeypatch):
    monkeypatch.setattr(suite, "available_memory_bytes", lambda: 1024)  # 1 KiB free
    monkeypatch.setattr(suite, "MATH_BACKWARD_MAX_T", 8)
    config = dataclasses.replace(TINY, lengths=(16,), decode_lengths=(), alibi_length=0)
    lines = []
    recs = suite.run_suite(config, progress=lines.append)
    math_bwd = [r for r in recs if r["backend"] == "math" and r["mode"] == "fwd_bwd"]
    assert all("beyond T=8" in r["skipped"] for r in math_bwd)
    flash_fwd = [r for r in recs if r["backend"] == "flash" and r["mode"] == "fwd"]
    assert all("of free memory 0.0 GiB" in r["skipped"] for r in flash_fwd)
    assert all(r["time"] is None for r in recs if r["skipped"])
    assert any(line.startswith("  skip attention float32 fwd T=16") for line in lines)


def test_targets_without_their_lengths_say_no_data(records):
    checks = targets.check_targets(records, quick=False)
    by_name = {t.name: t for t in checks}
    assert by_name["float32 forward: flash vs torch at T >= 1024"].status == "no data"
    assert by_name["forward+backward at T = 65536 fits (GiB)"].detail == "run with --huge"
    auto = by_name["auto vs the best of qkv's backends (time ratio)"]
    assert auto.status in ("met", "not met") and auto.value > 0


def test_quick_targets_use_the_longest_length_and_say_so(records):
    checks = {t.name: t for t in targets.check_targets(records, quick=True)}
    speed = checks["float32 forward: flash vs torch at T >= 1024"]
    assert speed.indicative and speed.status in ("met", "not met")
    assert "T=32" in speed.detail and math.isfinite(speed.value)


def test_bench_command_writes_json_and_plot(tmp_path):
    args = ["bench", "--quick", "--no-memory", "--lengths", "16", "--dtypes", "float32",
            "--decode-lengths", "32", "--threads", "1", "--repeats", "1", "--out",
            str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "threads=1 (torch's setting" in result.output
    capability = torch.backends.cpu.get_cpu_capability()
    assert f"({capability}), 1 of " in result.output, result.output  # CPU, threads, date
    assert "quick run: tiny sizes, not graded against the targets" in result.output
    assert "not met" not in result.output and " met " not in result.output
    data = json.loads((tmp_path / "bench-quick.json").read_text())
    assert data["config"]["threads"] == 1 and data["config"]["lengths"] == [16]
    assert data["config"]["cpu_capability"] == capability and data["config"]["date"]
    assert data["config"]["load"] is False
    assert all("unstable" in r["time"] for r in data["records"] if r.get("time"))
    assert data["targets"] == []
    assert (tmp_path / "bench-quick.png").stat().st_size > 10_000


def test_bench_load_runs_a_busy_process_beside_it(tmp_path):
    args = ["bench", "--quick", "--no-memory", "--lengths", "16", "--dtypes", "float32",
            "--decode-lengths", "32", "--threads", "1", "--repeats", "1", "--load", "--out",
            str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "one busy process beside the measurement (--load)" in result.output
    assert json.loads((tmp_path / "bench-quick.json").read_text())["config"]["load"] is True


def test_bench_without_out_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = Path(qkv.__file__).resolve().parents[2] / "benchmarks" / "results"

    def stamps():
        return {p: p.stat().st_mtime_ns for p in results.glob("*")} if results.is_dir() else {}

    before = stamps()
    args = ["bench", "--quick", "--no-memory", "--lengths", "16", "--dtypes", "float32",
            "--decode-lengths", "32", "--threads", "1", "--repeats", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "not saved: give --out FOLDER" in result.output
    assert list(tmp_path.iterdir()) == []
    assert stamps() == before


def test_bench_needs_no_source_checkout():
    # The suite is part of the package (an installed wheel runs it too).
    assert suite.__name__ == "qkv.bench.suite" and targets.__name__ == "qkv.bench.targets"


def test_huge_runs_flash_in_a_subprocess_and_checks_24_gib(monkeypatch):
    calls = []

    def fake_probe(backend, **kw):
        calls.append((backend, kw))
        return {"peak_extra_bytes": 50 * 2**20, "peak_rss_bytes": 600 * 2**20,
                "baseline_rss_bytes": 550 * 2**20, "peak_reset": True, "seconds": 120.0}

    monkeypatch.setattr(suite, "probe", fake_probe)
    config = dataclasses.replace(TINY, lengths=(), decode_lengths=(), alibi_length=0,
                                 huge=True)
    (rec,) = suite.run_suite(config, progress=lambda line: None)
    backend, kw = calls[0]
    assert backend == "flash" and kw["T"] == kw["S"] == 65536 and kw["backward"]
    assert rec["time"]["min_s"] == 120.0 and rec["predicted_total_bytes"] < 2**30
    (check,) = [t for t in targets.check_targets([rec]) if "65536" in t.name]
    assert check.status == "met" and abs(check.value - 600 / 1024) < 1e-9

    monkeypatch.setattr(suite, "available_memory_bytes", lambda: 2**20)
    (skipped,) = suite.run_suite(config, progress=lambda line: None)
    assert "of free memory" in skipped["skipped"] and len(calls) == 1
    (check,) = [t for t in targets.check_targets([skipped]) if "65536" in t.name]
    assert check.status == "no data" and "of free memory" in check.detail


def test_bench_plot_has_legends_and_named_axes(records):
    from qkv.bench.plot import figure, plot_png

    fig = figure(records)
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
        assert ax.get_legend() is not None or any(t.get_text() == "not measured"
                                                  for t in ax.texts), ax.get_title()  # fmt: skip
    timed = [ax for ax in fig.axes if ax.get_ylabel().startswith("seconds")]
    labels = {t.get_text() for ax in timed for t in ax.get_legend().get_texts()}
    assert {"flash", "torch", "flash causal"} <= labels, labels
    assert plot_png(records)[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure([]) is None


def test_quick_bench_prints_numbers_without_grading(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["bench", "--quick", "--no-memory", "--lengths", "16", "--dtypes", "float32",
            "--decode-lengths", "32", "--threads", "1", "--repeats", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "min ms" in result.output and "qkv flash" in result.output
    assert "targets (speed" not in result.output and "NOT MET" not in result.output.upper()
    assert "not graded against the targets" in result.output


def test_bench_out_that_cannot_be_written_is_one_error_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = ["bench", "--quick", "--no-memory", "--lengths", "16", "--dtypes", "float32",
            "--decode-lengths", "32", "--threads", "1", "--repeats", "1", "--out",
            str(blocker / "sub")]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert "error:" in result.output and "Traceback" not in result.output, result.output


def test_bench_out_that_is_a_file_is_refused_before_measuring(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(app, ["bench", "--quick", "--out", str(blocker)])
    assert result.exit_code != 0
    assert "is a file, not a folder" in result.output and "threads=" not in result.output


def test_unstable_flags_a_spread_of_repeats():
    from qkv.bench.measure import UNSTABLE_SPREAD, unstable

    assert not unstable([1.0, 1.1, 1.2]) and not unstable([1.0, UNSTABLE_SPREAD, 2.0])
    assert unstable([1.0, 1.6, 1.7]) and not unstable([0.0, 0.0])


def _one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: it would run")
def test_bench_on_cuda_without_a_gpu_says_so():
    _one_line_error(runner.invoke(app, ["bench", "--device", "cuda"]),
                    "--device 'cuda' is not available")


def test_bench_on_cuda_runs_the_gpu_suite_with_its_options(tmp_path, monkeypatch):
    """--device cuda hands --quick, --repeats and --out to the GPU suite (qkv.bench.gpu),
    refuses the CPU suite's options by name, and an unknown device."""
    from qkv.bench import gpu

    seen = []
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)  # a GPU, as far as
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the command looks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu, "main", lambda argv: seen.append(argv) or 0)
    out = tmp_path / "b"
    result = runner.invoke(app, ["bench", "--device", "cuda", "--quick", "--repeats", "2",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert seen == [["--device", "cuda", "--quick", "--repeats", "2", "--out",
                     str(out / "gpu.json")]] and out.is_dir()
    _one_line_error(runner.invoke(app, ["bench", "--device", "cuda", "--lengths", "16",
                                        "--load"]),
                    "--lengths, --load: the CPU suite's options; --device cuda runs the GPU")
    _one_line_error(runner.invoke(app, ["bench", "--device", "cuda:0"]),
                    "--device cuda:0: the suites run on cpu or cuda (the current GPU")
    _one_line_error(runner.invoke(app, ["bench", "--device", "banana"]),
                    "--device 'banana' is not a device")


def test_the_gpu_suite_runs_every_case_dry_on_the_cpu(tmp_path):
    """benchmarks/gpu.py --device cpu --quick (Triton's interpreter, tiny shapes, one timed
    call): every case builds and every qkv implementation runs, so the suite a lent GPU's
    minutes go to cannot rot between GPU sessions. torch's GPU kernels may refuse the CPU."""
    from helpers import run_interpreted

    pytest.importorskip("triton")
    script = Path(__file__).parents[2] / "benchmarks" / "gpu.py"
    out = tmp_path / "gpu.json"
    done = run_interpreted(script, "--device", "cpu", "--quick", "--repeats", "1",
                           "--warmup", "0", "--out", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    groups = {r["group"] for r in records}
    assert groups >= {"dense", "decode", "paged", "alibi", "dropout", "window", "document",
                      "relative", "python-mod", "weights"}, groups
    broken = [(r["name"], name, impl.get("error")) for r in records
              for name, impl in r.get("impls", {}).items()
              if not name.startswith("torch") and "median_ms" not in impl]
    assert not broken and not any("error" in r for r in records), broken


def test_decoding_cases_record_kernel_time_or_the_profilers_error(monkeypatch):
    """The decode and paged groups add the device time of a call's kernels (``kernel_ms``,
    torch's profiler, CUDA only): nothing on the CPU, the time and its ratio to the base
    where measured, and the profiler's error (the timings kept) where it fails."""
    from qkv.bench import gpu

    cpu = torch.device("cpu")
    q = torch.randn(1, 2, 1, 8)

    def case(group):
        def build(dev, sh):
            return (q,), {"triton": lambda x: x * 2, "other": lambda x: x + 1}, lambda: q
        return dict(name=group, group=group, shapes=dict(B=1, H=2, T=1, S=1), bwd=False,
                    build=build, base="triton")

    rec = gpu.run_case(case("decode"), cpu, 0, 1)
    assert all("kernel_ms" not in r and "median_ms" in r for r in rec["impls"].values())
    monkeypatch.setattr(gpu, "kernel_ms", lambda fn, dev: 0.5 if fn() is not None else None)
    rec = gpu.run_case(case("paged"), cpu, 0, 1)
    assert {n: r["kernel_ms"] for n, r in rec["impls"].items()} == {"triton": 0.5,
                                                                     "other": 0.5}
    assert rec["kernel_ratios"] == {"other": 1.0}
    assert "kernel_ms" not in gpu.run_case(case("dense"), cpu, 0, 1)["impls"]["triton"]

    def broken(fn, dev):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")
    monkeypatch.setattr(gpu, "kernel_ms", broken)
    rec = gpu.run_case(case("decode"), cpu, 0, 1)
    assert "CUPTI_ERROR_NOT_INITIALIZED" in rec["impls"]["triton"]["kernel_error"]
    assert "median_ms" in rec["impls"]["triton"], "a profiler failure keeps the timings"
