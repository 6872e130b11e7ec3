"""``qkv train``, ``qkv translate`` and ``qkv eval``: tiny runs, config validation, bad checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qkv.cli.app import app
from qkv.cli.eval_cmd import evaluate_checkpoint
from qkv.cli.train_cmd import metrics_text
from qkv.data import make_task
from qkv.generate import translate
from qkv.models import DecoderLM, Seq2SeqTransformer
from qkv.train import evaluate_seq2seq, load_checkpoint
from qkv.train.runs import build_train_config, find_checkpoint
from qkv.train.spec import DataSpec, load_dataset, read_spec_toml

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})

# A model and run small enough to train in about a second.
TINY = """
steps = 12
batch_size = 16
eval_every = 6
eval_examples = 20
progress = false
[data]
n_train = 200
n_valid = 20
n_test = 30
max_len = 4
[model]
d_model = 16
num_heads = 2
d_ff = 32
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    config = write(root / "tiny.toml", TINY)
    result = runner.invoke(app, ["train", "copy", "--config", str(config), "--out",
                                 str(root / "copy"), "--seed", "3"])  # fmt: skip
    return result, root / "copy"


def assert_one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    err = result.stderr
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


# ---------------------------------------------------------------- qkv train on a task


def test_train_task_writes_a_run_and_reports_test_metrics(copy_run):
    result, out = copy_run
    assert result.exit_code == 0, result.output
    # copy targets of 1-4 digits: too short for BLEU, which says so instead of printing 0.0
    assert re.search(r"^test: .*exact match \d+\.\d%.*BLEU n/a \(targets average \d\.\d "
                     r"tokens; BLEU needs 4-grams\)  chrF ", result.stdout, re.M), result.stdout
    assert f"checkpoint: {out / 'best'}" in result.stdout
    for name in ("best/config.json", "last/config.json", "metrics.jsonl", "loss.png", "data.json"):
        assert (out / name).is_file(), name
    spec = json.loads((out / "data.json").read_text())
    assert spec == {"kind": "task", "source": "copy", "seed": 3, "n_train": 200, "n_valid": 20,
                    "n_test": 30, "valid_fraction": 0.1, "options": {"max_len": 4},
                    "tokenizer": "char", "vocab_size": None, "source_column": None,
                    "target_column": None, "text_column": None}  # fmt: skip
    ckpt = load_checkpoint(out / "best")
    assert isinstance(ckpt.model, Seq2SeqTransformer) and ckpt.model.config.d_model == 16
    assert set(ckpt.tokenizers) == {"src", "tgt"}


def test_options_win_over_the_config_file(copy_run):
    _, out = copy_run
    last = json.loads((out / "last" / "train_state.json").read_text())
    assert last["config"]["seed"] == 3 and last["config"]["steps"] == 12
    assert last["step"] == 12


def test_eval_rebuilds_the_run_s_test_split(copy_run):
    _, out = copy_run
    metrics, what = evaluate_checkpoint(out)
    assert what == "task copy, test split, 30 pairs"
    ckpt = load_checkpoint(out / "best")
    test = make_task("copy", seed=3, n_train=200, n_valid=20, n_test=30, max_len=4).pairs("test")
    expected = evaluate_seq2seq(ckpt.model.eval(), test, ckpt.tokenizers["src"],
                                ckpt.tokenizers["tgt"], batch_size=256)  # fmt: skip
    assert metrics == expected
    # qkv train reported the test metrics of that same (best) checkpoint
    train_result, _ = copy_run
    assert f"test: {metrics_text(expected)}" in train_result.stdout
    assert "bleu" not in expected and 1 <= expected["bleu_ref_tokens"] < 4
    result = runner.invoke(app, ["eval", str(out)])
    assert result.exit_code == 0, result.output
    assert f"exact match {expected['exact_match']:.1%}" in result.stdout
    assert f"BLEU n/a (targets average {expected['bleu_ref_tokens']:.1f} tokens" in result.stdout


def test_eval_on_other_data(copy_run, tmp_path):
    _, out = copy_run
    valid, _ = evaluate_checkpoint(out / "last", split="valid")
    other, what = evaluate_checkpoint(out, task="copy", seed=9)
    assert what == "task copy, test split, 1,000 pairs"
    tsv = write(tmp_path / "p.tsv", "12\t12\n345\t345\n")
    pairs, what = evaluate_checkpoint(out, pairs=tsv)
    assert what == f"{tsv} (all pairs), 2 pairs"
    for m in (valid, other, pairs):
        assert 0 <= m["exact_match"] <= 1 and m["loss"] > 0


def test_translate_prints_the_library_s_outputs(copy_run):
    _, out = copy_run
    ckpt = load_checkpoint(out / "best")
    texts = ["123", "9", "4242"]
    expected = translate(ckpt.model.eval(), texts, ckpt.tokenizers["src"], ckpt.tokenizers["tgt"])
    for target in (out, out / "best"):
        result = runner.invoke(app, ["translate", str(target), *texts])
        assert result.exit_code == 0, result.output
        assert result.stdout.splitlines() == expected
    beam = runner.invoke(app, ["translate", str(out), "--beam", "3", "123"])
    assert beam.exit_code == 0 and len(beam.stdout.splitlines()) == 1, beam.output


# ---------------------------------------------------------------- pairs and text


def test_train_on_pairs_holds_out_validation_and_test(tmp_path):
    lines = [f"{n}\t{str(n)[::-1]}" for n in range(100, 160)]
    tsv = write(tmp_path / "rev.tsv", "\n".join(lines) + "\n")
    config = write(tmp_path / "c.toml", TINY.replace("max_len = 4\n", "valid_fraction = 0.1\n")
                   .replace("n_train = 200\nn_valid = 20\nn_test = 30\n", ""))  # fmt: skip
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--pairs", str(tsv), "--config", str(config),
                                 "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "pairs: 48 training, 6 validation, 6 test" in result.stdout
    data = load_dataset(DataSpec("pairs", str(tsv), valid_fraction=0.1))
    everything = sorted(data.train + data.valid + data.test)
    assert everything == sorted((a, b) for a, b in (ln.split("\t") for ln in lines))
    metrics, what = evaluate_checkpoint(out)
    assert what == "pairs " + str(tsv) + ", test split, 6 pairs" and 0 <= metrics["chrf"] <= 100


def test_train_a_language_model_on_text(tmp_path):
    text = write(tmp_path / "t.txt", "the quick brown fox jumps over the lazy dog. " * 40)
    config = write(tmp_path / "lm.toml", "steps = 6\nbatch_size = 4\nblock_size = 16\n"
                   "progress = false\n[model]\nd_model = 16\nnum_layers = 1\nnum_heads = 2\n")
    out = tmp_path / "lm"
    result = runner.invoke(app, ["train", "--text", str(text), "--config", str(config),
                                 "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert re.search(r"^validation: loss \d+\.\d+\s+perplexity ", result.stdout, re.M)
    ckpt = load_checkpoint(out / "best")
    assert isinstance(ckpt.model, DecoderLM) and ckpt.model.config.max_len == 16
    metrics, what = evaluate_checkpoint(out)
    assert what == f"text {text}, validation split" and metrics["perplexity"] > 1
    not_seq2seq = runner.invoke(app, ["translate", str(out), "hello"])
    assert_one_line_error(not_seq2seq, "holds a DecoderLM; qkv translate needs an encoder-decoder")


# ---------------------------------------------------------------- bad configs and options


@pytest.mark.parametrize(
    ("toml", "args", "message"),
    [
        ("steps = 'many'\n", ["dates"], "c.toml: steps must be an int >= 1, got 'many'"),
        ("stepz = 3\n", ["dates"], "c.toml: unknown TrainConfig key(s) ['stepz']"),
        ("steps = \n", ["dates"], "c.toml is not valid TOML"),
        ("[optim]\nlr = 1\n", ["dates"], "unknown table(s) ['optim']; the tables are [data] and [model]"),
        ("[model]\nd_modle = 8\n", ["dates"], "c.toml: [model] Seq2SeqConfig.from_dict: unknown keys ['d_modle']"),
        ("[model]\nd_model = 10\nnum_heads = 4\n", ["dates"], "d_model (10) must be a multiple of num_heads (4)"),
        ("[data]\nn_trian = 5\n", ["dates"], "unknown [data] key(s) ['n_trian']"),
        ("[data]\nn_train = -1\n", ["dates"], "[data] n_train must be an int >= 0, got -1"),
        ("[data]\nvalid_fraction = 0.7\n", ["dates"], "valid_fraction must be a number in (0, 0.5), got 0.7"),
        ("[data]\ntask = 'copy'\ntext = 'x'\n", [], "give one data source"),
        ("schedule = 'linear'\n", ["dates"], "schedule must be one of"),
        ("", [], "give one data source: a TASK name, --pairs PATH or --text PATH"),
        ("", ["dates", "--pairs", "x.tsv"], "give one data source"),
        ("", ["dats"], "unknown task 'dats'; the tasks are copy, reverse, sort, addition, dates"),
        ("", ["dates", "--steps", "0"], "steps must be an int >= 1, got 0"),
        ("", ["dates", "--max-seconds", "-1"], "--max-seconds must be > 0, got -1"),
        ("", ["--pairs", "missing.tsv"], "no TSV file at missing.tsv"),
    ],
)
def test_bad_configs_are_one_line_errors(tmp_path, monkeypatch, toml, args, message):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "c.toml", toml)
    result = runner.invoke(app, ["train", *args, "--config", "c.toml", "--out", "run"])
    assert_one_line_error(result, message)
    assert not (tmp_path / "run" / "last").exists()


@pytest.mark.parametrize(("toml", "args", "blamed"), [
    ("steps = 5\n", ["--steps", "0"], False),  # the command line's value, not the file's
    ("steps = 5\n", ["--context-parallel", "0"], False),
    ("steps = 0\n", [], True),  # the file's own value
    ("steps = 0\n", ["--lr", "0.01"], True),
])
def test_an_error_names_the_config_file_only_when_the_file_is_at_fault(tmp_path, monkeypatch,
                                                                       toml, args, blamed):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "c.toml", toml)
    result = runner.invoke(app, ["train", "dates", *args, "--config", "c.toml", "--out", "run"])
    assert_one_line_error(result, "must be")
    assert ("c.toml:" in result.stderr) is blamed, result.stderr


def test_missing_config_file_and_taken_out_folder(tmp_path, copy_run):
    result = runner.invoke(app, ["train", "dates", "--config", str(tmp_path / "none.toml")])
    assert_one_line_error(result, f"no config file at {tmp_path / 'none.toml'}")
    _, out = copy_run
    taken = runner.invoke(app, ["train", "copy", "--out", str(out)])
    assert_one_line_error(taken, f"--out {out} already holds a run; choose another folder")


def test_read_toml_splits_tables(tmp_path):
    tables = read_spec_toml(write(tmp_path / "a.toml", TINY))
    assert tables["train"]["steps"] == 12 and tables["model"]["d_model"] == 16
    assert tables["data"] == {"n_train": 200, "n_valid": 20, "n_test": 30, "max_len": 4}


def test_short_runs_get_a_short_warmup():
    assert build_train_config("task", {}, {"steps": 50}).warmup == 5
    assert build_train_config("task", {}, {}).warmup == 100
    assert build_train_config("task", {"warmup": 7}, {"steps": 50}).warmup == 7
    assert build_train_config("text", {}, {}).metric == "loss"


# ---------------------------------------------------------------- bad checkpoints


def corrupt(run: Path, dest: Path, how: str) -> Path:
    import shutil

    shutil.copytree(run / "best", dest / "best")
    if how == "truncated weights":
        data = (dest / "best" / "model.safetensors").read_bytes()
        (dest / "best" / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif how == "garbage weights":
        (dest / "best" / "model.safetensors").write_bytes(b"\x00" * 64)
    elif how == "bad json":
        (dest / "best" / "config.json").write_text("{not json")
    elif how == "missing tokenizer":
        (dest / "best" / "tokenizer-src.json").unlink()
    elif how == "wrong shape":
        config = json.loads((dest / "best" / "config.json").read_text())
        config["model_config"]["d_model"] = 32
        config["model_config"]["d_ff"] = 64
        (dest / "best" / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated weights", "model.safetensors: not a readable safetensors file, truncated or corrupt"),
        ("garbage weights", "model.safetensors: not a readable safetensors file"),
        ("bad json", "config.json is not valid JSON"),
        ("missing tokenizer", "tokenizer-src.json: cannot read tokenizer"),
        ("wrong shape", "has shape"),
    ],
)
@pytest.mark.parametrize("command", ["translate", "eval"])
def test_corrupt_checkpoints_are_one_line_errors(copy_run, tmp_path, how, message, command):
    _, run = copy_run
    bad = corrupt(run, tmp_path, how)
    args = ["translate", str(bad), "123"] if command == "translate" else ["eval", str(bad),
                                                                         "--task", "copy"]
    assert_one_line_error(runner.invoke(app, args), message)


@pytest.mark.parametrize("command", [["translate", "{}", "x"], ["eval", "{}"]])
def test_missing_checkpoint_is_one_line_error(tmp_path, command):
    args = [a.format(tmp_path / "nowhere") for a in command]
    assert_one_line_error(runner.invoke(app, args), f"no checkpoint at {tmp_path / 'nowhere'}")
    (tmp_path / "empty").mkdir()
    args = [a.format(tmp_path / "empty") for a in command]
    assert_one_line_error(runner.invoke(app, args), "expected a folder with config.json")


def test_find_checkpoint_prefers_best(copy_run):
    _, run = copy_run
    assert find_checkpoint(run) == run / "best"
    assert find_checkpoint(run / "last") == run / "last"


def test_eval_without_data_json_needs_a_data_option(copy_run, tmp_path):
    import shutil

    _, run = copy_run
    shutil.copytree(run / "best", tmp_path / "ck")
    result = runner.invoke(app, ["eval", str(tmp_path / "ck")])
    assert_one_line_error(result, "no data.json in its run folder")
    both = runner.invoke(app, ["eval", str(run), "--task", "copy", "--pairs", "x.tsv"])
    assert_one_line_error(both, "give at most one of --task, --pairs and --text")
