"""Every command, given hostile arguments, fails with one line naming the argument.

One table: (command line, words the line must hold). Each runs in-process through typer's
CliRunner and must exit non-zero with exactly one non-empty line of output, no traceback and
no exception escaping (``result.exception`` is the SystemExit of a clean failure). Model
names and paths with rich markup (``no[/such]model``) are echoed as typed. A few of the
issue's examples also run as real ``python -m qkv`` processes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qkv.cli import progress
from qkv.cli.app import COMMANDS, app
from qkv.cli.common import check_device, check_out_folder
from qkv.data import CharTokenizer
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.train import save_checkpoint

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
MARKUP = "no[/such]model"  # rich would read "[/such]" as a closing tag
TOK = CharTokenizer.fit("the cat sat on the mat.")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny LM checkpoint (max_len 32), a truncated copy, a plain file, a truncated
    .safetensors file."""
    root = tmp_path_factory.mktemp("hostile")
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(TOK.vocab_size, d_model=16, num_layers=1, num_heads=2,
                                      max_len=32)).eval()  # fmt: skip
    ckpt = save_checkpoint(root / "ckpt", model, tokenizers={"text": TOK})
    trunc = save_checkpoint(root / "trunc", model, tokenizers={"text": TOK})
    weights = next(Path(trunc).glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    a_file = root / "a-file.txt"
    a_file.write_text("not a folder\n")
    loose = root / "loose.safetensors"
    loose.write_bytes(weights.read_bytes()[:50])
    return {"CKPT": str(ckpt), "TRUNC": str(trunc), "FILE": str(a_file),
            "UNDER": str(a_file / "sub"), "LOOSE": str(loose)}  # fmt: skip


NO_CUDA = not torch.cuda.is_available()
# (args, words the one line must hold). CKPT, TRUNC, FILE, UNDER (a path under a file) and
# LOOSE are replaced by the fixture's paths.
HOSTILE = [
    # demo
    (["demo", "--out", "FILE"], ["--out", "is a file, not a folder"]),
    (["demo", "--out", "UNDER"], ["--out", "cannot be created", "is a file"]),
    (["demo", "--threads", "0"], ["--threads"]),
    (["demo", "--seed", "abc"], ["--seed"]),
    # tour
    (["tour", "--dtype", "int8"], ["--dtype", "int8"]),
    (["tour", "--seed", "x"], ["--seed"]),
    (["tour", "--bogus"], ["--bogus"]),
    # train
    *([(["train", "copy", "--device", "cuda", "--out", "UNDER"],
        ["--device 'cuda' is not available", "CPU build"])] if NO_CUDA else []),
    (["train", "copy", "--device", "cuda:99"], ["--device 'cuda:99' is not available"]),
    (["train", "copy", "--device", "banana"], ["--device 'banana' is not a device"]),
    (["train", "copy", "--device", "meta"], ["--device 'meta' is not available"]),
    (["train", "copy", "--out", "UNDER"], ["--out", "cannot be created"]),
    (["train", "copy", "--out", "FILE"], ["--out", "is a file, not a folder"]),
    (["train", "--text", "UNDER"], ["sub"]),
    (["train", "--config", "UNDER"], ["sub"]),
    (["train", "copy", "--threads", "0"], ["--threads"]),
    # translate
    (["translate", MARKUP, "x"], [MARKUP]),
    (["translate", "TRUNC", "x"], ["model.safetensors"]),
    (["translate", "CKPT", "x", "--beam", "0"], ["--beam"]),
    (["translate", "CKPT", "x", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["translate", "CKPT"], ["give at least one text to translate", "--input FILE"]),
    # eval
    (["eval", MARKUP], [MARKUP]),
    (["eval", "TRUNC"], ["model.safetensors"]),
    (["eval", "CKPT", "--split", "banana"], ["--split", "banana"]),
    (["eval", "CKPT", "--beam", "0"], ["--beam"]),
    # explain
    (["explain", "--T", "-1"], ["--T"]),
    (["explain", "--dtype", "int8"], ["--dtype"]),
    (["explain", "--backend", MARKUP], [MARKUP]),
    # inspect
    (["inspect", MARKUP, "hi"], [MARKUP]),
    (["inspect", "TRUNC", "hi"], ["model.safetensors"]),
    (["inspect", "CKPT", "hi", "--out", "UNDER"], ["--out", "cannot be created"]),
    (["inspect", "CKPT", "hi", "--out", "FILE"], ["--out", "is a file, not a folder"]),
    (["inspect", "CKPT", "hi", "--max-tokens", "0"], ["--max-tokens"]),
    (["inspect", "CKPT"], ["text"]),
    # generate
    (["generate", "--model", MARKUP, "-p", "hi"], [MARKUP]),
    (["generate", MARKUP, "-p", "hi"], [MARKUP]),
    (["generate", "CKPT"], ["give at least one prompt", "--input FILE"]),
    (["generate", "CKPT", "--model", MARKUP, "-p", "hi"], ["CHECKPOINT", "--model", "both"]),
    (["generate", "TRUNC", "-p", "hi"], ["model.safetensors"]),
    (["generate", "LOOSE", "-p", "hi"], ["loose.safetensors"]),
    (["generate", "--model", "LOOSE", "-p", "hi"], ["loose.safetensors"]),
    (["generate", "CKPT", "-p", "hi", "-t", "nan"], ["--temperature"]),
    (["generate", "CKPT", "-p", "hi", "-t", "-1"], ["--temperature"]),
    (["generate", "CKPT", "-p", "hi", "--top-p", "2"], ["--top-p"]),
    (["generate", "CKPT", "-p", "hi", "--top-k", "0"], ["--top-k"]),
    (["generate", "CKPT", "-p", "hi", "-n", "0"], ["--max-new-tokens"]),
    (["generate", "CKPT", "-p", "hi", "-n", "1000"], ["max_new_tokens=1000", "max_len=32"]),
    (["generate", "CKPT", "-p", "the cat sat on the mat. the cat sat"],
     ["prompt of 36 tokens", "max_len=32"]),
    (["generate", "CKPT", "-p", "hi", "--beam", "2", "-t", "1"], ["--beam", "--temperature"]),
    (["generate", "CKPT", "-p", "hi", "-t", "1", "--seed", str(2**70)], ["seed must lie in"]),
    # chat
    (["chat", "--model", MARKUP], [MARKUP]),
    (["chat", "-n", "0"], ["--max-new-tokens"]),
    (["chat", "--top-p", "2"], ["--top-p"]),
    # tour
    (["tour", "--stop", "banana"], ["--stop 'banana' is not a stop", "known stops"]),
    (["tour", "--seed", "-1"], ["--seed"]),
    (["tour", "--html", "UNDER"], ["--html", "is a file, not a folder"]),
    # transcribe
    (["transcribe", "--model", MARKUP, "FILE"], [MARKUP]),
    (["transcribe", "FILE"], ["a-file.txt", "cannot decode audio"]),
    (["transcribe", "UNDER"], ["sub", "does not exist"]),
    (["transcribe", "FILE", "--beam-size", "0"], ["--beam-size"]),
    (["transcribe", "FILE", "--align", "UNDER"], ["--align", "is a file, not a folder"]),
    (["transcribe"], ["give at least one audio file", "--input FILE"]),
    # embed
    (["embed", "--model", MARKUP, "x"], [MARKUP]),
    (["embed", "--batch-size", "0", "x"], ["--batch-size"]),
    (["embed"], ["give at least one text", "--input FILE"]),
    # bench (all refused before anything is timed)
    (["bench", "--lengths", "abc"], ["--lengths"]),
    (["bench", "--dtypes", "int8"], ["--dtypes"]),
    (["bench", "--repeats", "0"], ["--repeats"]),
    (["bench", "--threads", "0"], ["--threads"]),
    (["bench", "--out", "UNDER"], ["--out", "cannot be created"]),
    # serve (refused before anything listens)
    (["serve", MARKUP], [MARKUP]),
    (["serve", "--port", "70000"], ["--port"]),
    (["serve", "--max-batch", "0"], ["--max-batch"]),
    (["serve", "--num-blocks", "0"], ["--num-blocks"]),
    # the group itself
    (["no-such-command"], ["no-such-command"]),
]


def _fill(args: list[str], files: dict[str, str]) -> list[str]:
    return [files.get(a, a) for a in args]


def _one_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, f"{len(lines)} lines:\n{result.output}"
    return lines[0]


def test_every_command_is_in_the_table():
    covered = {args[0] for args, _ in HOSTILE}
    assert {m.NAME for m in COMMANDS} <= covered, {m.NAME for m in COMMANDS} - covered


@pytest.mark.parametrize(("args", "words"), HOSTILE, ids=[" ".join(a) for a, _ in HOSTILE])
def test_hostile_arguments_fail_in_one_line(files, args, words, monkeypatch):
    # A stage slower than SLOW_SECONDS (loading a model on a loaded machine) prints progress
    # lines; the error is what must be one line, on a quiet machine or a busy one.
    monkeypatch.setattr(progress, "SLOW_SECONDS", 1e6)
    result = runner.invoke(app, _fill(args, files))
    assert result.exit_code != 0, f"exit 0 for {args}:\n{result.output}"
    assert isinstance(result.exception, SystemExit), f"{type(result.exception).__name__}: " \
        f"{result.exception}"  # fmt: skip
    assert "Traceback" not in result.output
    line = _one_line(result)
    assert line.startswith("error: "), line
    for word in words:
        assert _fill([word], files)[0] in line, f"{word!r} not in: {line}"


@pytest.mark.parametrize("value", ["banana", "cuda:banana", "", "cpu:x"])
def test_check_device_names_the_option(value):
    with pytest.raises(ValueError, match=re.escape(f"--device {value!r} is not a device")):
        check_device(value)


def test_check_device_accepts_the_cpu_and_what_this_machine_has():
    assert check_device("cpu") == "cpu"
    if torch.cuda.is_available():
        assert check_device("cuda:0") == "cuda:0"
    else:
        with pytest.raises(ValueError, match="is not available"):
            check_device("cuda")


def test_check_out_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    assert check_out_folder(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert check_out_folder(tmp_path) == tmp_path
    with pytest.raises(ValueError, match=r"--out .* is a file, not a folder"):
        check_out_folder(tmp_path / "f")
    with pytest.raises(ValueError, match=r"--out .* cannot be created: .*/f is a file"):
        check_out_folder(tmp_path / "f" / "a" / "b")
    for empty in ("", ".", "  "):  # issue 31: '' wrote a run into the working folder
        with pytest.raises(ValueError, match=r"is the current folder; name a folder"):
            check_out_folder(empty)


def test_an_empty_model_name_is_refused():
    """Issue 31: ``qkv generate --model ''`` loaded whatever run the working folder held."""
    from qkv.cli.generate_cmd import resolve_source

    with pytest.raises(ValueError, match="--model is empty"):
        resolve_source(None, "")
    with pytest.raises(ValueError, match="CHECKPOINT is empty"):
        resolve_source(" ", None)


def test_generate_default_length_fits_a_small_max_len(files):
    # max_len 32: the default used to be min(64, 32) new tokens, too many for any prompt.
    result = runner.invoke(app, ["generate", files["CKPT"], "-p", "the cat"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip(), "nothing generated"


def test_markup_in_user_paths_is_printed_as_typed(files, tmp_path):
    # an --out path with rich markup neither breaks nor restyles the listing of files
    out = tmp_path / "[bold]x[/]"
    result = runner.invoke(app, ["inspect", files["CKPT"], "the [/cat]", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"viewer: {out / 'viewer.html'} (open it in a browser" in result.stdout, result.stdout
    assert "trace json" in result.stdout and str(out / "trace.json") in result.stdout


def test_a_real_process_prints_one_line_and_no_traceback():
    args = ["generate", "--model", MARKUP, "-p", "hi"]
    proc = subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True,
                          timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin",
                                            "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert MARKUP in lines[0], lines
