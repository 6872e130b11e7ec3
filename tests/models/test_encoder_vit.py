"""Encoder (BERT style) and ViT: padding does not leak, pooling, token types, the patch
embedding is a linear map of flattened patches, gradients everywhere, clear errors."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, assert_close
from qkv.models import Encoder, EncoderConfig, ViT, ViTConfig

F32 = TOL[torch.float32]
V = 40
VARIANTS = {
    "bert": dict(),
    "pre-sinusoidal": dict(norm="pre", positions="sinusoidal"),
    "alibi": dict(positions="alibi"),
    "rope-cls": dict(positions="rope", pooling="cls", type_vocab_size=0),
}


def _encoder(variant="bert", seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(d_model=32, num_layers=2, num_heads=4, d_ff=48, dropout=0.0, max_len=24)
    return Encoder(EncoderConfig(V, **{**base, **VARIANTS[variant], **kw})).eval()


def _ids(shape, seed, low=1, high=V):
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_batch_equals_per_example_runs(variant):
    model = _encoder(variant)
    lengths = [11, 4, 7]
    ids = _ids((3, 11), 1)
    mask = torch.zeros(3, 11, dtype=torch.bool)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
        mask[b, :n] = True
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        from_pad_id = model(ids)  # pad_id=0 builds the same mask
        pooled = model.pool(batched, mask)
        for b, n in enumerate(lengths):
            alone = model(ids[b : b + 1, :n])
            assert_close(batched[b, :n], alone[0], **F32, name=f"row {b} hidden")
            assert_close(pooled[b], model.pool(alone)[0], **F32, name=f"row {b} pooled")
    assert_close(from_pad_id[mask], batched[mask], **F32, name="mask from pad_id")


def test_token_types_default_to_type_zero_and_matter():
    model = _encoder()
    ids = _ids((2, 6), 2)
    with torch.no_grad():
        default = model(ids)
        zeros = model(ids, token_type_ids=torch.zeros(2, 6, dtype=torch.long))
        ones = model(ids, token_type_ids=torch.ones(2, 6, dtype=torch.long))
    assert_close(default, zeros, **F32, name="type 0 default")
    assert not torch.allclose(default, ones)


def test_pooling_modes():
    model = _encoder()
    hidden = torch.randn(2, 5, 32)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    mean = model.pool(hidden, mask)
    assert_close(mean[0], hidden[0, :2].mean(0), **F32, name="mean over real tokens")
    assert torch.equal(mean[1], torch.zeros(32))  # no real token: zeros, not NaN
    assert torch.equal(model.pool(hidden, pooling="cls"), hidden[:, 0])
    assert torch.equal(_encoder("rope-cls").pool(hidden), hidden[:, 0])  # config's pooling


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_gradients_reach_every_parameter(variant):
    model = _encoder(variant, dropout=0.1).train()
    out = model(_ids((2, 7), 3))
    (out * torch.randn_like(out)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


def test_encoder_layout_holds_a_bert_checkpoint():
    model = _encoder()
    keys = set(model.state_dict())
    for key in ("embed.weight", "pos.weight", "token_type.weight", "embed_norm.weight",
                "embed_norm.bias", "blocks.1.self_attn.q_proj.bias",
                "blocks.1.self_attn.out_proj.bias", "blocks.1.attn_norm.weight",
                "blocks.1.ffn.linear1.weight", "blocks.1.ffn.linear2.bias",
                "blocks.1.ffn_norm.bias"):
        assert key in keys, key
    assert model.norm_f is None


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m: m(_ids((2, 25), 0)), ValueError,
         r"input_ids has T=25 tokens, which goes beyond max_len=24"),
        (lambda m: m(_ids((2, 5), 0), token_type_ids=torch.full((2, 5), 2)), ValueError,
         r"token_type_ids must lie in \[0, vocab_size=2\), got values in \[2, 2\]"),
        (lambda m: m(_ids((2, 5), 0), token_type_ids=torch.zeros(2, 4, dtype=torch.long)),
         ValueError, r"token_type_ids must have the shape of input_ids \(2, 5\), got \(2, 4\)"),
        (lambda m: m(_ids((2, 5), 0), attention_mask=torch.ones(5, 2)), ValueError,
         r"attention_mask must have shape \(B, S\) = \(2, 5\), got \(5, 2\)"),
        (lambda m: m.pool(torch.zeros(2, 5, 32), pooling="max"), ValueError,
         r"pooling must be one of \('mean', 'cls'\), got 'max'"),
        (lambda m: m.pool(torch.zeros(2, 32)), ValueError,
         r"hidden must have shape \(B, S, E=32\), got \(2, 32\)"),
        (lambda m: Encoder(EncoderConfig(V, d_model=32, type_vocab_size=0))(
            _ids((1, 3), 0), token_type_ids=torch.zeros(1, 3, dtype=torch.long)),
         ValueError, r"token_type_ids given but this encoder has type_vocab_size=0"),
    ],
)
def test_encoder_bad_inputs_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(_encoder())


# --- ViT -------------------------------------------------------------------------------------

VIT = dict(image_size=12, patch_size=4, channels=3, num_classes=5, d_model=32, num_layers=2,
           num_heads=4, d_ff=48)


def _vit(**kw):
    torch.manual_seed(0)
    return ViT(ViTConfig(**{**VIT, **kw})).eval()


def test_patch_embedding_is_a_linear_map_of_flattened_patches():
    model = _vit()
    images = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    # Patches cut out one by one, row-major, each flattened as (C, P, P).
    patches = torch.stack(
        [images[:, :, 4 * i : 4 * i + 4, 4 * j : 4 * j + 4].reshape(2, -1)
         for i in range(3) for j in range(3)], dim=1)  # (B, N, C·P·P)
    assert torch.equal(model.patchify(images), patches)
    W = model.patch_embed.weight.reshape(32, -1)  # (E, C·P·P)
    expected = patches @ W.T + model.patch_embed.bias  # (B, N, E)
    assert_close(model.embed_patches(images), expected, **F32, name="patch embedding")


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_vit_forward_and_gradients(norm):
    model = _vit(norm=norm, dropout=0.1).train()
    logits = model(torch.randn(3, 3, 12, 12))
    assert logits.shape == (3, 5)
    (logits * torch.randn_like(logits)).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    assert model.pos.weight.shape == (10, 32)  # 9 patches + the class token


def test_vit_batch_rows_are_independent():
    model = _vit()
    images = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        batched = model(images)
        alone = torch.cat([model(images[b : b + 1]) for b in range(3)])
    assert_close(batched, alone, **F32, name="per-image logits")


@pytest.mark.parametrize(
    "images, error, match",
    [
        (torch.zeros(2, 3, 16, 16), ValueError,
         r"images must have shape \(B, C, H, W\) = \(B, 3, 12, 12\), got \(2, 3, 16, 16\)"),
        (torch.zeros(3, 12, 12), ValueError, r"images must have shape \(B, C, H, W\)"),
        (torch.zeros(2, 3, 12, 12, dtype=torch.long), TypeError,
         r"images must be a floating-point tensor"),
    ],
)
def test_vit_bad_images_raise(images, error, match):
    with pytest.raises(error, match=match):
        _vit()(images)
