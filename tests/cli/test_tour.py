"""``qkv tour``: every stop runs and passes its checks, ``--list``, ``--stop``, ``--html``, and a
broken library function makes the stop that verifies it fail the command."""

from __future__ import annotations

import base64
import html
import math
import re

import pytest
import torch
from typer.testing import CliRunner

import qkv
from qkv.cli.app import app
from qkv.cli.tour import run_tour
from qkv.cli.tour.page import Section
from qkv.cli.tour.stops import STOPS, TourCheckError, check_sections, select

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})

NAMES = [stop.name for stop in STOPS]
PNG = re.compile(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


@pytest.fixture(scope="module")
def sections() -> dict[str, Section]:
    return {s.name: s for s in run_tour(seed=0)}


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[str, str, list[str]]:
    """The whole tour run once through the command with ``--html``: (stdout, page, folder)."""
    folder = tmp_path_factory.mktemp("tour")
    result = runner.invoke(app, ["tour", "--html", str(folder / "tour.html")])
    assert result.exit_code == 0, result.output
    return (
        result.stdout,
        (folder / "tour.html").read_text(),
        sorted(p.name for p in folder.iterdir()),
    )


# ---------------------------------------------------------------- the stops


def test_the_tour_walks_the_seeds_path_in_order():
    assert NAMES == [
        "attention", "steps", "numpy", "self-attention", "multi-head", "masks", "positions",
        "block", "journey", "encoder-decoder", "additive", "vit", "memory",
    ]  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_every_stop_runs_shows_a_picture_and_passes_its_checks(sections, name):
    section = sections[name]
    assert len(section.checks) >= 2, f"{name} checks too little: {section.checks}"
    assert not section.failures, f"{name}: " + "; ".join(map(str, section.failures))
    assert section.pictures, f"{name} draws no picture"
    assert any(type(item).__name__ == "Text" for item in section.items), f"{name} explains nothing"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_the_tour_passes_in_other_dtypes(dtype):
    for section in run_tour(seed=5, dtype=dtype):
        assert not section.failures, f"{section.name}: {section.failures}"


def test_the_module_checks_compare_real_numbers(sections):
    """The equalities report a measured max difference, not a constant."""
    details = [c.detail for c in sections["multi-head"].checks if "torch" in c.label]
    assert len(details) >= 3, details
    values = [float(d.split()[1]) for d in details if d.startswith("=")]
    assert values and all(0 <= v <= 1e-5 for v in values), details


# ---------------------------------------------------------------- the command


def test_list_names_every_stop_in_order():
    result = runner.invoke(app, ["tour", "--list"])
    assert result.exit_code == 0, result.output
    positions = [result.stdout.find(f" {name} ") for name in NAMES]
    assert all(p >= 0 for p in positions), result.stdout
    assert positions == sorted(positions), "stops listed out of order"


def test_an_unknown_stop_is_one_error_line_naming_the_known_ones():
    result = runner.invoke(app, ["tour", "--stop", "banana"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "'banana'" in lines[0] and all(name in lines[0] for name in NAMES), lines[0]
    with pytest.raises(ValueError, match="known stops: attention, steps"):
        select(["banana"])


def test_stop_runs_only_the_named_stops():
    result = runner.invoke(app, ["tour", "--stop", "vit", "--stop", "positions"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "7. positions: the sinusoidal formula" in out and "12. ViT" in out
    assert "1. the attention function" not in out and "13. the O(T·S)" not in out
    assert out.index("7. positions") < out.index("12. ViT"), "not in tour order"
    assert "all 8 checks of 2 stops passed" in out


def test_help_shows_the_example():
    result = runner.invoke(app, ["tour", "--help"])
    assert result.exit_code == 0
    assert "qkv tour --stop multi-head --html tour.html" in result.stdout
    for option in ("--stop", "--list", "--html", "--seed", "--dtype"):
        assert option in result.stdout


def test_the_whole_tour_prints_every_stop_and_its_checks(page, sections):
    out, _, _ = page
    for i, stop in enumerate(STOPS, 1):
        assert f"{i}. {stop.title}" in out, f"missing heading of {stop.name}"
    checks = sum(len(s.checks) for s in sections.values())
    assert out.count("✓") == checks and "✗" not in out
    assert f"all {checks} checks of 13 stops passed" in out, out[-300:]
    # The attention-function lines test_cli.py reads are still there.
    assert "upper triangle: max |weight| = 0 (exactly zero)" in out


# ---------------------------------------------------------------- the page


def test_html_page_has_every_stop_heading_and_its_pictures(page):
    _, text, files = page
    assert files == ["tour.html"], f"temporary files left behind: {files}"
    assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    parts = text.split('<section id="stop-')[1:]
    assert [p.split('"', 1)[0] for p in parts] == NAMES
    for i, (stop, part) in enumerate(zip(STOPS, parts, strict=True), 1):
        assert f"<h2>{i}. {html.escape(stop.title)} " in part, f"no heading for {stop.name}"
        pngs = PNG.findall(part)
        assert pngs, f"{stop.name} has no picture"
        for b64 in pngs:
            assert base64.b64decode(b64)[:8] == b"\x89PNG\r\n\x1a\n"
        assert 'class="fail"' not in part and 'class="pass"' in part


def test_html_page_is_self_contained(page):
    _, text, _ = page
    assert "<style>" in text
    for needle in ("http://", "https://", "<link", "<script", 'src="//', "@import", "url("):
        assert needle not in text, f"the page refers outside itself: {needle!r}"
    srcs = re.findall(r'src="([^"]*)"', text)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    hrefs = re.findall(r'href="([^"]*)"', text)
    assert hrefs and all(h.startswith("#stop-") for h in hrefs)


@pytest.mark.parametrize("seed", ["-1", "99999999999999999999"])
def test_a_seed_out_of_range_is_one_error_line_naming_it(seed):
    result = runner.invoke(app, ["tour", "--seed", seed])
    assert result.exit_code == 2
    assert result.output.startswith("error:") and "--seed" in result.output, result.output
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*31\)"):
        run_tour(seed=int(seed))


def test_html_to_a_folder_is_one_error_line(tmp_path):
    result = runner.invoke(app, ["tour", "--stop", "steps", "--html", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: --html") and "is a folder" in result.output


# ---------------------------------------------------------------- a broken check fails


def test_a_wrong_sinusoidal_table_fails_the_positions_stop(monkeypatch, tmp_path):
    real = qkv.nn.sinusoidal_table
    monkeypatch.setattr(qkv.nn, "sinusoidal_table", lambda *a, **k: real(*a, **k) + 1e-3)
    out = tmp_path / "tour.html"
    result = runner.invoke(app, ["tour", "--stop", "positions", "--html", str(out)])
    assert result.exit_code == 2, result.output
    assert "✗ table = the formula, every entry: max |difference| = 0.001 > 1e-12" in result.stdout
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "stop 'positions'" in error[0], result.output
    assert not out.exists(), "a page was written for a failed tour"
    assert "7. positions" in result.stdout, "a stop keeps its tour number when run alone"


def test_a_wrong_attention_function_fails_the_attention_stop(monkeypatch):
    real = qkv.scaled_dot_product_attention

    def off_by_one_percent(*args, **kwargs):
        result = real(*args, **kwargs)
        return (result[0] * 1.01, result[1]) if isinstance(result, tuple) else result * 1.01

    monkeypatch.setattr(qkv, "scaled_dot_product_attention", off_by_one_percent)
    result = runner.invoke(app, ["tour", "--stop", "attention"])
    assert result.exit_code == 2, result.output
    assert "✗ output = torch.nn.functional.scaled_dot_product_attention" in result.stdout
    assert "error: tour check failed" in result.output and "stop 'attention'" in result.output


def test_a_wrong_torch_drop_in_fails_the_multihead_stop(monkeypatch):
    real = torch.nn.MultiheadAttention.forward

    def shifted(self, *args, **kwargs):
        out, weights = real(self, *args, **kwargs)
        return out + 1e-3, weights

    monkeypatch.setattr(torch.nn.MultiheadAttention, "forward", shifted)
    with pytest.raises(TourCheckError, match=r"stop 'multi-head': output = torch.nn.Multihead"):
        run_tour(["multi-head"])


def test_a_stop_that_raises_fails_with_its_name_and_the_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom in the additive module")

    monkeypatch.setattr(qkv.nn, "BahdanauAttention", broken)
    result = runner.invoke(app, ["tour", "--stop", "additive", "--stop", "vit"])
    assert result.exit_code == 2, result.output
    assert "12. ViT" in result.stdout, "the stops after the failing one still run"
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert error == [
        "error: tour check failed (1): stop 'additive': the stop ran to the end "
        "(RuntimeError: boom in the additive module)"
    ], result.output


# ---------------------------------------------------------------- the check records


def test_checks_fail_on_nan_on_shape_mismatch_and_over_the_limit():
    s = Section("x", "x")
    assert s.at_most("small", 1e-7, 1e-6)
    assert not s.at_most("nan", math.nan, 1.0)
    assert not s.close("shapes", torch.zeros(2, 3), torch.zeros(3, 2), 1.0)
    assert not s.close("values", torch.zeros(3), torch.full((3,), 0.5), 0.1)
    assert not s.holds("false", False)
    assert [c.passed for c in s.checks] == [True, False, False, False, False]
    with pytest.raises(TourCheckError, match=r"\(4\): stop 'x': nan = nan > 1"):
        check_sections([s])
