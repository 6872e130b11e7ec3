"""``qkv train --from``: fine-tuning a pretrained decoder, fully or with LoRA, from the command
line. References: the base model's own weights (frozen ones unchanged, bit for bit),
transformers loading the written folder (equal logits), and the data's labels (the loss counts
the assistant turns). What the library computes (the merged folder against the adapted model,
a resumed run against an uninterrupted one) is tests/train/test_finetune.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from finetune_refs import TEMPLATE, WORDS, tiny_base
from finetune_refs import write_chats as _chats
from qkv.cli.app import app
from qkv.pretrained import load


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A random-weight Llama-style folder (GQA) with a chat template."""
    return tiny_base(tmp_path_factory.mktemp("base") / "tiny-llama")


def _run(*args: str) -> str:
    got = CliRunner().invoke(app, ["train", *args])
    assert got.exit_code == 0, got.output
    return got.output


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load(folder).model.eval()
    with torch.no_grad():
        return model(ids)  # (B, T, V)


def test_lora_trains_only_the_adapters(base, tmp_path):
    out = tmp_path / "run"
    text = _run("--from", str(base), "--chat", str(_chats(tmp_path / "c.jsonl")),
                "--lora-rank", "4", "--lora-targets", "*.q_proj,*.v_proj", "--steps", "4",
                "--batch-size", "4", "--lr", "0.01", "--out", str(out))  # fmt: skip
    # 2 layers x (q: 32->32, v: 32->16) x r (in + out)
    count = 2 * 4 * ((32 + 32) + (32 + 16))
    assert f"qkv train --from {base}: LoRA r=4 alpha=8 on 4 layers: {count:,} of" in text, text
    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(out / "model" / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), \
        changed
    record = json.loads((out / "finetune.json").read_text())
    assert record["lora"]["rank"] == 4 and record["steps"] == 4
    assert record["validation_after"]["loss"] < record["validation_before"]["loss"], record


def test_the_written_folder_loads_in_transformers_with_equal_logits(base, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    _run("--from", str(base), "--chat", str(_chats(tmp_path / "c.jsonl")), "--lora-rank", "2",
         "--steps", "2", "--batch-size", "4", "--lr", "0.01", "--out", str(out))  # fmt: skip
    ids = torch.randint(6, len(WORDS), (2, 9))
    ref = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    with torch.no_grad():
        want = ref(ids).logits
    err = (_logits(out / "model", ids) - want).abs().max().item()
    assert err < 1e-4, f"qkv vs transformers on the fine-tuned folder: max error {err:.2e}"
    tok = transformers.AutoTokenizer.from_pretrained(out / "model")
    assert tok.chat_template == TEMPLATE


def test_full_fine_tuning_on_text_changes_every_weight_and_learns(base, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("\n\n".join(" ".join(f"w{(i + k) % 40 + 6}" for k in range(12))
                                 for i in range(30)), encoding="utf-8")  # fmt: skip
    out = tmp_path / "run"
    text = _run("--from", str(base), "--text", str(notes), "--steps", "5", "--batch-size", "8",
                "--lr", "0.003", "--out", str(out))  # fmt: skip
    assert "full fine-tuning" in text, text
    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(out / "model" / "model.safetensors"))
    same = [k for k in before if torch.equal(before[k], after[k])]
    assert not same, f"weights that did not train: {same}"
    assert not (out / "adapters.safetensors").exists()
    record = json.loads((out / "finetune.json").read_text())
    assert record["validation_after"]["loss"] < record["validation_before"]["loss"], record


def test_the_loss_counts_the_assistant_turns_only(base):
    """The labels of a conversation are the assistant's words and its end-of-turn token."""
    from qkv.data.packing import IGNORE_INDEX
    from qkv.pretrained import chat_document

    tok = load(base).tokenizer
    doc = chat_document(tok, [{"role": "user", "content": "w1 w2"},
                              {"role": "assistant", "content": "w3"},
                              {"role": "user", "content": "w4"},
                              {"role": "assistant", "content": "w5 w6"}])  # fmt: skip
    learned = [t for t, y in zip(doc.ids, doc.labels, strict=True) if y != IGNORE_INDEX]
    assert tok.decode(learned) == "w3 <|end|> w5 w6 <|end|>", tok.decode(learned)
    assert doc.learned == 5


@pytest.mark.parametrize(("args", "message"), [
    (["--lora-rank", "0"], "--lora-rank must be an int >= 1, got 0"),
    (["--lora-rank", "2", "--lora-targets", "*.nothing"], "--lora-targets: LoRA target "
     "'\\*.nothing' matches no linear layer"),
    (["--lora-alpha", "4"], "--lora-alpha shape LoRA adapters: give --lora-rank too"),
    (["--lora-rank", "2", "--lora-dropout", "1.5"], r"--lora-dropout must lie in \[0, 1\)"),
    (["--d-model", "64"], "--from fine-tunes a pretrained model .* drop --d-model"),
    (["--pack"], "drop --pack"),
    (["--context-parallel", "2"], "--context-parallel 2: fine-tuning \\(--from\\) trains on "
     "packed documents"),
])  # fmt: skip
def test_bad_options_are_named(base, tmp_path, args, message):
    chats = _chats(tmp_path / "c.jsonl")
    got = CliRunner().invoke(app, ["train", "--from", str(base), "--chat", str(chats), *args,
                                   "--out", str(tmp_path / "run")])  # fmt: skip
    assert got.exit_code != 0
    import re

    assert re.search(message, got.output), got.output
    assert "Traceback" not in got.output and not (tmp_path / "run").exists()


def test_bad_data_and_models_are_named(base, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", '
                   '"content": "w2"}]}\n{"messages": [{"role": "user", "content": "w1"}]}\n')
    cases = [
        (["--from", str(base), "--chat", str(bad)], f"{bad}:2: no assistant turn to learn"),
        (["--from", str(base)], "--from needs its data: --chat FILE.jsonl"),
        (["--chat", str(bad)], "--chat and --lora-rank fine-tune a pretrained model: give "
         "--from MODEL"),
        (["--from", "all-MiniLM-L6-v2", "--chat", str(bad)], "--from all-MiniLM-L6-v2: a "
         "sentence encoder; qkv train --from fine-tunes decoder language models"),
    ]  # fmt: skip
    for args, message in cases:
        got = CliRunner().invoke(app, ["train", *args, "--out", str(tmp_path / "run")])
        assert got.exit_code != 0 and message in got.output, (args, got.output)
        assert "Traceback" not in got.output


def test_a_fine_tuning_run_resumes_from_the_command_line(base, tmp_path):
    """2 steps, then --resume to 4 (that it equals 4 steps straight is
    tests/train/test_finetune.py's), and --steps not above the steps done refused."""
    _run("--from", str(base), "--chat", str(_chats(tmp_path / "c.jsonl")), "--lora-rank", "2",
         "--batch-size", "4", "--steps", "2", "--out", str(tmp_path / "split"))  # fmt: skip
    text = _run("--resume", str(tmp_path / "split"), "--steps", "4")
    assert "qkv train --resume" in text and "step 2 → 4" in text, text
    assert "trained 4 steps" in text, text
    record = json.loads((tmp_path / "split" / "finetune.json").read_text())
    assert record["status"] == "done" and record["steps"] == 4, record
    got = CliRunner().invoke(app, ["train", "--resume", str(tmp_path / "split"), "--steps", "3"])
    assert got.exit_code != 0 and "already did 4 of its 3 steps" in got.output, got.output


def test_memory_levers_reach_a_fine_tuning_run(base, tmp_path, monkeypatch):
    """--checkpoint-activations and --bf16 go into the run's TrainConfig; on a CPU without
    native bfloat16 the note is printed (the rule forced both ways)."""
    import qkv.train.memory as memory
    from qkv.checkpoint import load_checkpoint

    chats = _chats(tmp_path / "c.jsonl")
    for native in (False, True):
        monkeypatch.setattr(memory, "native_bf16", lambda device="cpu", _n=native: _n)
        out = tmp_path / f"run-{native}"
        text = _run("--from", str(base), "--chat", str(chats), "--lora-rank", "2", "--steps",
                    "2", "--batch-size", "4", "--checkpoint-activations", "--bf16", "--out",
                    str(out))  # fmt: skip
        assert ("no native bfloat16" in text) is (not native), text
        saved = load_checkpoint(out / "last").train_state["config"]
        assert saved["bf16"] is True and saved["checkpoint_activations"] is True, saved


def test_a_folder_without_a_fine_tuning_record_is_named_on_resume(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "finetune.json").write_text('{"from": "x"}')
    got = CliRunner().invoke(app, ["train", "--resume", str(run), "--steps", "4"])
    assert got.exit_code != 0 and "not a qkv fine-tuning record (no 'lora' entry)" in got.output
    assert "Traceback" not in got.output
