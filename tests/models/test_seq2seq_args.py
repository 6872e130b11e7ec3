"""``Seq2SeqTransformer``'s forward arguments that do not fit each other: each error names the
argument at fault (not a mask shape derived from it, nor torch's message from deep inside)."""

from __future__ import annotations

import pytest
import torch

from qkv.models import Seq2SeqConfig, Seq2SeqTransformer

SV, TV = 11, 13


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Seq2SeqConfig(SV, TV, d_model=16, num_heads=2, num_encoder_layers=1,
                           num_decoder_layers=1, d_ff=32, max_len=20, dropout=0.0)
    return Seq2SeqTransformer(config).eval()


def _ids(B: int, T: int, V: int) -> torch.Tensor:
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(B * 100 + T))


@pytest.mark.parametrize(("B_src", "B_tgt"), [(2, 3), (3, 1), (1, 4)])
def test_forward_with_different_batch_sizes_names_src_and_tgt_in(model, B_src, B_tgt):
    src, tgt = _ids(B_src, 5, SV), _ids(B_tgt, 4, TV)
    with pytest.raises(ValueError, match=rf"src and tgt_in must have the same batch size B, got "
                       rf"src \({B_src}, 5\) and tgt_in \({B_tgt}, 4\)"):
        model(src, tgt)


def test_decode_memory_that_does_not_fit_tgt_in(model):
    memory = model.encode(_ids(2, 5, SV))  # (2, 5, 16)
    with pytest.raises(ValueError, match=r"memory must have tgt_in's batch size B=3, got "
                       r"memory of shape \(2, 5, 16\)"):
        model.decode(_ids(3, 4, TV), memory)
    with pytest.raises(TypeError, match=r"memory must have the parameters' dtype torch.float32 "
                       r"\(the output of encode\), got torch.float64"):
        model.decode(_ids(2, 4, TV), memory.double())
    with pytest.raises(ValueError, match="memory must be on the model's device cpu, got meta"):
        model.decode(_ids(2, 4, TV), memory.to("meta"))


@pytest.mark.parametrize("call, match", [
    (lambda m: m(_ids(2, 5, SV).to("meta"), _ids(2, 4, TV)), "src must be on the model's device"),
    (lambda m: m(_ids(2, 5, SV), _ids(2, 4, TV).to("meta")), "tgt_in must be on the model's"),
    (lambda m: m.encode(_ids(2, 5, SV).to("meta")), "src must be on the model's device cpu"),
    (lambda m: m.encode(_ids(2, 5, SV), torch.ones(2, 1, 1, 5, dtype=torch.bool,
                                                   device="meta")),
     "src_mask must be on the model's device cpu, got meta"),
])  # fmt: skip
def test_tensors_on_another_device_are_named(model, call, match):
    with pytest.raises(ValueError, match=match):
        call(model)


def test_matching_arguments_still_decode_as_forward(model):
    src, tgt = _ids(2, 5, SV), _ids(2, 4, TV)
    mask = model.make_src_mask(src)
    full = model(src, tgt)
    step = model.decode(tgt, model.encode(src, mask), mask)
    err = float((full - step).detach().abs().max())
    assert err == 0.0, f"forward vs encode+decode: max |diff| = {err:.2e}"
