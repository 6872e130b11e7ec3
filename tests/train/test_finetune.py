"""``qkv.train.finetuning`` from Python, on a tiny pretrained decoder (``tests/finetune_refs.py``).
References: the adapted model of the run's best checkpoint against the merged Hugging Face
folder (equal logits), and an uninterrupted run against one stopped and resumed (given its
model and documents in memory): equal losses, tokens and weights. The command line over the
same calls is ``tests/cli/test_train_from.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune_refs import WORDS, tiny_base, write_chats
from qkv.checkpoint.adapters import load_adapters
from qkv.nn.lora import LoRALinear
from qkv.pretrained import chat_documents, load
from qkv.train import FineTuneSpec, LoRAOptions, finetune, load_checkpoint, resume_finetune

# A constant schedule: the same learning rate at every step, whatever the planned total.
SETTINGS = dict(steps=4, batch_size=4, lr=0.01, schedule="constant", warmup=1, eval_every=2,
                progress=False, plot=False)  # fmt: skip
LORA = LoRAOptions(rank=2, dropout=0.1, targets=("*.q_proj", "*.v_proj"))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_base(tmp_path_factory.mktemp("base") / "tiny-llama")


@pytest.fixture(scope="module")
def straight(base, tmp_path_factory):
    """Four steps without a stop: ``(the run, the lines it said, the chat file)``."""
    root = tmp_path_factory.mktemp("straight")
    chats, lines = write_chats(root / "chats.jsonl"), []
    run = finetune(FineTuneSpec(str(base), chats, root / "run", lora=LORA, train=SETTINGS),
                   say=lines.append)  # fmt: skip
    return run, lines, chats


def test_finetune_writes_the_run_and_its_merged_model_equals_the_adapted_one(base, straight):
    run, lines, chats = straight
    out = run.run_dir
    for name in ("model/config.json", "model/model.safetensors", "adapters.safetensors",
                 "best/config.json", "last/config.json", "metrics.jsonl"):  # fmt: skip
        assert (out / name).is_file(), name
    assert lines[0].startswith(f"qkv.train.finetuning {base}: LoRA r=2 alpha=4 on 4 layers"), lines
    record = json.loads((out / "finetune.json").read_text())
    assert {k: record[k] for k in ("base", "data", "kind", "status", "steps")} == {
        "base": str(base), "data": str(chats), "kind": "chat", "status": "done", "steps": 4}
    assert record["lora"] == {"rank": 2, "alpha": 4.0, "dropout": 0.1,
                              "targets": ["*.q_proj", "*.v_proj"]}  # fmt: skip
    assert run.after == record["validation_after"] and run.after["loss"] < run.before["loss"]
    # best/ holds the adapted model (adapters rebuilt), as do the adapters on the base model;
    # model/ holds the same weights merged
    ids = torch.randint(6, len(WORDS), (2, 11), generator=torch.Generator().manual_seed(0))
    merged = load(out / "model").model.eval()
    for where, adapted in (("best/", load_checkpoint(out / "best").model),
                           ("adapters on the base", load_adapters(
                               load(base).model, out / "adapters.safetensors"))):  # fmt: skip
        layers = [m for m in adapted.modules() if isinstance(m, LoRALinear)]
        assert len(layers) == 4 and any(bool(m.lora_B.abs().max() > 0) for m in layers), where
        with torch.no_grad():
            want, got = adapted.eval()(ids), merged(ids)  # (B, T, V)
        # float32 rounding of W x + s B A x against (W + s B A) x: an ulp per term of a
        # d_model dot product, through every layer, relative to the logits' size
        cfg = adapted.config
        bound = torch.finfo(torch.float32).eps * cfg.d_model * cfg.num_layers * float(
            want.abs().max())  # fmt: skip
        err = float((got - want).abs().max())
        assert err <= bound, f"merged vs {where}: max error {err:.2e} (bound {bound:.2e})"


def test_a_resumed_run_ends_as_the_uninterrupted_one(base, straight, tmp_path):
    """Two steps, given the model and documents in memory, then resumed to four, equals the
    four steps of ``straight``: the same operations in the same order, so the bound is 0."""
    run, _, chats = straight
    bundle = load(base)
    docs = chat_documents(bundle.tokenizer, chats)
    split = tmp_path / "split"
    finetune(FineTuneSpec(bundle, docs, split, lora=LORA, train={**SETTINGS, "steps": 2}),
             say=lambda line: None)  # fmt: skip
    record = json.loads((split / "finetune.json").read_text())
    assert record["base"] is None and record["data"] is None and record["steps"] == 2
    with pytest.raises(ValueError, match="the run's base was given in memory"):
        resume_finetune(split, steps=4, data=docs)
    lines: list[str] = []
    resumed = resume_finetune(split, steps=4, base=load(base), data=docs, say=lines.append)
    assert lines[0] == f"qkv.train.resume_finetune {split}: step 2 → 4", lines
    assert resumed.result.steps == 4
    want = {(h["step"], h["loss"], h["tokens"]) for h in run.result.history}
    got = {(h["step"], h["loss"], h["tokens"]) for h in resumed.result.history}
    assert got and got <= want, (got, want)
    for name in ("adapters.safetensors", "model/model.safetensors"):
        a, b = load_file(str(split / name)), load_file(str(run.run_dir / name))
        assert a.keys() == b.keys(), name
        for key in b:
            err = float((a[key] - b[key]).abs().max())
            assert err == 0.0, f"{name} {key}: resumed vs straight, max error {err:.2e}"
    with pytest.raises(ValueError, match="already did 4 of its 3 steps; give steps above"):
        resume_finetune(split, steps=3, base=load(base), data=docs)


def test_errors_name_the_spec_s_fields(base, straight, tmp_path):
    run, _, chats = straight
    cases = [
        (lambda: LoRAOptions(0), "LoRAOptions.rank must be an int >= 1, got 0"),
        (lambda: LoRAOptions(2, dropout=1.0), r"LoRAOptions.dropout must lie in \[0, 1\)"),
        (lambda: LoRAOptions(2, targets=()), "LoRAOptions.targets must name layer patterns"),
        (lambda: FineTuneSpec(base, chats, tmp_path / "a", kind="pairs"),
         "FineTuneSpec.kind must be 'chat' or 'text', got 'pairs'"),
        (lambda: finetune(FineTuneSpec(str(base), chats, run.run_dir)),
         f"out {run.run_dir} already holds a run"),
        (lambda: finetune(FineTuneSpec(str(base), chats, tmp_path / "b",
                                       lora=LoRAOptions(2, targets=("*.nothing",)))),
         r"LoRAOptions.targets: LoRA target '\*.nothing' matches no linear layer"),
        (lambda: finetune(FineTuneSpec(str(base), chats, tmp_path / "c",
                                       train={"block_size": 999})),
         "block_size 999 is longer than the model's 128 positions; lower it in train"),
    ]  # fmt: skip
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert not any((tmp_path / n).exists() for n in "abc")
