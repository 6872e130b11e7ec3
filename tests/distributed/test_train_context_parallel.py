"""``qkv train --context-parallel N`` under torchrun equals one process.

Real gloo process groups, started by ``python -m torch.distributed.run`` (nothing mocked):
4 ranks as 2 data-parallel groups x 2 context ranks (method ``auto``), and 2 ranks as 1 x 2
with ``--context-method ring`` and ``all_to_all`` each. Each run's loss history and weights
after 3 steps must equal ``qkv train`` on one process with the same seed and global batch,
within 1e-5 relative (float32, dropout off), and its evaluations too.

Key-projection biases are held to an absolute bound instead. Adding a constant to a row of
scores leaves the softmax unchanged, so the exact gradient of a key bias is zero and the
computed one is rounding noise whose sign depends on the order of the sums (see
tests/distributed/test_data_parallel.py): the bias stays at zero give or take lr x noise
(~1e-12 here, with AdamW's eps = 1), which no split of the work reproduces, relative to a
largest entry that is itself noise. It changes no output.

The refusals come first: one line naming the flag, in-process where they fail before any
process group, under torchrun where the number of processes is the problem.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import dp_workers as w
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from helpers import assert_close
from qkv.cli.app import app
from qkv.data.batching import LMBatch
from qkv.distributed.context import METHODS
from qkv.distributed.data_parallel import planned_world_size
from qkv.distributed.layout import shard_index
from qkv.train import TrainConfig, train_lm
from qkv.train.config import CONTEXT_METHODS
from qkv.train.context import TrainMesh, check_context_world, shard_positions

RUN_TIMEOUT_S = 120  # one torchrun job, imports included (about 5-10 s on 2 cores)
REL = 1e-5
STEPS, LR = 3, 0.5
# eps = 1 makes AdamW's step proportional to the gradient (Adam proper ignores its scale), and
# clip is out of reach, so a gradient off by any factor (a wrong weight per rank) shows.
TINY = f"""
steps = {STEPS}
batch_size = 4
block_size = 16
lr = {LR}
eps = 1.0
clip = 1e6
log_every = 1
eval_every = {STEPS}
eval_batches = 2
progress = true
plot = false
[model]
d_model = 16
num_heads = 2
num_layers = 2
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The config and a small text corpus (words of a 12-word vocabulary)."""
    root = tmp_path_factory.mktemp("cp_train")
    (root / "tiny.toml").write_text(TINY, encoding="utf-8")
    r = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "home"]
    lines = (" ".join(r.choice(words) for _ in range(12)) for _ in range(120))
    (root / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    return root


def _args(files: Path, out: Path) -> list[str]:
    return ["train", "--text", str(files / "corpus.txt"), "--config", str(files / "tiny.toml"),
            "--seed", "3", "--out", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(files) -> Path:
    """The single-process reference run."""
    out = files / "one"
    result = CliRunner().invoke(app, _args(files, out))
    assert result.exit_code == 0, result.output
    return out


def _torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    return w.ended(w.torchrun(nproc, args), RUN_TIMEOUT_S)


def _records(run: Path) -> list[dict]:
    text = (run / "metrics.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line]


def _assert_equal_runs(got: Path, want: Path, what: str) -> None:
    """Loss history, evaluations and every weight of ``last`` and ``best``: 1e-5 relative."""
    mine, theirs = _records(got), _records(want)
    assert [(r["split"], r["step"]) for r in mine] == [(r["split"], r["step"]) for r in theirs]
    for key in ("loss", "perplexity", "token_accuracy"):
        pairs = [(r[key], t[key]) for r, t in zip(mine, theirs, strict=True) if key in t]
        assert pairs, f"{what}: no {key!r} recorded"
        a, e = torch.tensor(pairs, dtype=torch.float64).T
        assert_close(a, e, atol=0.0, rtol=REL, name=f"{what}: {key} per record")
    noise = 1e-9  # key biases: zero but for rounding noise, see the module docstring
    for name in ("last", "best"):
        w.assert_same_weights(load_file(str(got / name / "model.safetensors")),
                              load_file(str(want / name / "model.safetensors")),
                              f"{what} {name}", noise=noise)  # fmt: skip
    start = load_file(str(want / "best" / "model.safetensors"))["embed.weight"]
    assert start.abs().max() > 0  # a trained model, not an empty file


# -- refusals, in-process: before any process group or run folder ---------------------------


@pytest.mark.parametrize(("extra", "message"), [
    (["--context-parallel", "2"],
     "--context-parallel 2 (config.context_parallel) shares each sequence among 2 processes, "
     "but this is one process: launch with torchrun --nproc-per-node 2"),
    (["--context-parallel", "0"], "context_parallel (--context-parallel) must be an int >= 1, "
                                  "got 0"),
    (["--context-parallel", "9"], "--context-parallel 9 exceeds block_size / 2 = 8"),
    (["--context-parallel", "2", "--context-method", "zigzag"],
     "context_method (--context-method) must be one of ('auto', 'ring', 'all_to_all'), "
     "got 'zigzag'"),
    (["--context-parallel", "2", "--fsdp"], "--context-parallel 2 does not combine with "
                                            "fsdp=True (--fsdp)"),
    (["--context-parallel", "2", "--pack"], "--context-parallel 2 does not combine with "
                                            "pack=True (--pack)"),
])  # fmt: skip
def test_bad_context_parallel_is_one_line_naming_the_flag(files, tmp_path, extra, message):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [*_args(files, out), *extra])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output and not out.exists()


def test_context_parallel_refuses_pairs_and_documents(tmp_path):
    result = CliRunner().invoke(app, ["train", "copy", "--context-parallel", "2", "--out",
                                      str(tmp_path / "run")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert (
        "--context-parallel 2: context parallelism trains language models on text "
        "(--text), not on" in result.output
    ), result.output
    config = TrainConfig(steps=1, batch_size=2, block_size=8, context_parallel=2,
                         progress=False, plot=False)  # fmt: skip
    from qkv.models import DecoderLM, DecoderLMConfig

    model = DecoderLM(DecoderLMConfig(10, d_model=8, num_heads=2, num_layers=1, max_len=8))
    with pytest.raises(ValueError, match="--context-parallel 2 trains on windows of a token "
                                         "stream; pass one stream of ids"):  # fmt: skip
        train_lm(model, [[1, 2, 3, 4], [5, 6, 7]], config)
    with pytest.raises(ValueError, match=r"--context-parallel 2 \(config.context_parallel\) "
                                         "shares each sequence among 2 processes"):  # fmt: skip
        train_lm(model, torch.arange(40) % 10, config)


def test_world_checks_and_the_planned_world(monkeypatch):
    check_context_world(1, 1)
    check_context_world(2, 4)
    with pytest.raises(ValueError, match=r"--context-parallel 2 must divide the number of "
                                         r"processes, 3: choose one of \[3\]"):  # fmt: skip
        check_context_world(2, 3)
    with pytest.raises(ValueError, match=r"--context-parallel 4 .* this is one process"):
        check_context_world(4, 1)
    assert planned_world_size() == 1
    for name, value in dict(RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert planned_world_size() == 6
    monkeypatch.setenv("WORLD_SIZE", "six")
    assert planned_world_size() is None  # init_distributed names that error
    assert CONTEXT_METHODS == METHODS
    assert str(TrainMesh(0, 2, 1, 2, group=object())) == (
        "context parallel: 2 data-parallel group(s) x 2 ranks sharing each sequence (method auto)"
    )


@pytest.mark.parametrize(("T", "size"), [(16, 2), (13, 3), (8, 4)])
def test_shard_positions_cut_every_sequence_in_the_layout(T, size):
    """Every rank's inputs and targets are the positions of shard_index; together the ranks
    hold each position once."""
    inputs = torch.arange(2 * T).view(2, T)  # (B, T)
    batch = LMBatch(inputs, inputs + 100)
    seen = []
    for rank in range(size):
        part = shard_positions(batch, rank, size)
        index = shard_index(T, size, rank)
        assert torch.equal(part.inputs, inputs[:, index])
        assert torch.equal(part.targets, inputs[:, index] + 100)
        assert part.document_ids is None
        seen.append(index)
    assert sorted(torch.cat(seen).tolist()) == list(range(T))
    with pytest.raises(ValueError, match="needs a sequence of at least"):
        shard_positions(batch, 0, T)


def test_context_parallel_that_does_not_divide_the_world_fails_under_torchrun(files, tmp_path):
    out = tmp_path / "three"
    proc = _torchrun(3, [*_args(files, out), "--context-parallel", "2"])
    assert proc.returncode != 0, proc.stdout
    # each rank refuses before the rendezvous (torchrun may stop the others first)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert errors, proc.stderr[-3000:]
    for line in errors:
        assert "--context-parallel 2 must divide the number of processes, 3" in line, line
    assert not out.exists()


# -- equality with one process, on real process groups --------------------------------------


def test_four_ranks_two_data_by_two_context_equal_one_process(files, one_process):
    out = files / "four"
    proc = _torchrun(4, [*_args(files, out), "--context-parallel", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("trained 3 steps") == 1, proc.stdout  # rank 0 alone prints
    assert "(4 processes, DDP, 2 per sequence)" in proc.stdout, proc.stdout
    assert (
        "context parallel: 2 data-parallel group(s) x 2 ranks sharing each sequence "
        "(method auto)" in proc.stdout
    ), proc.stdout
    _assert_equal_runs(out, one_process, "4 ranks (2 x 2)")


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_two_ranks_sharing_each_sequence_equal_one_process(files, one_process, method):
    out = files / f"two-{method}"
    proc = _torchrun(2, [*_args(files, out), "--context-parallel", "2",
                         "--context-method", method])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"1 data-parallel group(s) x 2 ranks sharing each sequence (method {method})" in proc.stdout
    ), proc.stdout
    _assert_equal_runs(out, one_process, f"2 ranks (1 x 2, {method})")
