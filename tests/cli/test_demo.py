"""``qkv demo``: the quick run end to end, its outputs, and the recipe's pieces."""

from __future__ import annotations

import json
import re
import time
from datetime import date

import pytest
import torch
from typer.testing import CliRunner

from qkv.cli.app import app
from qkv.cli.demo import attention_pictures, token_labels
from qkv.data import CharTokenizer, make_task
from qkv.data.dates import CASES, DATE_FORMATS, format_date
from qkv.generate import translate
from qkv.models import Seq2SeqConfig, Seq2SeqTransformer
from qkv.train import load_checkpoint
from qkv.train.recipes import DEMO_DATES, DateRecipe, StopWhen, date_recipe

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    out.mkdir()
    # An earlier demo's log in the folder: the new run must start it afresh, not append.
    (out / "metrics.jsonl").write_text('{"split": "stale", "step": 0}\n')
    start = time.perf_counter()
    result = runner.invoke(app, ["demo", "--quick", "--out", str(out)])
    return result, out, time.perf_counter() - start


# ---------------------------------------------------------------- qkv demo --quick


def test_quick_demo_runs_end_to_end(quick):
    result, out, _ = quick
    assert result.exit_code == 0, result.output
    assert "trained 320 steps" in result.stdout and "all steps run" in result.stdout, result.stdout
    lines = [ln for ln in result.stdout.splitlines() if "exact match" in ln]
    assert any(re.search(r"test exact match: \d{1,3}\.\d%", ln) for ln in lines), lines
    assert f"output folder: {out}" in result.stdout


def test_quick_demo_writes_every_output(quick):
    _, out, _ = quick
    for name in ("loss.png", *(f"alignment-{n}.png" for n in range(1, len(DEMO_DATES) + 1))):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, f"{name}: {len(data)} bytes"
    html = (out / "viewer.html").read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and "cross-attention" in html
    for folder in ("best", "last"):
        assert (out / folder / "config.json").is_file() and (out / folder / "model.safetensors").is_file()
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in records} == {"train", "valid"}
    assert all(r["step"] >= 1 for r in records)


def test_quick_demo_translations_are_the_checkpoint_s(quick):
    result, out, _ = quick
    ckpt = load_checkpoint(out / "best")
    model = ckpt.model.eval()
    texts = [t for t, _ in DEMO_DATES]
    outputs = translate(model, texts, ckpt.tokenizers["src"], ckpt.tokenizers["tgt"])
    for (text, want), got in zip(DEMO_DATES, outputs, strict=True):
        verdict = "right" if got == want else f"wrong, expected {want}"
        assert re.search(rf"{re.escape(text)}\s+→\s+{re.escape(got)}\s+{verdict}", result.stdout), (
            f"no line for {text!r} -> {got!r} in:\n{result.stdout}"
        )
    # The demo's translate command line, run on the demo's checkpoint, agrees.
    cli = runner.invoke(app, ["translate", str(out / "best"), *texts[:2]])
    assert cli.exit_code == 0 and cli.stdout.splitlines() == outputs[:2], cli.output


def test_qkv_eval_of_the_demo_folder_gives_the_demo_s_test_figure(quick):
    result, out, _ = quick
    figure = re.search(r"test exact match: (\d+\.\d)%", result.stdout).group(1)
    evaluated = runner.invoke(app, ["eval", str(out)])
    assert evaluated.exit_code == 0, evaluated.output
    assert "task dates, test split, 200 pairs" in evaluated.stdout
    assert f"exact match {figure}%" in evaluated.stdout, (figure, evaluated.stdout)


def test_demo_out_that_is_a_file_is_one_clear_error(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    result = runner.invoke(app, ["demo", "--quick", "--out", str(target)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: --out {target} is a file, not a folder"
    assert "Traceback" not in result.output


# ---------------------------------------------------------------- the recipe


def test_demo_dates_are_in_the_task_s_formats_and_right():
    for text, iso in DEMO_DATES:
        d = date.fromisoformat(iso)
        written = {format_date(d, f, case=c) for f in DATE_FORMATS for c in CASES}
        assert text in written, f"{text!r} is not {iso} in any format and case of qkv.data.dates"


@pytest.mark.parametrize("quick_mode", [False, True])
def test_demo_dates_are_not_in_the_training_split(quick_mode):
    r = date_recipe(quick_mode)
    task = make_task("dates", seed=r.seed, n_train=r.n_train, n_valid=0, n_test=0)
    seen = {s for s, _ in task.train}
    assert not seen & {t for t, _ in DEMO_DATES}


def test_recipes_full_and_quick():
    full, small = date_recipe(), date_recipe(quick=True, seed=3, run_dir="x", progress=False)
    # A fixed budget of steps decides the result; the time cap is only a safety.
    assert isinstance(full, DateRecipe) and full.target is None and small.target is None
    assert full.train.steps == 1000 and small.train.steps == 320
    assert full.time_budget >= 600 and small.time_budget >= 60
    assert full.train.metric == "exact_match" and full.train.eval_every is not None
    assert small.n_train < full.n_train
    assert small.seed == 3 and small.train.seed == 3 and small.train.run_dir == "x"
    assert small.train.progress is False
    Seq2SeqConfig(10, 10, **full.model)  # the model fields are valid
    with pytest.raises(ValueError, match=r"seed must be an int, got 1.5"):
        date_recipe(seed=1.5)


def test_stop_when_target_time_and_min_metrics():
    stop = StopWhen("exact_match", 0.9, None)
    assert not stop({"event": "step", "step": 1, "loss": 1.0})
    assert not stop({"event": "eval", "step": 10, "exact_match": 0.89})
    assert stop({"event": "eval", "step": 20, "exact_match": 0.9})
    assert stop.reason == "target" and stop.reached_at["step"] == 20
    low = StopWhen("loss", 0.5)
    assert not low({"event": "eval", "step": 1, "loss": 0.6})
    assert low({"event": "eval", "step": 2, "loss": 0.4}) and low.reason == "target"
    timer = StopWhen(seconds=1e-9)
    assert timer({"event": "step", "step": 1}) and timer.reason == "time"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metric": "accuracy"}, r"metric must be one of .*got 'accuracy'"),
        ({"target": float("nan")}, r"target must be a finite number or None, got nan"),
        ({"seconds": 0}, r"seconds must be a number > 0 or None, got 0"),
    ],
)
def test_stop_when_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StopWhen(**kwargs)


# ---------------------------------------------------------------- pictures


def test_token_labels_show_spaces_and_specials():
    tok = CharTokenizer.fit(["a b"])
    assert token_labels(tok, [*tok.encode("a b"), tok.eos_id]) == ["a", "␣", "b", "<eos>"]


def test_attention_pictures_one_png_per_text_and_a_viewer(tmp_path):
    torch.manual_seed(0)
    tok = CharTokenizer.fit(["0123456789-"])
    model = Seq2SeqTransformer(Seq2SeqConfig(tok.vocab_size, tok.vocab_size, d_model=16,
                                             num_heads=2, d_ff=32, dropout=0.0)).eval()
    pictures, viewer = attention_pictures(model, tok, tok, ["12", "3-4-5"], tmp_path, viewer=1)
    assert [p.name for p in pictures] == ["alignment-1.png", "alignment-2.png"]
    assert all(p.read_bytes().startswith(PNG) for p in pictures)
    assert viewer == tmp_path / "viewer.html" and "3-4-5" in viewer.read_text(encoding="utf-8")
    none, no_viewer = attention_pictures(model, tok, tok, ["1"], tmp_path / "b", viewer=None)
    assert len(none) == 1 and no_viewer is None


def test_the_recipe_s_result_depends_on_the_seed_not_the_machine_s_speed():
    """Two runs of a small fixed budget (one while the other tests load the machine) end
    with bit-identical weights and metrics: no wall-clock time decides anything."""
    from dataclasses import replace

    from qkv.train.recipes import train_dates

    base = date_recipe(quick=True, seed=5, progress=False)
    recipe = replace(base, n_train=2000, n_valid=50, n_test=50,
                     train=replace(base.train, steps=30, eval_every=15, eval_examples=50))
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        runs = [train_dates(recipe) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    assert runs[0].result.steps == runs[1].result.steps == 30
    assert runs[0].test_metrics == runs[1].test_metrics, [r.test_metrics for r in runs]
    for (name, a), b in zip(runs[0].model.state_dict().items(),
                            runs[1].model.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs of one seed"
