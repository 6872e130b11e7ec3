"""Training on a torch ``Dataset`` or ``DataLoader`` equals training on the same data given as
a list, bit for bit; a wrong item is a clear TypeError before training starts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from qkv.data import CharTokenizer, make_task
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.train import TrainConfig, train_lm, train_seq2seq

TOK = CharTokenizer.fit("0123456789")
TASK = make_task("copy", n_train=40, n_valid=6, n_test=0, max_len=5, seed=1)
CONFIG = TrainConfig(steps=8, batch_size=8, eval_every=4, label_smoothing=0.1, lr=3e-3,
                     warmup=2, progress=False, plot=False, seed=2)  # fmt: skip


class PairDataset(Dataset):
    """A map-style dataset of ``(source, target)`` strings, as a user would write one."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


class DocDataset(Dataset):
    """Token-id documents as 1-D tensors."""

    def __init__(self, docs):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return torch.tensor(self.docs[i])


class Stream(IterableDataset):
    def __iter__(self):
        yield ("1", "1")


def _s2s():
    torch.manual_seed(0)
    return Seq2SeqTransformer(Seq2SeqConfig(TOK.vocab_size, TOK.vocab_size, d_model=16,
                                            num_heads=2, d_ff=32, num_encoder_layers=1,
                                            num_decoder_layers=1, dropout=0.1, max_len=16))  # fmt: skip


def _lm():
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig(TOK.vocab_size, d_model=16, num_layers=1, num_heads=2,
                                     max_len=16, dropout=0.1))  # fmt: skip


def _same(a, b, model_a, model_b):
    assert a.history == b.history, "loss curves differ"
    assert a.evals == b.evals, "evaluations differ"
    for (name, p), q in zip(model_a.state_dict().items(), model_b.state_dict().values(),
                            strict=True):  # fmt: skip
        diff = (p - q).abs().max().item()
        assert diff == 0.0, f"weight {name} differs by {diff}"


@pytest.mark.parametrize("wrap", ["dataset", "loader"])
def test_seq2seq_on_a_dataset_equals_the_list(wrap):
    train, valid = TASK.pairs("train"), TASK.pairs("valid")
    data = PairDataset(train)
    if wrap == "loader":  # its own batching and shuffling are not used: qkv's are
        data = DataLoader(data, batch_size=3, shuffle=True)
    m1, m2 = _s2s(), _s2s()
    want = train_seq2seq(m1, train, TOK, TOK, CONFIG, valid=valid)
    got = train_seq2seq(m2, data, TOK, TOK, CONFIG, valid=PairDataset(valid))
    assert len(got.history) == 8 and got.history[-1]["loss"] < got.history[0]["loss"]
    _same(got, want, m2, m1)


def test_lm_on_a_dataset_of_documents_equals_the_list():
    docs = [TOK.encode(str(n) * (1 + n % 7), add_bos=True, add_eos=True) for n in range(30)]
    config = CONFIG.replace(block_size=16, pack=True, eval_every=None)
    m1, m2 = _lm(), _lm()
    want = train_lm(m1, docs, config, valid_ids=docs[:5])
    got = train_lm(m2, DocDataset(docs), config, valid_ids=DocDataset(docs[:5]))
    _same(got, want, m2, m1)


@pytest.mark.parametrize(("call", "err", "message"), [
    (lambda: train_seq2seq(_s2s(), PairDataset([("1", 2)]), TOK, TOK, CONFIG), TypeError,
     r"data: item 0 of the dataset is a tuple of 2 \(str, int\); expected \(source, target\) "
     r"pairs of str"),
    (lambda: train_seq2seq(_s2s(), PairDataset(["12"]), TOK, TOK, CONFIG), TypeError,
     "item 0 of the dataset is a str; expected"),
    (lambda: train_seq2seq(_s2s(), PairDataset([]), TOK, TOK, CONFIG), ValueError,
     "data: the PairDataset holds no items"),
    (lambda: train_seq2seq(_s2s(), Stream(), TOK, TOK, CONFIG), TypeError,
     "data: an iterable-style Stream \\(no len\\(\\)\\) cannot be trained on with exact resume"),
    (lambda: train_seq2seq(_s2s(), {"a": "b"}, TOK, TOK, CONFIG), TypeError,
     "data must be a Task, a list of \\(source, target\\) pairs or a torch Dataset/DataLoader "
     "of them, got dict"),
    (lambda: train_lm(_lm(), DocDataset([[1.5, 2.0]]), CONFIG.replace(block_size=16)),
     TypeError, r"ids: item 0 of the dataset is a tensor of shape \(2,\) and dtype "
     r"torch.float32; expected documents of token ids"),
    (lambda: train_lm(_lm(), PairDataset([("a", "b")]), CONFIG.replace(block_size=16)),
     TypeError, r"ids: item 0 of the dataset is a tuple of 2 \(str, str\); expected documents"),
])  # fmt: skip
def test_bad_datasets_are_clear_errors(call, err, message):
    with pytest.raises(err, match=message):
        call()
