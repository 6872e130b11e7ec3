"""``qkv train`` data in: CSV/JSONL/TSV pairs and text with named columns, the tokenizer choice
(char, byte, BPE saved in the run folder and read back by translate/eval/generate), ``--resume``
equal to an uninterrupted run, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qkv.cli.app import app
from qkv.cli.eval_cmd import evaluate_checkpoint
from qkv.data import BPETokenizer, ByteTokenizer, CharTokenizer
from qkv.generate import translate
from qkv.train import load_checkpoint

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})

SMALL = """
steps = 6
batch_size = 8
eval_every = 3
eval_examples = 8
progress = false
[model]
d_model = 16
num_heads = 2
d_ff = 32
num_encoder_layers = 1
num_decoder_layers = 1
"""
LM = """
steps = 4
batch_size = 4
block_size = 16
eval_batches = 2
progress = false
[model]
d_model = 16
num_layers = 1
num_heads = 2
"""
# copy-task runs: small splits, so that testing the run costs little
TASK_DATA = "[data]\nn_train = 200\nn_valid = 20\nn_test = 20\nmax_len = 6\n"
WORDS = ["cat", "dog", "bird", "fish", "horse", "mouse", "sheep", "goat", "lion", "bear"]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def train(*args: str):
    return runner.invoke(app, ["train", *args])


def assert_one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    err = result.stderr
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


def _csv_pairs(tmp_path: Path) -> Path:
    rows = [f"{i},{w} {i},{w.upper()} {i}" for i, w in enumerate(WORDS * 4)]
    return write(tmp_path / "p.csv", "id,en,up\n" + "\n".join(rows) + "\n")


def test_csv_pairs_with_named_columns_and_a_bpe_tokenizer(tmp_path):
    config, out = write(tmp_path / "c.toml", SMALL), tmp_path / "run"
    result = train("--pairs", str(_csv_pairs(tmp_path)), "--source-column", "en",
                   "--target-column", "up", "--tokenizer", "bpe", "--vocab-size", "280",
                   "--config", str(config), "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "(bpe tokenizer)" in result.stdout and "pairs: 32 training" in result.stdout
    # "bird 3" -> "BIRD 3": 2 13a tokens, too short for BLEU
    assert "BLEU n/a (targets average 2.0 tokens; BLEU needs 4-grams)" in result.stdout
    spec = json.loads((out / "data.json").read_text())
    assert (spec["tokenizer"], spec["vocab_size"]) == ("bpe", 280)
    assert (spec["source_column"], spec["target_column"]) == ("en", "up")
    # the tokenizers travel with the checkpoints, and translate/eval read them back
    ckpt = load_checkpoint(out / "best")
    src, tgt = ckpt.tokenizers["src"], ckpt.tokenizers["tgt"]
    assert isinstance(src, BPETokenizer) and isinstance(tgt, BPETokenizer)
    assert 260 < src.vocab_size <= 280 and ckpt.model.config.src_vocab_size == src.vocab_size
    assert src.decode(src.encode("horse 12")) == "horse 12"
    expected = translate(ckpt.model.eval(), ["cat 1"], src, tgt)
    got = runner.invoke(app, ["translate", str(out), "cat 1"])
    assert got.exit_code == 0 and got.stdout.splitlines() == expected, got.output
    metrics, what = evaluate_checkpoint(out)
    assert what == f"pairs {tmp_path / 'p.csv'}, test split, 4 pairs" and "bleu_ref_tokens" in metrics
    ev = runner.invoke(app, ["eval", str(out), "--pairs", str(tmp_path / "p.csv"),
                             "--source-column", "en", "--target-column", "up"])  # fmt: skip
    assert ev.exit_code == 0 and "(all pairs), 40 pairs" in ev.stdout, ev.output
    assert "BLEU n/a (targets average 2.0 tokens" in ev.stdout


def test_jsonl_text_with_a_byte_tokenizer_then_generate(tmp_path):
    lines = [json.dumps({"id": i, "body": f"the {w} sat on the mat number {i}."})
             for i, w in enumerate(WORDS * 3)]  # fmt: skip
    data = write(tmp_path / "t.jsonl", "\n".join(lines) + "\n")
    config, out = write(tmp_path / "lm.toml", LM), tmp_path / "lm"
    result = train("--text", str(data), "--text-column", "body", "--tokenizer", "byte",
                   "--config", str(config), "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "training and" in result.stdout and "validation tokens (byte), vocabulary 260" in (
        result.stdout)  # fmt: skip
    ckpt = load_checkpoint(out / "best")
    assert isinstance(ckpt.tokenizers["text"], ByteTokenizer)
    metrics, what = evaluate_checkpoint(out)
    assert what == f"text {data}, validation split" and metrics["perplexity"] > 1
    gen = runner.invoke(app, ["generate", str(out), "-p", "the cat", "-n", "4"])
    assert gen.exit_code == 0, gen.output
    whole, _ = evaluate_checkpoint(out, text=data, text_column="body")
    ev = runner.invoke(app, ["eval", str(out), "--text", str(data), "--text-column", "body"])
    assert ev.exit_code == 0 and f"perplexity {whole['perplexity']:.4g}" in ev.stdout, ev.output
    bad = runner.invoke(app, ["eval", str(out), "--text", str(data)])  # no "text" key
    assert_one_line_error(bad, "t.jsonl:1: no 'text' field (set it with --text-column)")


def test_text_bpe_tokenizer_is_trained_on_the_training_split(tmp_path):
    data = write(tmp_path / "t.txt", " ".join(WORDS * 30))
    config, out = write(tmp_path / "lm.toml", LM), tmp_path / "lm"
    result = train("--text", str(data), "--tokenizer", "bpe", "--vocab-size", "270",
                   "--config", str(config), "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    tok = load_checkpoint(out / "last").tokenizers["text"]
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 270
    assert len(tok.encode("horse mouse")) < len("horse mouse")  # merges learned
    gen = runner.invoke(app, ["generate", str(out), "-p", "horse", "-n", "3"])
    assert gen.exit_code == 0 and gen.stdout.strip(), gen.output  # the continuation


def test_old_run_folders_still_load(tmp_path):
    """A data.json written before the tokenizer and column fields existed."""
    config, out = write(tmp_path / "c.toml", SMALL), tmp_path / "run"
    tsv = write(tmp_path / "p.tsv", "".join(f"{w}\t{w[::-1]}\n" for w in WORDS * 3))
    assert train("--pairs", str(tsv), "--config", str(config), "--out", str(out)).exit_code == 0
    spec = json.loads((out / "data.json").read_text())
    old = {k: v for k, v in spec.items() if k not in ("tokenizer", "vocab_size", "source_column",
                                                      "target_column", "text_column")}  # fmt: skip
    write(out / "data.json", json.dumps(old))
    metrics, what = evaluate_checkpoint(out)
    assert what == f"pairs {tsv}, test split, 3 pairs" and 0 <= metrics["exact_match"] <= 1
    assert isinstance(load_checkpoint(out / "best").tokenizers["src"], CharTokenizer)


# ---------------------------------------------------------------- --resume


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished 6-step run of the copy task."""
    root = tmp_path_factory.mktemp("done")
    config = write(root / "c.toml", SMALL + TASK_DATA)
    assert train("copy", "--config", str(config), "--out", str(root / "run")).exit_code == 0
    return root / "run"


RESUME = SMALL.replace("steps = 6\n", "schedule = 'constant'\nwarmup = 2\nlabel_smoothing = 0.1\n")
RESUME = RESUME.replace("d_ff = 32\n", "d_ff = 32\ndropout = 0.1\n") + TASK_DATA


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_resume_equals_the_uninterrupted_run(tmp_path, tokenizer):
    """6 steps in one go == 3 steps, then --resume --steps 6 (constant lr: the schedule does
    not depend on the step count; dropout on: the RNG state must be restored too)."""
    config = write(tmp_path / "c.toml", RESUME)
    common = ["copy", "--config", str(config), "--seed", "4", "--tokenizer", tokenizer]
    if tokenizer == "bpe":
        common += ["--vocab-size", "270"]
    whole, half = tmp_path / "whole", tmp_path / "half"
    assert train(*common, "--steps", "6", "--out", str(whole)).exit_code == 0
    assert train(*common, "--steps", "3", "--out", str(half)).exit_code == 0
    result = train("--resume", str(half), "--steps", "6")
    assert result.exit_code == 0, result.output
    assert f"qkv train --resume {half}: step 3 → 6" in result.stdout
    a, b = load_checkpoint(whole / "last"), load_checkpoint(half / "last")
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values(),
                            strict=True):  # fmt: skip
        diff = (p - q).abs().max().item()
        assert diff <= 1e-6, f"weight {name}: max error {diff}"
    sa, sb = a.train_state, b.train_state
    assert sb["step"] == 6 and sa["history"] == sb["history"] and sa["evals"] == sb["evals"]
    assert [h["step"] for h in sb["history"]] == list(range(1, 7))
    # the second call trained steps 4-6 only (a fresh start would evaluate step 3 again)
    records = [json.loads(x) for x in (half / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "valid"] == [3, 6]
    assert sb["history"][-1]["loss"] > sb["history"][-1]["ce"]  # smoothed objective above ce


@pytest.mark.parametrize(("args", "message"), [
    (["--resume", "{run}", "--lr", "0.1"], "--resume continues a run with its own data and "
     "settings; drop --lr (only --steps, --max-seconds, --device and --threads go with it)"),
    (["--resume", "{run}", "copy", "--tokenizer", "bpe"], "drop TASK, --tokenizer"),
    (["--resume", "{tmp}"], "not a qkv train run folder (expected data.json and last/ in it)"),
    (["--resume", "{run}"], "the run already did 6 of its 6 steps; give --steps above that"),
    (["copy", "--tokenizer", "words"], "--tokenizer must be one of char, byte, bpe, got 'words'"),
    (["copy", "--vocab-size", "300"], "--vocab-size applies to --tokenizer bpe, not 'char'"),
    (["copy", "--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size must be an int >= 260"),
    (["copy", "--source-column", "en"], "--source-column: does not apply to task data (copy)"),
    (["--text", "t.txt", "--source-column", "en"], "--source-column: does not apply to text data"),
    (["--pairs", "p.csv", "--text-column", "x"], "--text-column: does not apply to pairs data"),
    (["--pairs", "bad.csv"], "bad.csv:3: expected 2 fields (the header's ['source', 'target']), "
     "got 3"),
    (["--pairs", "bad.jsonl"], "bad.jsonl:2: no 'target' field (set it with --target-column)"),
    (["copy", "--config", "t.toml"], "t.toml: --tokenizer must be one of char, byte, bpe, got 'wp'"),
    (["--pairs", "p.txt"], "p.txt: unknown pairs format '.txt'; expected a file ending in .tsv, "
     ".csv, .jsonl"),
])  # fmt: skip
def test_bad_options_are_one_line_errors(tmp_path, monkeypatch, done_run, args, message):
    monkeypatch.chdir(tmp_path)
    run = done_run
    write(tmp_path / "bad.csv", "source,target\na,b\nc,d,e\n")
    write(tmp_path / "bad.jsonl", '{"source": "a", "target": "b"}\n{"source": "c"}\n')
    write(tmp_path / "p.txt", "a\tb\n")
    write(tmp_path / "t.txt", "some text " * 50)
    write(tmp_path / "t.toml", "[data]\ntokenizer = 'wp'\n")
    args = [a.format(run=run, tmp=tmp_path) for a in args]
    if "--resume" not in args and "--config" not in args:
        args += ["--config", str(write(tmp_path / "c2.toml", SMALL))]
    assert_one_line_error(train(*args), message)
