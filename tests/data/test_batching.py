"""Batching: teacher-forcing layout, keep masks, little padding, each example once per epoch."""

from __future__ import annotations

import random

import pytest
import torch

from qkv import masks
from qkv.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    CharTokenizer,
    Example,
    bucket_batches,
    collate,
    encode_pairs,
    lm_batches,
    make_task,
)


@pytest.fixture(scope="module")
def examples() -> list[Example]:
    task = make_task("reverse", seed=0, n_train=1500, n_valid=0, n_test=0, min_len=1, max_len=40)
    tok = CharTokenizer.fit(task.texts())
    return encode_pairs(task.pairs("train"), tok)


def padding_fraction(batches) -> float:
    pads = sum(int((b.src == PAD_ID).sum() + (b.tgt_in == PAD_ID).sum()) for b in batches)
    total = sum(b.src.numel() + b.tgt_in.numel() for b in batches)
    return pads / total


def test_encode_pairs_frames_source_and_target():
    tok = CharTokenizer.fit(["abc"])
    (ex,) = encode_pairs([("ab", "cba")], tok)
    assert ex.src == (*tok.encode("ab"), EOS_ID)
    assert ex.tgt == (BOS_ID, *tok.encode("cba"), EOS_ID)
    other = CharTokenizer.fit(["xyz"])
    (ex2,) = encode_pairs([("ab", "zy")], tok, other)
    assert ex2.tgt == (BOS_ID, *other.encode("zy"), EOS_ID)
    with pytest.raises(ValueError, match=r"pairs\[1\] must be a \(source, target\) pair, got 'ab'"):
        encode_pairs([("a", "b"), "ab"], tok)


def test_collate_layout_and_masks():
    exs = [Example((5, 6, 7, 2), (1, 8, 2)), Example((5, 2), (1, 8, 9, 10, 11, 2))]
    b = collate(exs, [10, 20])
    assert b.src.tolist() == [[5, 6, 7, 2], [5, 2, 0, 0]]
    assert b.tgt_in.tolist() == [[1, 8, 0, 0, 0], [1, 8, 9, 10, 11]]
    assert b.tgt_out.tolist() == [[8, 2, 0, 0, 0], [8, 9, 10, 11, 2]]
    assert b.src_lengths.tolist() == [4, 2] and b.tgt_lengths.tolist() == [2, 5]
    assert b.indices.tolist() == [10, 20] and b.num_tokens == 7
    assert b.src_mask.dtype == torch.bool and b.src_mask.shape == (2, 1, 1, 4)
    assert torch.equal(b.src_mask, masks.padding(b.src_lengths, 4))
    assert torch.equal(b.tgt_mask, masks.padding(b.tgt_lengths, 5))


def test_every_batch_matches_its_examples(examples):
    for b in bucket_batches(examples, batch_size=64, seed=3):
        assert b.src.dtype == torch.long and b.tgt_in.shape == b.tgt_out.shape
        for row, i in enumerate(b.indices.tolist()):
            ex = examples[i]
            S, L = len(ex.src), len(ex.tgt) - 1
            assert b.src[row, :S].tolist() == list(ex.src)
            assert b.tgt_in[row, :L].tolist() == list(ex.tgt[:-1])
            assert b.tgt_out[row, :L].tolist() == list(ex.tgt[1:])
            assert (b.src[row, S:] == PAD_ID).all() and (b.tgt_out[row, L:] == PAD_ID).all()
            assert (b.tgt_in[row, L:] == PAD_ID).all()
        assert torch.equal(b.src_mask, masks.padding(b.src_lengths, b.src.shape[1]))
        assert torch.equal(b.src_mask, b.src[:, None, None, :] != PAD_ID)
        assert torch.equal(b.tgt_mask, masks.padding(b.tgt_lengths, b.tgt_in.shape[1]))


@pytest.mark.parametrize(
    "kwargs", [dict(batch_size=64), dict(batch_size=7), dict(batch_tokens=500)]
)
@pytest.mark.parametrize("shuffle", [True, False])
def test_each_example_exactly_once_per_epoch(examples, kwargs, shuffle):
    batches = bucket_batches(examples, shuffle=shuffle, seed=11, **kwargs)
    seen = torch.cat([b.indices for b in batches]).tolist()
    assert sorted(seen) == list(range(len(examples)))


def test_bucketing_pads_far_less_than_random_batching(examples):
    bucketed = padding_fraction(bucket_batches(examples, batch_size=32, seed=0))
    order = list(range(len(examples)))
    random.Random(0).shuffle(order)
    chunks = [order[k : k + 32] for k in range(0, len(order), 32)]
    randomly = padding_fraction([collate([examples[i] for i in c], c) for c in chunks])
    assert randomly > 0.3, f"random batching should pad a lot here, got {randomly:.3f}"
    assert bucketed < 0.03, f"bucketed padding {bucketed:.3f} (random: {randomly:.3f})"


def test_batch_tokens_budget(examples):
    for b in bucket_batches(examples, batch_tokens=600, seed=0):
        width = max(b.src.shape[1], b.tgt_in.shape[1])
        assert b.src.shape[0] * width <= 600 or b.src.shape[0] == 1
    # A single example over budget still gets a batch of its own.
    (alone,) = bucket_batches([Example(tuple(range(4, 50)), (1, 5, 2))], batch_tokens=10)
    assert alone.src.shape == (1, 46)


def test_seeded_order(examples):
    a = bucket_batches(examples, batch_size=50, seed=5)
    b = bucket_batches(examples, batch_size=50, seed=5)
    c = bucket_batches(examples, batch_size=50, seed=6)
    assert [x.indices.tolist() for x in a] == [x.indices.tolist() for x in b]
    assert [x.indices.tolist() for x in a] != [x.indices.tolist() for x in c]
    lengths = [int(x.src_lengths.max()) for x in a]
    assert lengths != sorted(lengths), "shuffled epochs should not run short-to-long"
    ordered = bucket_batches(examples, batch_size=50, shuffle=False)
    flat = torch.cat([x.src_lengths for x in ordered]).tolist()
    assert flat == sorted(flat)


def test_batch_to_device(examples):
    b = bucket_batches(examples[:5], batch_size=5)[0].to("meta")
    assert b.src.device.type == "meta" and b.indices.device.type == "meta"
    lm = next(lm_batches(torch.arange(100), 8, 2)).to("meta")
    assert lm.inputs.device.type == "meta" and lm.targets.device.type == "meta"


def test_bucket_batches_errors(examples):
    with pytest.raises(ValueError, match=r"exactly one of batch_size or batch_tokens"):
        bucket_batches(examples)
    with pytest.raises(ValueError, match=r"exactly one of .*batch_size=4, batch_tokens=9"):
        bucket_batches(examples, batch_size=4, batch_tokens=9)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got 0"):
        bucket_batches(examples, batch_size=0)
    with pytest.raises(ValueError, match=r"batch_tokens must be a positive int, got -3"):
        bucket_batches(examples, batch_tokens=-3)
    assert bucket_batches([], batch_size=4) == []
    with pytest.raises(ValueError, match=r"at least one Example, got none"):
        collate([])
    with pytest.raises(ValueError, match=r"example 0 must have >= 1 source and >= 2 target ids"):
        collate([Example((4,), (1,))])
    with pytest.raises(ValueError, match=r"indices must have 1 entries, got 2"):
        collate([Example((4,), (1, 2))], [0, 1])


@pytest.mark.parametrize(("T", "B"), [(1, 1), (7, 3), (64, 5)])
def test_lm_batches_are_windows_shifted_by_one(T, B):
    N = 1013
    stream = torch.arange(N) * 3 + 1  # distinct values: a window's start is readable
    batches = list(lm_batches(stream, T, B, seed=0))
    assert len(batches) == max(1, (N - 1) // (B * T))
    for b in batches:
        assert b.inputs.shape == (B, T) and b.targets.shape == (B, T)
        starts = (b.inputs[:, 0] - 1) // 3
        offsets = torch.arange(T)
        assert torch.equal(b.inputs, stream[starts[:, None] + offsets])
        assert torch.equal(b.targets, stream[starts[:, None] + offsets + 1])


def test_lm_batches_cover_the_stream_and_are_seeded():
    N, T = 40, 8
    stream = list(range(N))
    starts = {int(s) for b in lm_batches(stream, T, 16, 0, num_batches=50) for s in b.inputs[:, 0]}
    assert starts == set(range(N - T)), "every start in [0, N - T - 1] should be drawn"
    a = [b.inputs for b in lm_batches(stream, T, 4, seed=1, num_batches=3)]
    again = [b.inputs for b in lm_batches(stream, T, 4, seed=1, num_batches=3)]
    other = [b.inputs for b in lm_batches(stream, T, 4, seed=2, num_batches=3)]
    assert all(torch.equal(x, y) for x, y in zip(a, again, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, other, strict=True))


def test_lm_batches_errors():
    with pytest.raises(ValueError, match=r"at least block_size \+ 1 = 9 tokens, got 8"):
        lm_batches(list(range(8)), 8, 2)
    with pytest.raises(ValueError, match=r"1-D integer stream \(N,\), got shape \(2, 5\)"):
        lm_batches(torch.zeros(2, 5, dtype=torch.long), 2, 2)
    with pytest.raises(ValueError, match=r"dtype torch.float32"):
        lm_batches(torch.zeros(20), 2, 2)
    with pytest.raises(ValueError, match=r"block_size must be a positive int, got 0"):
        lm_batches(list(range(20)), 0, 2)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got 0"):
        lm_batches(list(range(20)), 2, 0)
    with pytest.raises(ValueError, match=r"num_batches must be a positive int, got 0"):
        lm_batches(list(range(20)), 2, 2, num_batches=0)
