"""Learning-rate schedules (the paper's formula, cosine end points), AdamW weight-decay
groups, the label-smoothed loss against a float64 hand computation, and the metrics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.train import (
    TrainConfig,
    bleu,
    chrf,
    exact_match,
    lr_at,
    make_optimizer,
    paper_peak_lr,
    parameter_groups,
    perplexity,
    token_accuracy,
    token_loss,
)


@pytest.mark.parametrize("d_model, warmup", [(512, 4000), (64, 37)])
def test_inverse_sqrt_is_the_papers_schedule(d_model, warmup):
    config = TrainConfig(lr=paper_peak_lr(d_model, warmup), warmup=warmup, steps=10 * warmup,
                         schedule="inverse_sqrt")  # fmt: skip
    for step in [1, 2, warmup // 2, warmup - 1, warmup, warmup + 1, 3 * warmup, 10 * warmup]:
        paper = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert abs(lr_at(step, config) - paper) <= 1e-12 * paper, f"step {step}"


def test_cosine_warms_up_then_decays_to_the_floor():
    config = TrainConfig(lr=1.0, warmup=10, steps=110, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(1, config) == pytest.approx(0.1)
    assert lr_at(10, config) == pytest.approx(1.0)
    assert lr_at(60, config) == pytest.approx(0.55)  # halfway: mean of peak and floor
    assert lr_at(110, config) == pytest.approx(0.1)
    assert lr_at(500, config) == pytest.approx(0.1)  # past the end: stays at the floor
    lrs = [lr_at(s, config) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs)), "cosine must not rise"


def test_constant_schedule_and_step_errors():
    config = TrainConfig(lr=0.5, warmup=0, schedule="constant")
    assert lr_at(1, config) == 0.5 == lr_at(10_000, config)
    with pytest.raises(ValueError, match=r"step must be an int >= 1 \(steps count from 1\), got 0"):
        lr_at(0, config)
    with pytest.raises(ValueError, match=r"d_model must be a positive int, got 0"):
        paper_peak_lr(0, 10)


def test_weight_decay_only_on_matrices():
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt2_style(30, d_model=16, num_layers=1, num_heads=2, max_len=8))
    decay, keep = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    keep_names = {names[id(p)] for p in keep["params"]}
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert "embed.weight" in keep_names, "token embeddings (tied with lm_head) must not decay"
    assert "pos.weight" in keep_names, "learned positions must not decay"
    assert all(n.endswith("bias") or "norm" in n or n in ("embed.weight", "pos.weight")
               for n in keep_names), keep_names  # fmt: skip
    assert decay_names and all(dict(model.named_parameters())[n].dim() == 2 for n in decay_names)
    # Every parameter once (the tied lm_head weight is the embedding).
    assert len(decay["params"]) + len(keep["params"]) == len(list(model.parameters()))
    optimizer = make_optimizer(model, TrainConfig())
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.98)


def _loss_by_hand(logits, targets, pad, eps):
    """Label-smoothed cross-entropy in float64: (1 - eps) * nll + eps * mean over V of -log p."""
    logp = logits.double().log_softmax(-1)
    total = 0.0
    for b in range(targets.shape[0]):
        for t in range(targets.shape[1]):
            y = int(targets[b, t])
            if y == pad:
                continue
            total += (1 - eps) * -logp[b, t, y] + eps * -logp[b, t].mean()
    return total


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.4])
def test_token_loss_matches_hand_computation(eps):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)
    targets = torch.randint(1, 11, (3, 7))
    targets[0, 5:] = 0  # padding
    targets[2, 2:] = 0
    parts = token_loss(logits, targets, pad_id=0, label_smoothing=eps)
    expected = _loss_by_hand(logits.detach(), targets, 0, eps)
    assert_close(parts.loss_sum.detach(), torch.tensor(float(expected)), atol=1e-5, rtol=1e-6, name="loss")
    assert parts.tokens == int((targets != 0).sum())
    nll = F.cross_entropy(logits.detach().reshape(-1, 11), targets.reshape(-1), ignore_index=0, reduction="sum")
    assert abs(parts.nll_sum - float(nll)) < 1e-4
    hits = (logits.detach().argmax(-1) == targets) & (targets != 0)
    assert parts.correct == int(hits.sum())
    # Gradients flow only from real positions.
    parts.loss_sum.backward()
    assert float(logits.grad[0, 5:].abs().max()) == 0.0


def test_token_loss_without_padding_counts_every_position():
    logits = torch.zeros(2, 3, 5)
    targets = torch.zeros(2, 3, dtype=torch.long)  # id 0 is a real token here
    parts = token_loss(logits, targets, pad_id=None)
    assert parts.tokens == 6 and abs(float(parts.loss_sum) - 6 * math.log(5)) < 1e-5


@pytest.mark.parametrize("logits, targets, kwargs, err, match", [
    (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), {}, ValueError, "logits must be \\(B, T, V\\) and targets \\(B, T\\), got logits \\(2, 3\\)"),
    (torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), {}, ValueError, "targets \\(2, 4\\)"),
    (torch.zeros(2, 3, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), {}, TypeError, "logits must be floating point"),
    (torch.zeros(2, 3, 4), torch.zeros(2, 3), {}, TypeError, "targets must be integer token ids"),
    (torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), dict(label_smoothing=1.0), ValueError, "label_smoothing must lie in \\[0, 1\\)"),
])  # fmt: skip
def test_token_loss_errors(logits, targets, kwargs, err, match):
    with pytest.raises(err, match=match):
        token_loss(logits, targets, **kwargs)


def test_metrics_values():
    assert perplexity(0.0, 10) == 1.0
    assert perplexity(10 * math.log(4), 10) == pytest.approx(4.0)
    assert perplexity(1e6, 1) == math.inf
    assert token_accuracy(3, 4) == 0.75
    assert exact_match(["ab", "c", "d"], ["ab", "x", "d"]) == pytest.approx(2 / 3)
    assert exact_match([[1, 2]], [(1, 2)]) == 1.0
    refs = ["the cat sat on the mat", "a dog ran in the park today"]
    assert bleu(refs, refs) == pytest.approx(100.0)
    assert chrf(refs, refs) == pytest.approx(100.0)
    worse = ["the cat sat", "a cat ran in a park"]
    assert 0 < bleu(worse, refs) < 100 and 0 < chrf(worse, refs) < 100
    import sacrebleu

    assert bleu(worse, refs) == sacrebleu.corpus_bleu(worse, [refs]).score
    assert bleu(["12345"], ["12345"], tokenize="char") == pytest.approx(100.0)


@pytest.mark.parametrize("call, err, match", [
    (lambda: perplexity(1.0, 0), ValueError, "tokens must be a positive int, got 0"),
    (lambda: perplexity(float("nan"), 3), ValueError, "nll_sum must be a finite number >= 0"),
    (lambda: token_accuracy(5, 4), ValueError, "correct must lie in \\[0, tokens=4\\], got 5"),
    (lambda: exact_match(["a"], ["a", "b"]), ValueError, "hyps and refs must have equal lengths, got 1 and 2"),
    (lambda: exact_match([], []), ValueError, "must not be empty"),
    (lambda: bleu([1], ["a"]), TypeError, "hyps must hold strings, got int"),
    (lambda: chrf("abc", "abc"), TypeError, "sequences of sequences, got a str"),
])  # fmt: skip
def test_metric_errors(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_seq2seq_decay_groups_cover_every_parameter_once():
    model = Seq2SeqTransformer(Seq2SeqConfig(20, 20, d_model=16, num_heads=2, d_ff=32, tie_embeddings=True))
    decay, keep = parameter_groups(model, 0.01)
    ids = [id(p) for p in decay["params"] + keep["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
