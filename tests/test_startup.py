"""What starting qkv imports (issue 27: every command spent 5.5 s importing torch's compiler
stack before doing anything, ``--help`` and typos included). Counted in imported modules, not
seconds: benchmarks/import_time.py measures the time."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.cli.app import COMMAND_TABLE, summary

SRC = str(Path(__file__).resolve().parents[1] / "src")
HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.fx.experimental.symbolic_shapes",
         "torch.distributed.checkpoint", "matplotlib", "transformers")


def _imported_by(argv: list[str]) -> dict:
    """Run ``qkv *argv`` in a fresh interpreter; which heavy and command modules it imported."""
    code = (
        "import io, json, runpy, sys, contextlib\n"
        f"sys.argv = ['qkv', *{argv!r}]\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n"
        "        runpy.run_module('qkv', run_name='__main__')\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        f"commands = [m for _, m, _ in {[(n, m, '') for n, m, _ in COMMAND_TABLE]!r} "
        "if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'commands': commands}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_imports_no_command_and_no_compiler_stack():
    got = _imported_by(["--help"])
    assert got == {"heavy": [], "commands": []}, got


@pytest.mark.parametrize("argv", [["train", "--help"], ["train", "copy", "--steps", "x"]])
def test_a_command_imports_only_itself_and_no_compiler_stack(argv):
    got = _imported_by(argv)
    assert got["heavy"] == [], got
    own = [m for name, m, _ in COMMAND_TABLE if name == argv[0]]
    assert set(got["commands"]) <= set(own), got  # (inspect's module may import tour parts)


@pytest.mark.parametrize("row", COMMAND_TABLE, ids=lambda r: r[0])
def test_the_listed_summary_is_the_commands_own(row):
    """``qkv --help`` lists these lines without importing the modules: they must stay the
    first paragraph of each command's help."""
    name, module, listed = row
    mod = importlib.import_module(module)
    assert mod.NAME == name and summary(mod) == listed, (summary(mod), listed)


def test_import_qkv_does_not_import_the_compiler_stack_yet_takes_causal_bias():
    code = ("import sys, qkv, torch; print('torch._dynamo' in sys.modules); "
            "from torch.nn.attention.bias import causal_lower_right; "
            "q = torch.randn(1, 2, 3, 8); k = torch.randn(1, 2, 5, 8); "
            "a = qkv.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(3, 5)); "
            "b = qkv.scaled_dot_product_attention(q, k, k, is_causal='bottom-right'); "
            "print(bool(torch.equal(a, b)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr[-2000:]
