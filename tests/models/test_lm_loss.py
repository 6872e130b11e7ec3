"""``DecoderLM(input_ids, labels=...)``: transformers' ``labels=`` contract (issue 27: it
raised TypeError where transformers users expect ``.loss``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.models.lm_loss import CausalLMOutput

V = 30


def _model():
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.llama_style(V, d_model=32, num_layers=2, num_heads=4,
                                                 num_kv_heads=2, max_len=32)).eval()


def test_loss_is_the_mean_next_token_cross_entropy_in_float64():
    model = _model().double()
    ids = torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 4:7] = -100  # left out, as transformers does
    out = model(ids, labels=labels)
    assert isinstance(out, CausalLMOutput)
    assert torch.equal(out.logits, model(ids))
    logp = out.logits[:, :-1].log_softmax(-1)  # position t predicts token t + 1
    keep = labels[:, 1:] != -100
    picked = logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    expected = -(picked * keep).sum() / keep.sum()
    assert_close(out.loss, expected, atol=1e-12, name="loss")
    out.loss.backward()  # differentiable, as a training loop needs
    assert model.embed.weight.grad is not None


def test_half_precision_logits_give_a_float32_loss():
    model = _model().bfloat16()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(2))
    out = model(ids, labels=ids)
    assert out.loss.dtype == torch.float32
    ref = F.cross_entropy(out.logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))
    assert_close(out.loss, ref, atol=1e-6, name="bf16 loss")


@pytest.mark.parametrize(("labels", "error", "match"), [
    (lambda ids: ids.float(), TypeError, "labels must be an integer tensor"),
    (lambda ids: ids[:, :-1], ValueError, r"labels must have the shape of input_ids \(2, 6\)"),
    (lambda ids: ids.masked_fill(torch.zeros_like(ids, dtype=torch.bool).index_fill_(
        1, torch.tensor([3]), True), V), ValueError, rf"labels\[0, 3\] = {V} is outside"),
    (lambda ids: torch.full_like(ids, -100), ValueError, "no position to predict"),
])
def test_bad_labels_are_named(labels, error, match):
    model = _model()
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(3))
    with pytest.raises(error, match=match):
        model(ids, labels=labels(ids))
