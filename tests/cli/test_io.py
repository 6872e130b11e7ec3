"""Data in and out of the command line: '-' and --input, --json, embed --out, --stream,
--version and -h, python -m qkv. Outputs are compared with the library's own results."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import qkv.pretrained
from qkv.cli import inputs
from qkv.cli.app import app
from qkv.generate import translate
from qkv.train import load_checkpoint

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})

TINY = """
steps = 6
batch_size = 16
eval_every = 6
eval_examples = 10
progress = false
[data]
n_train = 100
n_valid = 10
n_test = 10
max_len = 4
[model]
d_model = 16
num_heads = 2
d_ff = 32
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("io")
    (root / "tiny.toml").write_text(TINY, encoding="utf-8")
    result = runner.invoke(app, ["train", "copy", "--config", str(root / "tiny.toml"), "--out",
                                 str(root / "copy"), "--seed", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    return root / "copy"


def one_line_error(result, message):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr


def test_version_help_and_module():
    from importlib.metadata import version

    got = runner.invoke(app, ["--version"])
    assert got.exit_code == 0 and got.stdout.strip() == f"qkv {version('qkv')}"
    short, long = runner.invoke(app, ["-h"]), runner.invoke(app, ["--help"])
    assert short.exit_code == 0 and short.stdout == long.stdout and "Example:" in short.stdout
    assert "Example:" in runner.invoke(app, ["embed", "-h"]).stdout
    module = subprocess.run([sys.executable, "-m", "qkv", "--version"], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert module.returncode == 0 and module.stdout == got.stdout


def test_read_items_stdin_file_and_errors(tmp_path, monkeypatch):
    class Piped(io.StringIO):
        def isatty(self):
            return False

    monkeypatch.setattr(sys, "stdin", Piped("one\n\n two \nthree\n"))
    assert inputs.read_items(["a", "-"], None, what="text") == ["a", "one", " two ", "three"]
    monkeypatch.setattr(sys, "stdin", Piped("line 1\nline 2\n"))
    assert inputs.read_items(["-"], None, what="prompt", per_line=False) == ["line 1\nline 2"]
    f = tmp_path / "items.txt"
    f.write_text("x\r\ny\n\n", encoding="utf-8")
    assert inputs.read_items(None, f, what="text") == ["x", "y"]
    with pytest.raises(ValueError, match="give at least one text"):
        inputs.read_items([], None, what="text")
    with pytest.raises(ValueError, match=r"--input .*missing\.txt: no such file"):
        inputs.read_items(None, tmp_path / "missing.txt", what="text")
    (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        inputs.read_items(None, tmp_path / "bad.txt", what="text")
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no text"):
        inputs.read_items(None, tmp_path / "empty.txt", what="text")
    monkeypatch.setattr(sys, "stdin", Piped(""))
    with pytest.raises(ValueError, match="standard input holds no text"):
        inputs.read_items(["-"], None, what="text")
    with pytest.raises(ValueError, match="may be given once"):
        inputs.read_items(["-", "-"], None, what="text")


def test_translate_input_file_stdin_and_json(run, tmp_path):
    ckpt = load_checkpoint(run / "best")
    texts = ["123", "9", "4242"]
    want = translate(ckpt.model.eval(), texts, ckpt.tokenizers["src"], ckpt.tokenizers["tgt"])
    f = tmp_path / "texts.txt"
    f.write_text("\n".join(texts) + "\n", encoding="utf-8")
    from_file = runner.invoke(app, ["translate", str(run), "--input", str(f)])
    assert from_file.exit_code == 0 and from_file.stdout.splitlines() == want, from_file.output
    from_stdin = runner.invoke(app, ["translate", str(run), "-", "--json"],
                               input="\n".join(texts) + "\n")  # fmt: skip
    records = [json.loads(line) for line in from_stdin.stdout.splitlines()]
    assert records == [{"source": t, "translation": w} for t, w in zip(texts, want, strict=True)]


def test_generate_checkpoint_json_matches_plain(run, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("12\n34\n", encoding="utf-8")
    plain = runner.invoke(app, ["generate", str(run), "-p", "12", "-p", "34"])
    as_json = runner.invoke(app, ["generate", str(run), "--input", str(f), "--json"])
    assert plain.exit_code == 0 and as_json.exit_code == 0, (plain.output, as_json.output)
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["12", "34"]
    expected = "".join(("\n" if i else "") + f"> {r['prompt']}\n{r['text']}\n"
                       for i, r in enumerate(records))  # fmt: skip
    assert plain.stdout == expected, (records, plain.stdout)
    one_line_error(runner.invoke(app, ["generate", str(run), "-p", "1", "--stream"]),
                   "--stream prints a pretrained language model's tokens")


@pytest.mark.parametrize("suffix", [".npy", ".jsonl", ".safetensors"])
def test_embed_out_equals_library(suffix, tmp_path):
    texts = ["A cat sits on the mat.", "Stock prices fell.", "Ünïcode ✓"]
    want, _ = qkv.pretrained.embed(texts, qkv.pretrained.load("all-MiniLM-L6-v2"))
    out = tmp_path / f"vectors{suffix}"
    result = runner.invoke(app, ["embed", "-", "--out", str(out)], input="\n".join(texts))
    assert result.exit_code == 0, result.output
    if suffix == ".npy":
        got, names = torch.from_numpy(np.load(out, allow_pickle=False)), texts
    elif suffix == ".jsonl":
        rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        got, names = torch.tensor([r["embedding"] for r in rows]), [r["text"] for r in rows]
    else:
        from safetensors import safe_open

        with safe_open(str(out), "pt") as f:
            got, names = f.get_tensor("embeddings"), json.loads(f.metadata()["texts"])
    assert names == texts
    err = (got - want).abs().max().item()
    assert got.shape == want.shape and err <= 1e-6, f"{suffix}: max error {err:.3g}"


def test_embed_json_and_bad_out(tmp_path):
    result = runner.invoke(app, ["embed", "one", "two", "--json"])
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["text"] for r in rows] == ["one", "two"] and len(rows[0]["embedding"]) == 384
    one_line_error(runner.invoke(app, ["embed", "x", "--out", str(tmp_path / "v.txt")]),
                   "unknown extension '.txt'; expected one of .npy, .jsonl, .safetensors")
    assert not list(Path(tmp_path).iterdir())  # refused before any work, nothing written
    # (a missing folder above --out is created: tests/cli/test_frictions.py)
    one_line_error(runner.invoke(app, ["embed"]), "give at least one text")


def test_generate_stream_equals_generate():
    bundle = qkv.pretrained.load("SmolLM2-135M-Instruct")
    want = bundle.generate([{"role": "user", "content": "Name a colour."}], 12)
    result = runner.invoke(app, ["generate", "-m", "SmolLM2-135M-Instruct", "-p", "-",
                                 "--stream", "-n", "12"], input="Name a colour.\n")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == want
    speed = result.stderr.splitlines()[-1]  # after any slow stage's lines (loading)
    assert "tokens/s" in speed and speed.split()[0].isdigit(), result.stderr


def test_chat_terminal_reader_uses_input_with_readline(monkeypatch):
    """On a terminal, qkv chat reads with input() (GNU readline loaded: arrow keys, history);
    "" at end of input, as file.readline."""
    import builtins
    import importlib.util

    from qkv.cli.chat_cmd import terminal_reader

    lines = iter(["hello", "/exit"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
    read = terminal_reader()
    assert [read(), read(), read()] == ["hello\n", "/exit\n", ""]
    if importlib.util.find_spec("readline") is not None:
        assert "readline" in sys.modules
