"""``--device`` on the commands that run a model (generate, chat, serve, translate, embed,
transcribe, inspect, eval) and ``qkv.pretrained.load(..., device=)``: the model runs there and prints what
it prints on the CPU; a device that is not there is one line naming it.

The device is CUDA under ``QKV_TEST_DEVICE=cuda`` and torch's lazy-tensor device elsewhere
(``tests/second_device.py``), which refuses a CPU tensor in an op as CUDA does. Tiny random
qkv checkpoints with their own tokenizers.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

import qkv.pretrained
from qkv.cli.app import app
from qkv.data import CharTokenizer
from qkv.data.tokenizers import ByteTokenizer
from qkv.models import (
    DecoderLM,
    DecoderLMConfig,
    Encoder,
    EncoderConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
)
from qkv.train import save_checkpoint
from second_device import assert_same_run

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
TEXT = "the cat sat on the mat. the dog sat on the log. "
TOK = CharTokenizer.fit(TEXT)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)  # (seeds whose random models print more than blanks at once)
    lm = DecoderLM(DecoderLMConfig(TOK.vocab_size, d_model=16, num_layers=2, num_heads=2,
                                   max_len=64)).eval()
    torch.manual_seed(2)
    s2s = Seq2SeqTransformer(Seq2SeqConfig(TOK.vocab_size, TOK.vocab_size, d_model=16,
                                           num_heads=2, d_ff=32, max_len=40,
                                           dropout=0.0)).eval()
    encoder = Encoder(EncoderConfig(ByteTokenizer().vocab_size, d_model=16, num_layers=1,
                                    num_heads=2)).eval()
    (root / "pairs.tsv").write_text("source\ttarget\nthe cat\tthe mat\na dog\ta log\n")
    (root / "text.txt").write_text(TEXT * 3)
    return {"pairs": root / "pairs.tsv", "text": root / "text.txt",
            "lm": save_checkpoint(root / "lm", lm, tokenizers={"text": TOK}),
            "s2s": save_checkpoint(root / "s2s", s2s, tokenizers={"src": TOK, "tgt": TOK}),
            "encoder": save_checkpoint(root / "enc", encoder,
                                       tokenizers={"text": ByteTokenizer()})}


def _out(args) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
    return result.stdout


COMMANDS = {
    "generate, a checkpoint": lambda c: ["generate", str(c["lm"]), "-p", "the ", "-n", "8"],
    "generate --model": lambda c: ["generate", "--model", str(c["lm"]), "-p", "the ", "-n", "8",
                                   "--no-chat"],
    "generate, beams": lambda c: ["generate", str(c["s2s"]), "-p", "the cat", "--beam", "2",
                                  "-n", "6"],
    "translate": lambda c: ["translate", str(c["s2s"]), "the cat", "a dog", "-n", "6"],
    "embed": lambda c: ["embed", "--model", str(c["encoder"]), "ab", "", "abc", "--json"],
    "eval, pairs": lambda c: ["eval", str(c["s2s"]), "--pairs", str(c["pairs"])],
    "eval, text": lambda c: ["eval", str(c["lm"]), "--text", str(c["text"])],
}


@pytest.mark.parametrize("name", COMMANDS)
def test_device_prints_what_the_cpu_prints(moved, checkpoints, name):
    args = COMMANDS[name](checkpoints)
    on_cpu, on_device = _out(args), _out([*args, "--device", str(moved)])
    if name == "embed":  # floats: another device rounds them differently
        rows = [json.loads(line)["embedding"] for line in on_cpu.splitlines()]
        moved_rows = [json.loads(line)["embedding"] for line in on_device.splitlines()]
        assert moved_rows == [pytest.approx(r, abs=1e-5) for r in rows]
    elif name.startswith("eval"):  # printed metrics: the last digit may round either way
        numbers = r"-?\d+\.\d+"
        assert re.sub(numbers, "#", on_device) == re.sub(numbers, "#", on_cpu), on_device
        assert [float(x) for x in re.findall(numbers, on_device)] == pytest.approx(
            [float(x) for x in re.findall(numbers, on_cpu)], rel=1e-3, abs=1e-3)
    else:
        assert on_device == on_cpu
    assert on_cpu.strip(), "nothing printed: the comparison covered nothing"


@pytest.mark.parametrize("name,extra", [("lm", ["--generate", "3"]),
                                        ("s2s", ["--target", "the mat"])])
def test_inspect_draws_what_the_cpu_draws(moved, checkpoints, tmp_path, name, extra):
    runs = {}
    for where in ("cpu", str(moved)):
        out = tmp_path / where.replace(":", "_")
        _out(["inspect", str(checkpoints[name]), "the cat", "--out", str(out), "--device", where,
              *extra])
        trace = json.loads((out / "trace.json").read_text())
        runs[where] = (sorted(p.name for p in out.iterdir()), trace)
    (files, trace), (files_moved, trace_moved) = runs.values()
    assert files_moved == files and "viewer.html" in files
    assert_same_run(trace, trace_moved, "trace.json", rel=1e-5)  # float32 checkpoints


def test_load_puts_the_model_on_the_device(moved, checkpoints):
    bundle = qkv.pretrained.load(checkpoints["encoder"], device=moved)
    assert next(bundle.model.parameters()).device.type == moved.type
    on_cpu = qkv.pretrained.load(checkpoints["encoder"]).encode(["ab", "abc"])
    on_device = bundle.encode(["ab", "abc"])
    assert on_device.device.type == "cpu"  # embeddings come back on the CPU
    assert torch.allclose(on_device, on_cpu, atol=1e-6), (on_device - on_cpu).abs().max()


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "translate", "embed",
                                     "transcribe", "inspect", "eval"])
def test_a_device_that_is_not_there_is_one_line(command):
    result = runner.invoke(app, [command, "--device", "banana", *(["x"] * (command != "chat"))])
    assert result.exit_code == 2, result.output
    assert "--device 'banana' is not a device" in result.stderr
    assert "Traceback" not in result.output


def test_load_refuses_a_device_that_is_not_there_before_reading(tmp_path):
    with pytest.raises(ValueError, match="device 'banana' is not a device"):
        qkv.pretrained.load(tmp_path / "absent", device="banana")
    with pytest.raises(ValueError, match="device 'meta' is not available"):
        qkv.pretrained.load(tmp_path / "absent", device="meta")
