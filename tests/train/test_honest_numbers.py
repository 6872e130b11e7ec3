"""Honest training numbers: the unsmoothed cross-entropy recorded beside the label-smoothed
loss (checked against torch on the same logits), both shown and plotted with a legend; BLEU
reported only where it means something (references of 4+ tokens on average)."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from qkv.data import CharTokenizer, make_task
from qkv.data.batching import bucket_batches, encode_pairs
from qkv.models import Seq2SeqConfig, Seq2SeqTransformer
from qkv.train import ProgressBar, TrainConfig, bleu, evaluate_seq2seq, train_seq2seq
from qkv.train.metrics import BLEU_MIN_TOKENS, bleu_applies, bleu_text, mean_ref_tokens
from qkv.train.progress import loss_curves

TOK = CharTokenizer.fit("0123456789")
TASK = make_task("copy", n_train=40, n_valid=6, n_test=6, max_len=4, seed=0)


def _s2s(seed=0):
    torch.manual_seed(seed)
    return Seq2SeqTransformer(Seq2SeqConfig(TOK.vocab_size, TOK.vocab_size, d_model=16,
                                            num_heads=2, d_ff=32, num_encoder_layers=1,
                                            num_decoder_layers=1, dropout=0.0, max_len=16))  # fmt: skip


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("batch_size", [5, 8])
def test_first_step_records_smoothed_loss_and_plain_cross_entropy(eps, batch_size):
    """Step 1's ``loss`` and ``ce`` equal torch's cross-entropy (with and without label
    smoothing) of the untrained model's logits on the first batch."""
    config = TrainConfig(steps=1, batch_size=batch_size, label_smoothing=eps, progress=False,
                         plot=False, seed=5)  # fmt: skip
    model = _s2s()
    before = copy.deepcopy(model)
    result = train_seq2seq(model, TASK, TOK, TOK, config)
    examples = encode_pairs(TASK.pairs("train"), TOK, TOK)
    batch = next(iter(bucket_batches(examples, batch_size=batch_size, shuffle=True,
                                     seed=config.seed)))  # fmt: skip
    with torch.no_grad():
        logits = before(batch.src, batch.tgt_in)  # (B, T, V)
    flat, target = logits.reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1)  # (B*T, V)
    want_ce = F.cross_entropy(flat, target, ignore_index=0)
    want_loss = F.cross_entropy(flat, target, ignore_index=0, label_smoothing=eps)
    (step,) = result.history
    assert_close(step["ce"], want_ce, atol=1e-6, rtol=1e-6, name="unsmoothed ce")
    assert_close(step["loss"], want_loss, atol=1e-6, rtol=1e-6, name="smoothed loss")
    if eps == 0.0:
        assert step["ce"] == step["loss"]
    else:  # smoothing pays for the mass spread over the vocabulary: the objective is higher
        assert step["loss"] > step["ce"] + 1e-3, step


def test_log_bar_and_plot_show_both_numbers(tmp_path):
    config = TrainConfig(steps=4, batch_size=8, label_smoothing=0.1, log_every=2, eval_every=2,
                         progress=False, plot=True, run_dir=str(tmp_path / "run"))  # fmt: skip
    result = train_seq2seq(_s2s(), TASK, TOK, TOK, config)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:  # the window means of both numbers
        steps = [h for h in result.history if r["step"] - 2 < h["step"] <= r["step"]]
        assert r["ce"] == pytest.approx(sum(h["ce"] for h in steps) / 2, rel=1e-12)
        assert r["loss"] == pytest.approx(sum(h["loss"] for h in steps) / 2, rel=1e-12)
        assert r["loss"] > r["ce"]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    labels = [c[0] for c in loss_curves(result.history, result.evals, smoothing=0.1)]
    assert labels == ["train loss (label smoothing 0.1)", "train cross-entropy (unsmoothed)",
                      "valid cross-entropy"]  # fmt: skip
    assert [c[0] for c in loss_curves(result.history, [], smoothing=0.0)] == ["train loss"]
    # a history from before "ce" was recorded still plots its loss
    old = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert [c[0] for c in loss_curves(old, [], smoothing=0.1)] == [
        "train loss (label smoothing 0.1)"]  # fmt: skip


def test_progress_line_names_both_losses():
    out = io.StringIO()
    bar = ProgressBar(2, log_every=1, stream=out, rich=False)
    bar.update(1, loss=1.25, lr=1e-3, tokens_per_s=10.0, ce=0.5)
    bar.update(2, loss=1.25, lr=1e-3, tokens_per_s=10.0)
    first, second = out.getvalue().splitlines()
    assert "smoothed loss 1.2500  ce 0.5000" in first
    assert "loss 1.2500" in second and "smoothed" not in second and "ce " not in second


# ---------------------------------------------------------------- BLEU where it means something


def test_short_references_make_perfect_bleu_zero_which_is_why_it_is_left_out():
    refs = ["12", "345", "6"]  # 2 characters on average
    assert bleu(refs, refs, tokenize="char") == 0.0  # sacrebleu's corpus BLEU: no 4-grams
    ok, mean = bleu_applies(refs, tokenize="char")
    assert not ok and mean == pytest.approx(2.0)
    long = ["2015-03-03", "1979-03-14"]
    ok, mean = bleu_applies(long, tokenize="char")
    assert ok and mean == 10.0 and bleu(long, long, tokenize="char") == pytest.approx(100.0)
    # 13a counts words: "2015 - 03 - 03" is 5 tokens, "a b c" 3
    assert mean_ref_tokens(["2015-03-03"]) == 5 and mean_ref_tokens(["a b c"]) == 3
    assert bleu_applies(["a b c d"])[0] and not bleu_applies(["a b c"])[0]
    assert BLEU_MIN_TOKENS == 4


def test_bleu_text():
    assert bleu_text({"bleu": 98.123}) == "BLEU 98.1"
    assert bleu_text({"bleu_ref_tokens": 2.5}) == (
        "BLEU n/a (targets average 2.5 tokens; BLEU needs 4-grams)")  # fmt: skip
    assert bleu_text({"loss": 1.0}) is None


def test_evaluate_seq2seq_leaves_out_bleu_on_short_targets_only():
    short = evaluate_seq2seq(_s2s(), TASK.pairs("test"), TOK, TOK, batch_size=4)
    refs = [t for _, t in TASK.pairs("test")]
    assert "bleu" not in short
    assert short["bleu_ref_tokens"] == pytest.approx(sum(map(len, refs)) / len(refs))
    long = [("1234567", "1234567"), ("98765", "98765")]
    metrics = evaluate_seq2seq(_s2s(), long, TOK, TOK, batch_size=4)
    assert "bleu_ref_tokens" not in metrics and 0.0 <= metrics["bleu"] <= 100.0


def test_watching_bleu_on_short_targets_is_a_clear_error():
    config = TrainConfig(steps=2, batch_size=8, eval_every=2, metric="bleu", progress=False,
                         plot=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"config.metric='bleu': the validation targets "
                       r"average \d\.\d tokens, too short for BLEU"):  # fmt: skip
        train_seq2seq(_s2s(), TASK, TOK, TOK, config)
