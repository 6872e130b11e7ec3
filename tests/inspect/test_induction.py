"""Induction heads, reproduced (Olsson et al., 2022): a 2-layer attention-only model trained on
repeated random segments grows a previous-token head in layer 0 and induction heads in layer 1;
ablating the induction heads destroys the repeated half's loss and leaves the first half alone.
The helpers are checked against direct computations first."""

from __future__ import annotations

import math

import pytest
import torch

import qkv.inspect as qi
from helpers import assert_close
from qkv.inspect.induction import (
    attention_only,
    half_losses,
    repeated_tokens,
    token_losses,
    train_on_repeats,
)
from qkv.models import DecoderLM, DecoderLMConfig

V, MIN_LEN, MAX_LEN = 64, 8, 16


def small_model(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    config = DecoderLMConfig(V, d_model=64, num_layers=2, num_heads=4, max_len=2 * MAX_LEN + 1,
                             positions="rope", tie_embeddings=False)  # fmt: skip
    return attention_only(DecoderLM(config))


def test_repeated_tokens_and_losses():
    ids = repeated_tokens(3, 5, 10, bos=2, generator=torch.Generator().manual_seed(0))
    assert ids.shape == (3, 11)
    assert (ids[:, 0] == 2).all() and (ids[:, 1:] != 2).all()
    assert torch.equal(ids[:, 1:6], ids[:, 6:])
    logits = torch.randn(3, 11, 10)
    loss = token_losses(logits, ids)
    b, i = 1, 4
    by_hand = -logits[b, i].log_softmax(-1)[ids[b, i + 1]]
    assert_close(loss[b, i], by_hand, atol=1e-6, name="token loss by hand")
    first, second = half_losses(logits, ids, 5)
    assert_close(first, loss[:, 1:5].mean(), atol=1e-6, name="first half")
    assert_close(second, loss[:, 6:10].mean(), atol=1e-6, name="repeated half")
    with pytest.raises(ValueError, match="seg_len must be a positive int"):
        repeated_tokens(2, 0, 10)


def test_attention_only_blocks_add_nothing_after_attention():
    model = small_model()
    _, cache = qi.run_with_cache(model, repeated_tokens(2, 4, V))
    for l in range(2):
        assert torch.equal(cache[f"blocks.{l}.hook_resid_post"], cache[f"blocks.{l}.hook_resid_mid"])
    with pytest.raises(ValueError, match="not a list of blocks"):
        attention_only(torch.nn.Linear(2, 2))


def test_scores_and_ablation_against_direct_computations():
    model = small_model()
    ids = repeated_tokens(2, 5, V, generator=torch.Generator().manual_seed(1))
    with qi.capture(model) as cap:
        model(ids)
    w = cap.weights["blocks.1.self_attn"][:, 2]  # (B, T, T) of head 2
    expected = sum(w[:, 6 + k, 2 + k].mean() for k in range(5)) / 5  # query s_k -> after it
    assert_close(qi.prefix_matching_scores(model, ids, 5)[1, 2], expected, atol=1e-6,
                 name="prefix-matching score of L1H2")  # fmt: skip
    prev = sum(w[:, i, i - 1].mean() for i in range(1, 11)) / 10
    assert_close(qi.previous_token_scores(model, ids)[1, 2], prev, atol=1e-6, name="prev score")
    # Zero ablation of L0H1 = out_proj's input columns of head 1 set to zero (a torch pre-hook).
    proj = model.blocks[0].self_attn.out_proj
    h = proj.register_forward_pre_hook(
        lambda m, args: (args[0].index_fill(-1, torch.arange(16, 32), 0.0),))
    with torch.no_grad():
        direct = model(ids)
    h.remove()
    with torch.no_grad(), qi.ablate_heads(model, [(0, 1)]):
        ablated = model(ids)
    assert_close(ablated, direct, atol=1e-6, name="zero ablation vs out_proj pre-hook")
    means = qi.head_means(model, ids)
    assert means[0].shape == (4, 11, 16)
    with pytest.raises(ValueError, match="out of range"), qi.ablate_heads(model, [(0, 4)]):
        pass
    with pytest.raises(ValueError, match="no attention layer"), qi.ablate_heads(model, [(2, 0)]):
        pass
    shorter = repeated_tokens(2, 4, V)
    with pytest.raises(ValueError, match="make them from ids of this length"), torch.no_grad(), \
            qi.ablate_heads(model, [(0, 0)], means=means):
        model(shorter)


@pytest.mark.slow
def test_induction_heads_form_and_ablating_them_destroys_in_context_loss():
    """700 AdamW steps (10-20 s on one core). Seed 0 of this recipe grows the textbook circuit
    (as do seeds 1 and 3; seeds 2, 4 and 5 solve the repeated half with a lagged variant,
    layer-0 heads 2-3 tokens back, which the prefix-matching score by design does not see)."""
    model = small_model(seed=0)
    history = train_on_repeats(model, steps=700, min_len=MIN_LEN, max_len=MAX_LEN, batch=64,
                               lr=3e-3, seed=0)  # fmt: skip
    assert history[-1] < history[0] - 1.0, f"training did not progress: {history[::100]}"
    gen = torch.Generator().manual_seed(123)
    ids = repeated_tokens(64, MIN_LEN, V, generator=gen)
    reference = repeated_tokens(64, MIN_LEN, V, generator=gen)
    with torch.no_grad():
        first, second = half_losses(model(ids), ids, MIN_LEN)
    chance = math.log(V - 1)
    assert abs(first - chance) < 0.15, f"first half {first:.3f} vs chance {chance:.3f}"
    assert second < 1.5, f"repeated half loss {second:.3f}: no in-context learning"

    scores = qi.prefix_matching_scores(model, ids, MIN_LEN)  # (2, 4)
    induction = [(1, h) for h in range(4) if scores[1, h] > 0.4]
    assert induction, f"no induction head in layer 1: prefix-matching scores {scores.tolist()}"
    assert scores[0].max() < 0.2, f"layer 0 should not match prefixes: {scores[0].tolist()}"
    previous = qi.previous_token_scores(model, ids)
    prev_head = int(previous[0].argmax())
    assert previous[0, prev_head] > 0.5, f"no previous-token head: {previous[0].tolist()}"

    means = qi.head_means(model, reference)
    with torch.no_grad(), qi.ablate_heads(model, induction, means=means):
        first_ablated, second_ablated = half_losses(model(ids), ids, MIN_LEN)
    # Most of the in-context gain (chance - second) is gone with the induction heads.
    assert second_ablated - second > 0.6 * (chance - second), (
        f"ablating {induction} moved the repeated half only {second:.3f} -> {second_ablated:.3f}"
        f" (chance {chance:.3f})"
    )
    assert abs(first_ablated - first) < 0.1, (
        f"ablating {induction} moved the first half {first:.3f} -> {first_ablated:.3f}"
    )
    # K-composition: the induction heads need the previous-token head of layer 0.
    with torch.no_grad(), qi.ablate_heads(model, [(0, prev_head)], means=means):
        _, second_no_prev = half_losses(model(ids), ids, MIN_LEN)
    assert second_no_prev - second > 0.5 * (chance - second), (
        f"ablating the previous-token head L0H{prev_head}: {second:.3f} -> {second_no_prev:.3f}"
    )
