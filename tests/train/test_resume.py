"""Exact resume: a run split in two (stopped, interrupted by Ctrl-C between steps or in the
middle of one, continued in a fresh process) gives bit for bit the loss curve, evaluations
and weights of the uninterrupted run, with dropout on, gradient accumulation and several
epochs of shuffled data."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.data import CharTokenizer, make_task
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.train import TrainConfig, load_checkpoint, train_lm, train_seq2seq

TOK = CharTokenizer.fit("0123456789")
TASK = make_task("copy", n_train=40, n_valid=6, n_test=0, max_len=4, seed=0)
# 40 pairs / 8 = 5 batches an epoch; 2 per step: 12 steps cross 4 epoch boundaries, and the
# split after step 6 falls in the middle of an epoch. Dropout 0.2 makes the RNG matter.
CONFIG = TrainConfig(steps=12, batch_size=8, accumulate=2, lr=3e-3, warmup=3, eval_every=3,
                     schedule="cosine", progress=False, plot=False, seed=3)  # fmt: skip


def model(seed: int = 0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    config = Seq2SeqConfig(TOK.vocab_size, TOK.vocab_size, d_model=16, num_heads=2, d_ff=32,
                           num_encoder_layers=1, num_decoder_layers=1, dropout=0.2, max_len=16)  # fmt: skip
    return Seq2SeqTransformer(config)


def scramble() -> None:
    """Leave every RNG somewhere else, as a new process would."""
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)


def resume_here(run_dir: str):
    """The second half of a run: fresh model (other init), scrambled RNGs, resume=True."""
    scramble()
    return train_seq2seq(model(seed=99), TASK, TOK, TOK, CONFIG.replace(run_dir=run_dir), resume=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("a")
    m = model()
    result = train_seq2seq(m, TASK, TOK, TOK, CONFIG.replace(run_dir=str(run_dir)))
    return result, {k: v.clone() for k, v in m.state_dict().items()}


def _assert_same_run(result, reference, weights=None):
    ref, ref_weights = reference
    assert len(result.history) == len(ref.history) == CONFIG.steps
    for got, want in zip(result.history, ref.history, strict=True):
        assert got == want, f"step {want['step']}: {got} vs {want}"
    assert result.evals == ref.evals
    if weights is not None:
        for k, v in ref_weights.items():
            assert torch.equal(weights[k], v), f"weight {k} differs"


def test_reference_run_is_not_trivial(reference):
    ref, _ = reference
    losses = [h["loss"] for h in ref.history]
    assert losses[-1] < losses[0] and len(set(losses)) == len(losses)
    assert [e["step"] for e in ref.evals] == [3, 6, 9, 12]


def test_half_run_then_resume_in_a_new_process(tmp_path, reference):
    run_dir = str(tmp_path / "b")
    # First half: stop after 6 steps with the same config (a callback asks to stop).
    first = train_seq2seq(model(), TASK, TOK, TOK, CONFIG.replace(run_dir=run_dir),
                          callbacks=[lambda e: e["event"] == "step" and e["step"] == 6])  # fmt: skip
    assert first.stopped == "callback" and first.steps == 6
    # Second half in a fresh Python process.
    here = Path(__file__).parent
    code = (
        "import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import torch; "
        "torch.set_num_threads(1); import test_resume as t; r = t.resume_here(sys.argv[3]); "
        "print(json.dumps({'history': r.history, 'evals': r.evals}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    out = subprocess.run([sys.executable, "-c", code, str(here), str(here.parent), run_dir],
                         capture_output=True, text=True, env=env, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    second = json.loads(out.stdout.strip().splitlines()[-1])
    ref, ref_weights = reference
    assert second["history"] == ref.history
    assert second["evals"] == ref.evals
    weights = load_checkpoint(Path(run_dir) / "last", model(seed=5)).model.state_dict()
    for k, v in ref_weights.items():
        assert torch.equal(weights[k], v), f"weight {k} differs"


def test_ctrl_c_between_steps_checkpoints_and_resumes_exactly(tmp_path, reference):
    run_dir = str(tmp_path / "c")

    def interrupt(event):
        if event["event"] == "step" and event["step"] == 5:
            raise KeyboardInterrupt

    m = model()
    with pytest.raises(KeyboardInterrupt):
        train_seq2seq(m, TASK, TOK, TOK, CONFIG.replace(run_dir=run_dir), callbacks=[interrupt])
    state = json.loads((tmp_path / "c" / "last" / "train_state.json").read_text())
    assert state["step"] == 5
    result = resume_here(run_dir)
    _assert_same_run(result, reference, load_checkpoint(tmp_path / "c" / "last", model(1)).model.state_dict())


def test_ctrl_c_inside_a_step_keeps_the_last_whole_step(tmp_path, reference):
    run_dir = str(tmp_path / "d")
    m = model()
    calls = []

    def hook(module, args, output):
        if module.training:
            calls.append(1)
            if len(calls) == 10:  # step 5, second micro-batch: after one backward already
                raise KeyboardInterrupt

    m.register_forward_hook(hook)
    with pytest.raises(KeyboardInterrupt):
        train_seq2seq(m, TASK, TOK, TOK, CONFIG.replace(run_dir=run_dir))
    state = json.loads((tmp_path / "d" / "last" / "train_state.json").read_text())
    assert state["step"] == 4, "a half-done step must not be saved"
    _assert_same_run(resume_here(run_dir), reference)


def test_lm_resume_is_exact(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(4, 20, (400,))
    config = TrainConfig(steps=8, batch_size=4, block_size=16, lr=1e-2, warmup=2, progress=False,
                         plot=False, eval_every=4, eval_batches=2)  # fmt: skip

    def lm(seed):
        torch.manual_seed(seed)
        return DecoderLM(DecoderLMConfig(20, d_model=16, num_layers=1, num_heads=2, max_len=16, dropout=0.3))

    full = train_lm(lm(0), ids, config.replace(run_dir=str(tmp_path / "a")), valid_ids=ids[:100])
    train_lm(lm(0), ids, config.replace(steps=4, run_dir=str(tmp_path / "b")), valid_ids=ids[:100])
    scramble()
    rest = train_lm(lm(7), ids, config.replace(run_dir=str(tmp_path / "b")), valid_ids=ids[:100],
                    resume=str(tmp_path / "b" / "last"))  # fmt: skip
    assert rest.history == full.history and rest.evals == full.evals
