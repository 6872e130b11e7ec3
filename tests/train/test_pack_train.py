"""Packed language-model training: ``train_lm`` / ``evaluate_lm`` on documents, and
``qkv train --text ... --pack``."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from typer.testing import CliRunner

from helpers import assert_close
from qkv.cli.app import app
from qkv.data.packing import IGNORE_INDEX, pack_lm
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.train import TrainConfig, evaluate_lm, train_lm
from qkv.train.lm import document_batches
from qkv.train.runs import build_train_config

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
V = 12
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "off", "to", "see",
         "dog", "who", "was", "happy")  # fmt: skip


def documents(n: int = 60, seed: int = 0) -> list[list[int]]:
    """Variable-length documents with structure to learn: BOS, an arithmetic run, EOS."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        start, step = rng.randrange(4, V), rng.choice([1, 2])
        body = [4 + (start - 4 + step * t) % (V - 4) for t in range(rng.randint(2, 30))]
        docs.append([1, *body, 2])
    return docs


def model(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(DecoderLMConfig.gpt2_style(V, d_model=32, num_layers=2, num_heads=2,
                                                max_len=32))  # fmt: skip


CONFIG = dict(steps=40, batch_size=8, block_size=32, lr=3e-3, schedule="constant", warmup=0,
              progress=False, plot=False)  # fmt: skip


def test_packed_training_loss_decreases_and_counts_real_tokens():
    docs = documents()
    m = model()
    start = copy.deepcopy(m)
    result = train_lm(m, docs, TrainConfig(pack=True, **CONFIG))
    losses = [h["loss"] for h in result.history]
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], f"loss {losses[0]:.3f} -> {losses[-5:]}"
    # Step 1's loss is the mean over the real targets of the first packed batch, computed by
    # running each of its documents alone (no document ids).
    rows = pack_lm(docs, 32)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    batch = next(document_batches(rows, 8, order, packed=True))
    total, count = 0.0, 0
    for r in range(batch.inputs.shape[0]):
        for d in batch.document_ids[r].unique().tolist():
            if d < 0:
                continue
            at = batch.document_ids[r] == d
            with torch.no_grad():
                logits = start(batch.inputs[r, at][None])  # (1, n, V)
            total += float(torch.nn.functional.cross_entropy(
                logits[0], batch.targets[r, at], reduction="sum"))  # fmt: skip
            count += int(at.sum())
    assert result.history[0]["tokens"] == count == int((batch.targets != IGNORE_INDEX).sum())
    assert_close(result.history[0]["loss"], total / count, atol=1e-5, rtol=1e-5,
                 name="first step's loss")  # fmt: skip


def test_packed_and_padded_evaluation_agree():
    """The same (input, target) pairs, packed or one document per padded row: equal loss."""
    docs, m = documents(seed=1), model(1)
    packed = evaluate_lm(m, docs, block_size=32, batch_size=8, pack=True)
    padded = evaluate_lm(m, docs, block_size=32, batch_size=8, pack=False)
    for key in ("loss", "token_accuracy"):
        assert_close(packed[key], padded[key], atol=1e-5, rtol=1e-5, name=key)


def test_padded_document_training_runs():
    result = train_lm(model(), documents(), TrainConfig(pack=False, **{**CONFIG, "steps": 3}))
    assert result.steps == 3


def test_pack_needs_documents_and_text():
    stream = torch.randint(0, V, (500,))
    with pytest.raises(ValueError, match="pack=True needs documents"):
        train_lm(model(), stream, TrainConfig(pack=True, **CONFIG))
    with pytest.raises(ValueError, match="pack packs language-model documents"):
        build_train_config("task", {}, {"pack": True})


def test_qkv_train_pack_on_a_tiny_corpus(tmp_path):
    rng = random.Random(0)
    paragraphs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
                  for _ in range(200)]  # fmt: skip
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(paragraphs), encoding="utf-8")
    config = tmp_path / "tiny.toml"
    config.write_text("steps = 40\nbatch_size = 8\nblock_size = 48\neval_every = 40\n"
                      "eval_batches = 2\nlog_every = 10\nprogress = false\nplot = false\n"
                      "lr = 3e-3\n[model]\nd_model = 32\nnum_heads = 2\nnum_layers = 1\n")
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--text", str(corpus), "--pack", "--config",
                                 str(config), "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "packed into" in result.output and "padding" in result.output, result.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["split"] == "train"]
    assert len(train) == 4 and train[-1] < 0.8 * train[0], train
    assert (out / "best" / "config.json").is_file()


@pytest.mark.parametrize("pack", [True, False])
def test_labeled_documents_train_as_their_labels_say_with_logits_only_where_learned(
        pack, monkeypatch):  # fmt: skip
    """Documents learned on their second half only: the run (logits only at learned
    positions) equals the same run computing every position's logits, and its loss is the
    cross-entropy of the learned tokens alone (checked against a plain computation)."""
    import qkv.train.lm as lm
    from qkv.data.packing import LabeledDocument

    docs = [LabeledDocument(d, [IGNORE_INDEX] * (len(d) // 2) + d[len(d) // 2 :])
            for d in documents(40)]  # fmt: skip
    config = TrainConfig(**{**CONFIG, "steps": 6, "pack": pack})
    sparse_run = train_lm(model(), docs, config)
    monkeypatch.setattr(lm, "_sparse", lambda model, docs: False)
    dense = model()
    dense_run = train_lm(dense, docs, config)
    for a, b in zip(sparse_run.history, dense_run.history, strict=True):
        assert_close(a["loss"], b["loss"], atol=1e-5, rtol=1e-5, name=f"step {a['step']} loss")
        assert a["tokens"] == b["tokens"]
    # the loss is the cross-entropy of the learned tokens alone
    rows = pack_lm(docs, 32, packed=pack)
    assert int((rows.targets != IGNORE_INDEX).sum()) == sum(d.learned for d in docs)
    monkeypatch.undo()
    m = model().eval()
    got = evaluate_lm(m, docs, block_size=32, batch_size=8, pack=pack)["loss"]
    with torch.no_grad():
        logits = m(rows.tokens, document_ids=rows.document_ids) if pack else m(rows.tokens)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows.targets.flatten(),
                                             ignore_index=IGNORE_INDEX)  # fmt: skip
    assert_close(got, want, atol=1e-5, name="evaluation loss on learned tokens")


def test_decoder_logits_at_equal_those_positions_of_the_full_logits():
    m, ids = model().eval(), torch.randint(0, V, (3, 17))
    keep = torch.rand(3, 17) < 0.3
    with torch.no_grad():
        full, part = m(ids), m(ids, logits_at=keep)
    assert_close(part, full[keep], atol=1e-6, name="logits_at")
    with pytest.raises(ValueError, match="logits_at must have input_ids' shape"):
        m(ids, logits_at=keep[:, :5])
    with pytest.raises(TypeError, match="logits_at must be a bool tensor"):
        m(ids, logits_at=keep.long())
    with pytest.raises(ValueError, match="logits_at and labels"):
        m(ids, logits_at=keep, labels=ids)
