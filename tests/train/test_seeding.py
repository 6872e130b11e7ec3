"""``--seed`` makes a run reproducible: the seed is set before anything random happens.

Two ``qkv train`` runs with one config and seed must be bitwise equal (weights and optimizer
state), whatever the random generators went through before; another seed must differ. Data
parallelism relies on it (every rank builds the same model and data).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from qkv.cli.app import app
from qkv.train.runs import build_model

TINY = """
steps = 3
batch_size = 8
eval_examples = 4
progress = false
plot = false
[data]
n_train = 40
n_valid = 4
n_test = 4
max_len = 4
[model]
d_model = 16
num_heads = 2
d_ff = 32
dropout = 0.1
"""


def _train(root: Path, name: str, seed: int) -> dict[str, torch.Tensor]:
    torch.rand(7)  # whatever ran before must not matter
    out = root / name
    result = CliRunner().invoke(app, ["train", "copy", "--config", str(root / "tiny.toml"),
                                      "--layers", "1", "--seed", str(seed), "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    return {**load_file(str(out / "last" / "model.safetensors")),
            **load_file(str(out / "last" / "train_state.safetensors"))}  # fmt: skip


def test_two_cli_runs_with_one_seed_are_bitwise_equal(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY, encoding="utf-8")
    a, b, c = _train(tmp_path, "a", 5), _train(tmp_path, "b", 5), _train(tmp_path, "c", 6)
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"same seed, different tensors: {unequal[:5]}"
    weights = [k for k in a if not k.startswith(("optimizer.", "rng."))]
    assert all(not torch.equal(a[k], c[k]) for k in weights if a[k].numel() > 1 and
               a[k].float().std() > 0), "another seed gave some identical tensors"  # fmt: skip


def test_build_model_seeds_before_drawing_weights():
    vocab = {"src": 12, "tgt": 12}
    options = {"d_model": 16, "layers": 1, "heads": 2}
    first = build_model("task", {}, options, vocab, 16, seed=3).state_dict()
    torch.rand(11)
    again = build_model("task", {}, options, vocab, 16, seed=3).state_dict()
    other = build_model("task", {}, options, vocab, 16, seed=4).state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["src_embed.weight"], other["src_embed.weight"])
    lm = build_model("text", {}, options, {"text": 12}, 16, seed=3).state_dict()
    torch.rand(3)
    assert all(torch.equal(v, build_model("text", {}, options, {"text": 12}, 16,
                                          seed=3).state_dict()[k]) for k, v in lm.items())  # fmt: skip
