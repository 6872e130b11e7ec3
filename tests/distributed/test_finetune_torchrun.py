"""``qkv train --from`` under torchrun: LoRA fine-tuning on 2 real gloo processes (DDP over the
adapters alone, the rest frozen) equals one process, adapters and merged folder alike."""

from __future__ import annotations

import dp_workers as w
from safetensors.torch import load_file
from typer.testing import CliRunner

from finetune_refs import tiny_base, write_chats
from qkv.cli.app import app

GROUP_TIMEOUT_S = 150  # a whole spawned group, imports included


def test_lora_fine_tuning_under_torchrun_equals_one_process(tmp_path):
    base, chats = tiny_base(tmp_path / "base"), write_chats(tmp_path / "chats.jsonl", n=24)
    args = ["train", "--from", str(base), "--chat", str(chats), "--lora-rank", "2",
            "--steps", "3", "--batch-size", "4", "--lr", "0.01", "--seed", "3"]  # fmt: skip
    proc = w.torchrun(2, [*args, "--out", str(tmp_path / "two")])
    one = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    done = w.ended(proc, GROUP_TIMEOUT_S)
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 0, stderr[-3000:]
    assert stdout.count("trained 3 steps") == 1 and "on 2 processes" in stdout, stdout
    for name in ("adapters.safetensors", "model/model.safetensors"):
        a, b = load_file(str(tmp_path / "two" / name)), load_file(str(tmp_path / "one" / name))
        assert a.keys() == b.keys(), name
        for key in a:
            scale = float(b[key].abs().max()) or 1.0
            err = float((a[key] - b[key]).abs().max()) / scale
            assert err <= 1e-5, f"{name} {key}: relative max error {err:.2e}"
        if name == "adapters.safetensors":
            assert any(k.endswith("lora_B") and bool(v.abs().max() > 0) for k, v in a.items())


def test_torchrun_fine_tuning_refuses_a_model_that_is_not_a_decoder_on_every_rank(tmp_path):
    """Every rank refuses before any process group starts, with one line, and ends."""
    chats = write_chats(tmp_path / "chats.jsonl")
    done = w.ended(w.torchrun(2, ["train", "--from", "all-MiniLM-L6-v2", "--chat", str(chats),
                                  "--out", str(tmp_path / "run")]), GROUP_TIMEOUT_S)  # fmt: skip
    assert done.returncode != 0
    assert "a sentence encoder; qkv train --from fine-tunes decoder" in done.stderr, \
        done.stderr[-2000:]
    assert done.stderr.count("error: --from all-MiniLM-L6-v2") == 2, done.stderr[-2000:]
    ours = [line for line in done.stderr.splitlines()
            if 'File "' in line and ("/src/qkv/" in line or "site-packages/qkv/" in line)]
    assert not ours, ours  # torchrun's agent prints its own traceback; qkv prints none
    assert not (tmp_path / "run").exists()
