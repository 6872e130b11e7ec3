"""The ``qkv`` command: the entry point, ``qkv tour`` (numbers and output) and ``qkv explain``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import qkv
from qkv.cli import DTypeName, main
from qkv.cli.app import COMMANDS, app
from qkv.cli.common import human_bytes
from qkv.cli.explain_cmd import build_inputs
from qkv.cli.tour import COST_LENGTHS, compute_tour

# A wide terminal so that no line the tests look for is wrapped by rich.
runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.fixture(scope="module")
def tours() -> dict[torch.dtype, object]:
    return {dtype: compute_tour(seed=0, dtype=dtype) for dtype in DTYPES}


# ---------------------------------------------------------------- the tour's numbers


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tour_weights_rows_sum_to_one(tours, dtype):
    tour = tours[dtype]
    assert tour.weights.shape == (5, 5) and tour.weights.dtype == dtype
    assert tour.x_shape == (5, 8)
    # One rounding per softmax entry plus the sum: a few eps of the dtype.
    tol = 8 * torch.finfo(dtype).eps
    err = float((tour.row_sums - 1.0).abs().max())
    assert err <= tol, f"{dtype}: max |row sum - 1| = {err:.3e} > {tol:.1e}"
    recomputed = float((tour.weights.double().sum(-1) - tour.row_sums).abs().max())
    assert recomputed == 0.0, f"row_sums are not the sums of weights ({recomputed:.3e})"
    assert bool((tour.weights >= 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tour_causal_upper_triangle_is_exactly_zero(tours, dtype):
    tour = tours[dtype]
    assert torch.equal(tour.causal_mask, torch.ones(5, 5, dtype=torch.bool).tril())
    upper = tour.causal_weights.triu(diagonal=1)
    assert tour.causal_upper_max == 0.0 and bool((upper == 0).all()), (
        f"max |weight| above the diagonal {float(upper.abs().max()):.3e}"
    )
    # The first query sees only itself; every row still sums to one.
    assert float(tour.causal_weights[0, 0]) == 1.0
    err = float((tour.causal_weights.double().sum(-1) - 1).abs().max())
    assert err <= 8 * torch.finfo(dtype).eps, f"causal row sums off by {err:.3e}"


def test_tour_numpy_and_torch_agree_in_float64(tours):
    for dtype, tour in tours.items():
        assert tour.numpy_out_diff < 1e-10, f"{dtype}: output differs by {tour.numpy_out_diff}"
        assert tour.numpy_weights_diff < 1e-10, (
            f"{dtype}: weights differ by {tour.numpy_weights_diff}"
        )
        assert tour.numpy_shape == (2, 3, 5, 8)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_tour_manual_steps_match_qkv(tours, dtype, tol):
    tour = tours[dtype]
    assert tour.steps_max_diff < tol, f"manual steps vs qkv: {tour.steps_max_diff:.3e}"
    shapes = dict(tour.steps)
    assert shapes["input x"] == (5, 8)
    assert shapes["scores = q·kᵀ"] == shapes["weights = softmax(scaled)"] == (5, 5)
    assert shapes["out = weights·v"] == (5, 8)
    assert [name for name, _ in tour.steps][-4:] == [
        "scores = q·kᵀ",
        "scaled = scores/√D",
        "weights = softmax(scaled)",
        "out = weights·v",
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tour_memory_is_T_times_S_times_element_size(tours, dtype):
    tour = tours[dtype]
    size = {torch.float32: 4, torch.bfloat16: 2, torch.float64: 8}[dtype]
    assert tour.element_size == size
    assert [row.T for row in tour.cost] == list(COST_LENGTHS)
    assert COST_LENGTHS[0] == 512 and COST_LENGTHS[-1] == 65536
    for row in tour.cost:
        assert row.S == row.T
        assert row.per_head_bytes == row.T * row.S * size
        assert row.all_heads_bytes == 1 * 8 * row.T * row.S * size
    # The tutorial's table: a 512 x 512 float32 matrix is 1 MiB, 32768 x 32768 is 4 GiB.
    if dtype == torch.float32:
        by_T = {row.T: row.per_head_bytes for row in tour.cost}
        assert by_T[512] == 2**20 and by_T[32768] == 4 * 2**30


def test_tour_shapes_of_self_and_cross_attention(tours):
    flows = {kind: rest for kind, *rest in tours[torch.float32].flows}
    assert flows["self"] == [(2, 4, 3, 16), (2, 4, 3, 16), (2, 4, 3, 3), (2, 4, 3, 16)]
    assert flows["cross"] == [(2, 4, 3, 16), (2, 4, 7, 16), (2, 4, 3, 7), (2, 4, 3, 16)]


def test_tour_explanations_are_the_library_s(tours):
    tour = tours[torch.float32]
    q = torch.zeros(1, 8, 64, 64)
    assert tour.explain_fast == str(qkv.explain(q, q, q))
    assert tour.explain_weights == str(qkv.explain(q, q, q, need_weights=True))
    # Asking for weights never sends the output down the O(T·S) math path: a fused kernel
    # serves it and the weights are rebuilt from its log-sum-exp.
    assert tour.explain_weights.startswith(("auto -> torch", "auto -> flash"))


def test_tour_is_deterministic_and_seeded():
    a, b, c = compute_tour(seed=7), compute_tour(seed=7), compute_tour(seed=8)
    assert torch.equal(a.weights, b.weights) and torch.equal(a.causal_weights, b.causal_weights)
    assert not torch.equal(a.weights, c.weights)


@pytest.mark.parametrize("bad", [torch.int64, "float32", None])
def test_tour_rejects_a_non_float_dtype(bad):
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype, got"):
        compute_tour(dtype=bad)


@pytest.mark.parametrize(
    ("n", "text"),
    [(512, "512 B"), (2**20, "1 MiB"), (3 * 2**29, "1.5 GiB"), (2**40, "1 TiB"), (0, "0 B")],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


# ---------------------------------------------------------------- the commands


def test_tour_command_prints_the_key_lines():
    result = runner.invoke(app, ["tour"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for line in (
        "input x: shape (5, 8)",
        "every row sums to one: max |row sum - 1| =",
        "scores = q·kᵀ                (5, 5)",
        "manual steps vs qkv.scaled_dot_product_attention: max |difference| =",
        "output:  max abs difference =",
        "upper triangle: max |weight| = 0 (exactly zero)",
        "(2, 4, 3, 16) │ (2, 4, 7, 16) │ (2, 4, 3, 7)",
        "64 MiB",  # T = S = 4096 in float32, one head
        "128 GiB",  # T = S = 65536 in float32, B=1, H=8
        "auto -> torch",
        "and when the weights themselves are asked for",
    ):
        assert line in out, f"missing {line!r} in:\n{out}"


def test_tour_command_dtype_option_changes_the_table():
    result = runner.invoke(app, ["tour", "--dtype", "float64", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "T·S·8 bytes (float64 is 8 bytes)" in result.stdout
    assert "128 MiB" in result.stdout  # 4096² · 8 bytes
    bad = runner.invoke(app, ["tour", "--dtype", "int8"])
    assert bad.exit_code == 2 and "int8" in bad.output


def test_tour_console_script_runs():
    script = Path(sys.executable).parent / "qkv"
    assert script.exists(), f"console script not installed at {script}"
    start = time.perf_counter()
    proc = subprocess.run(
        [str(script), "tour"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    # no wall-clock bound beyond the timeout: a busy machine may take several times longer
    assert "upper triangle: max |weight| = 0 (exactly zero)" in proc.stdout, (
        f"qkv tour ({elapsed:.1f} s) printed:\n{proc.stdout[-2000:]}")


@pytest.mark.parametrize(("args", "status"), [(["--help"], 0), (["no-such-command"], 2),
                                              (["explain", "--heads", "0"], 2)])
def test_python_dash_m_qkv_is_the_qkv_command(args, status):
    script = Path(sys.executable).parent / "qkv"
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run(cmd + args, capture_output=True, text=True, timeout=60, env=env)
            for cmd in ([sys.executable, "-m", "qkv"], [str(script)])]
    module, console_script = runs
    assert module.returncode == console_script.returncode == status, module.stderr
    assert (module.stdout, module.stderr) == (console_script.stdout, console_script.stderr)


def test_help_shows_an_example():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "Example:" in result.stdout and "qkv tour" in result.stdout
    for module in COMMANDS:
        assert module.NAME in result.stdout


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert "Usage" in result.output and "tour" in result.output


@pytest.mark.parametrize("module", COMMANDS, ids=lambda m: m.NAME)
def test_every_command_help_shows_an_example(module):
    result = runner.invoke(app, [module.NAME, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example:" in result.stdout, result.stdout
    assert f"qkv {module.NAME}" in result.stdout, result.stdout


@pytest.mark.parametrize("module", ["typer", "rich"])
def test_missing_cli_extra_is_one_clear_line(monkeypatch, capsys, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` raise ImportError
    with pytest.raises(SystemExit) as exc:
        main(["tour"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "pip install 'qkv[cli]'" in err and repr(module) in err, err


def test_main_runs_a_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", "--T", "16", "--S", "16"])
    assert exc.value.code == 0
    assert "auto -> torch" in capsys.readouterr().out


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", list(DTypeName))
def test_explain_command_names_the_chosen_backend(need_weights, causal, dtype):
    args = [
        "explain",
        "--T",
        "1024",
        "--S",
        "1024",
        "--heads",
        "8",
        "--kv-heads",
        "8",
        "--dim",
        "64",
        "--dtype",
        dtype.value,
    ]
    args += ["--causal"] * causal + ["--need-weights"] * need_weights
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    q, k, v = build_inputs(1, 8, 8, 1024, 1024, 64, dtype.to_torch())
    expected = qkv.explain(q, k, v, is_causal=causal, need_weights=need_weights)
    assert f"auto -> {expected.chosen}" in result.stdout
    assert result.stdout.startswith(str(expected)), result.stdout
    # Weights are rebuilt from a fused kernel's log-sum-exp: never the math path.
    assert expected.chosen in (("torch", "flash") if need_weights else ("torch",))
    size = torch.finfo(dtype.to_torch()).bits // 8
    assert f"in {dtype.value}: {human_bytes(8 * 1024 * 1024 * size)}" in result.stdout


def test_explain_command_grouped_query_and_named_backend():
    result = runner.invoke(app, ["explain", "--heads", "8", "--kv-heads", "2", "--T", "4096"])
    assert result.exit_code == 0, result.output
    assert "Hkv=2" in result.stdout and "T=4096" in result.stdout
    named = runner.invoke(app, ["explain", "--backend", "math"])
    assert named.exit_code == 0 and named.stdout.startswith("auto -> math"), named.output
    assert "backend='math' was requested" in named.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--heads", "6", "--kv-heads", "4"], "multiple of Hkv"),
        (["--T", "0", "--backend", "torch"], "cannot honour this call"),
        (["--backend", "flashy"], "backend must be one of"),
        (["--T", "-1"], "--T must be >= 0, got -1"),
        (["--dim", "0"], "--dim must be >= 1, got 0"),
    ],
)
def test_explain_command_reports_bad_input_on_stderr(args, message):
    result = runner.invoke(app, ["explain", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "error:" in result.stderr, result.stderr
    assert "Traceback" not in result.output
