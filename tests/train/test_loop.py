"""The training loop: gradient accumulation equals a larger batch, early stopping, callbacks,
what a run leaves in its folder, progress output, non-finite losses, bf16 autocast, language
modelling, evaluation, and clear errors."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from helpers import DEVICE, assert_close
from qkv.data import CharTokenizer, LMBatch, make_task
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.train import (
    Job,
    LossParts,
    ProgressBar,
    TrainConfig,
    evaluate_lm,
    evaluate_seq2seq,
    fit,
    load_checkpoint,
    plot_loss_curve,
    token_loss,
    train_lm,
    train_seq2seq,
)

TOK = CharTokenizer.fit("0123456789")
TASK = make_task("copy", n_train=40, n_valid=6, n_test=6, max_len=4, seed=0)
QUIET = dict(progress=False, plot=False)


def _s2s(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return Seq2SeqTransformer(Seq2SeqConfig(TOK.vocab_size, TOK.vocab_size, d_model=16,
                                            num_heads=2, d_ff=32, num_encoder_layers=1,
                                            num_decoder_layers=1, dropout=dropout, max_len=16))  # fmt: skip


def _lm(seed=0, V=20):
    torch.manual_seed(seed)
    return DecoderLM(DecoderLMConfig(V, d_model=16, num_layers=1, num_heads=2, max_len=32))


def _lm_job(model, batches):
    return Job(model=model, epoch_batches=lambda epoch: batches,
               batch_tokens=lambda b: b.targets.numel(),
               loss=lambda m, b: token_loss(m(b.inputs), b.targets, pad_id=None))  # fmt: skip


def _final_grads(model):
    """Record each parameter's gradient after every backward: the last one is the step's."""
    grads = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.clone()))
    return grads


def test_accumulation_equals_one_larger_batch():
    torch.manual_seed(0)
    window = torch.randint(0, 20, (8, 9))
    halves = [LMBatch(window[:4, :-1], window[:4, 1:]), LMBatch(window[4:, :-1], window[4:, 1:])]
    whole = [LMBatch(window[:, :-1], window[:, 1:])]
    config = TrainConfig(steps=1, lr=1e-2, warmup=1, clip=None, device=str(DEVICE), **QUIET)
    a, b = _lm(), _lm()
    grads_a, grads_b = _final_grads(a), _final_grads(b)
    fit(_lm_job(a, halves), config.replace(accumulate=2))
    fit(_lm_job(b, whole), config)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == len(list(a.parameters()))
    for name, g in grads_a.items():
        assert_close(g, grads_b[name], atol=1e-6, name=f"grad {name}")
    assert (a.embed.weight - _lm().embed.weight).abs().max() > 1e-3, "training changed nothing"


def test_early_stopping_stops_after_patience_evaluations():
    config = TrainConfig(steps=30, batch_size=8, lr=1e-7, warmup=1, eval_every=2, patience=2,
                         metric="exact_match", **QUIET)  # fmt: skip
    result = train_seq2seq(_s2s(), TASK, TOK, TOK, config)
    # exact match stays 0: best at step 2, no improvement at 4 and 6 -> stop at 6.
    assert result.stopped == "early_stopping" and result.steps == 6
    assert result.best_step == 2 and result.best_metric == 0.0
    assert [e["step"] for e in result.evals] == [2, 4, 6]


def test_callbacks_see_steps_and_evals_and_can_stop():
    events = []

    def record(event):
        events.append(event)
        return event["event"] == "step" and event["step"] == 4

    config = TrainConfig(steps=10, batch_size=8, eval_every=2, **QUIET)
    result = train_seq2seq(_s2s(), TASK, TOK, TOK, config, callbacks=[record])
    assert result.stopped == "callback" and result.steps == 4
    kinds = [(e["event"], e["step"]) for e in events]
    # Step 4 asks to stop; its evaluation (eval_every=2) still runs, then the run ends.
    assert kinds == [("step", 1), ("step", 2), ("eval", 2), ("step", 3), ("step", 4), ("eval", 4)]
    assert set(events[0]) == {"event", "step", "loss", "ce", "lr", "tokens"}
    # copy targets of 1-4 digits: no BLEU (it needs 4-grams), their mean length instead
    want = {"exact_match", "bleu_ref_tokens", "chrf", "loss", "token_accuracy", "perplexity"}
    assert want == set(events[2]) - {"event", "step"}


def test_run_folder_holds_metrics_plot_and_checkpoints(tmp_path):
    config = TrainConfig(steps=6, batch_size=8, eval_every=3, log_every=2, progress=False,
                         run_dir=str(tmp_path / "run"))  # fmt: skip
    result = train_seq2seq(_s2s(), TASK, TOK, TOK, config)
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in valid] == [3, 6]
    assert {"loss", "lr", "tokens_per_s"} <= set(train[0]) and "chrf" in valid[0]
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    best = load_checkpoint(run / "best")
    assert best.train_state is None and set(best.tokenizers) == {"src", "tgt"}
    assert best.config["info"]["step"] == result.best_step
    last = load_checkpoint(run / "last")
    assert last.train_state["step"] == 6 and last.train_state["config"]["steps"] == 6
    assert result.tokens_per_second > 0 and result.final_metrics["step"] == 6


def test_plain_progress_lines_when_not_a_terminal(capsys):
    stream = io.StringIO()
    bar = ProgressBar(10, log_every=5, stream=stream)
    for step in range(1, 11):
        bar.update(step, loss=1.0 / step, lr=1e-3, tokens_per_s=1234.0)
    bar.message("eval done")
    lines = stream.getvalue().splitlines()
    assert lines == [
        "step 5/10  loss 0.2000  lr 1.00e-03  1,234 tok/s",
        "step 10/10  loss 0.1000  lr 1.00e-03  1,234 tok/s",
        "eval done",
    ]
    config = TrainConfig(steps=2, batch_size=8, log_every=1, plot=False)
    train_seq2seq(_s2s(), TASK.pairs("train"), TOK, TOK, config)
    out = capsys.readouterr().out
    assert "step 1/2  loss" in out and "step 2/2" in out and "tok/s" in out


def test_rich_progress_bar_runs():
    bar = ProgressBar(3, rich=True)
    for step in (1, 2, 3):
        bar.update(step, loss=0.5, lr=1e-3, tokens_per_s=10.0)
    bar.message("hello")
    bar.close()
    bar.close()


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'qkv\[plots\]'"):
        plot_loss_curve([{"step": 1, "loss": 1.0}], [], tmp_path / "x.png")
    config = TrainConfig(steps=2, batch_size=8, log_every=5, run_dir=str(tmp_path / "r"))
    train_seq2seq(_s2s(), TASK.pairs("train"), TOK, TOK, config)
    assert "no loss.png" in capsys.readouterr().out and not (tmp_path / "r" / "loss.png").exists()


def test_non_finite_loss_stops_before_the_update():
    model = _lm()
    before = model.embed.weight.clone()

    def loss(m, batch):
        parts = token_loss(m(batch.inputs), batch.targets, pad_id=None)
        return LossParts(parts.loss_sum * float("nan"), 0.0, parts.tokens, 0)

    window = torch.randint(0, 20, (2, 9))
    job = Job(model=model, epoch_batches=lambda e: [LMBatch(window[:, :-1], window[:, 1:])],
              batch_tokens=lambda b: b.targets.numel(), loss=loss)  # fmt: skip
    with pytest.raises(FloatingPointError, match=r"training loss is nan at step 1"):
        fit(job, TrainConfig(steps=2, device=str(DEVICE), **QUIET))
    assert torch.equal(model.embed.weight, before)


def test_bf16_autocast_and_token_budget_batches_train():
    config = TrainConfig(steps=3, batch_tokens=30, bf16=True, **QUIET)
    result = train_seq2seq(_s2s(), TASK.pairs("train"), TOK, TOK, config)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result.history)
    # Strings of 1-4 digits: a batch of at most 30 padded tokens holds at most 6 of 5 tokens.
    assert all(h["tokens"] <= 30 for h in result.history)


def test_train_lm_learns_a_repeating_pattern_and_evaluates():
    ids = torch.tensor([4, 5, 6, 7, 8] * 80)
    config = TrainConfig(steps=40, batch_size=8, block_size=16, lr=1e-2, warmup=5,
                         schedule="cosine", eval_every=20, eval_batches=2, **QUIET)  # fmt: skip
    model = _lm()
    before = evaluate_lm(model, ids[:200], block_size=16)
    result = train_lm(model, ids, config, valid_ids=ids[:200])
    after = evaluate_lm(model, ids[:200], block_size=16)
    assert before["loss"] > 2.5 and after["loss"] < 1.0, (before, after)
    assert after["token_accuracy"] > 0.95 and after["perplexity"] < 2.7
    # The run's last evaluation covered the same 12 windows (2 batches of 8 >= 12).
    assert result.evals[-1]["step"] == 40
    assert result.evals[-1]["loss"] == pytest.approx(after["loss"], rel=1e-6)


def test_evaluate_seq2seq_on_a_perfect_and_a_random_model():
    pairs = TASK.pairs("test")
    metrics = evaluate_seq2seq(_s2s(), pairs, TOK, TOK, batch_size=4)
    assert set(metrics) == {"loss", "perplexity", "token_accuracy", "exact_match",
                            "bleu_ref_tokens", "chrf"}  # fmt: skip
    assert metrics["exact_match"] == 0.0 and metrics["loss"] > 1.0
    beam = evaluate_seq2seq(_s2s(), pairs, TOK, TOK, batch_size=4, beam=2)
    assert beam["loss"] == metrics["loss"]  # teacher-forced part is the same


@pytest.mark.parametrize("call, err, match", [
    (lambda: train_lm(_lm(), torch.arange(10) % 5, TrainConfig(batch_tokens=64)), ValueError, "train_lm needs config.batch_size"),
    (lambda: train_lm(_lm(), torch.arange(10) % 5, TrainConfig(block_size=16)), ValueError, "ids must hold at least block_size \\+ 1 = 17 tokens, got 10"),
    (lambda: train_lm(_lm(), torch.arange(100), TrainConfig(block_size=16)), ValueError, "ids has ids outside the model's vocabulary \\[0, 20\\)"),
    (lambda: train_lm(_lm(), torch.arange(100) % 5, TrainConfig(block_size=8, metric="bleu"), valid_ids=torch.arange(50) % 5), ValueError, "config.metric='bleu' is not measured here"),
    (lambda: train_lm(_lm(), torch.arange(100) % 5, TrainConfig(block_size=8, patience=2)), ValueError, "patience=2 needs validation data, got none"),
    (lambda: train_seq2seq(_s2s(), [], TOK, TOK, TrainConfig()), ValueError, "the training data holds no pairs"),
    (lambda: train_seq2seq(_s2s(), TASK, CharTokenizer.fit("0123456789abc"), TOK, TrainConfig()), ValueError, "src_tok has 17 tokens but the model's src_vocab_size is 14"),
    (lambda: train_seq2seq(_s2s(), TASK, TOK, TOK, TrainConfig(), resume=True), ValueError, "resume=True needs config.run_dir"),
    (lambda: train_seq2seq(_s2s(), TASK, TOK, TOK, TrainConfig(), resume="/nonexistent/last"), FileNotFoundError, "resume: no checkpoint at /nonexistent/last"),
    (lambda: evaluate_seq2seq(_s2s(), [], TOK, TOK), ValueError, "pairs must hold at least one"),
])  # fmt: skip
def test_errors(call, err, match):
    with pytest.raises(err, match=match):
        call()
