"""LoRA adapters (issue 30): at initialisation the model computes what it did; only the
adapters train (counted); a merged model equals the adapted one; the update is the formula."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn.lora import LoRALinear, add_lora, lora_parameters, merge_lora

TARGETS = ["*.q_proj", "*.v_proj", "*.ffn.*"]


def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama_style(vocab_size=101, d_model=48, num_layers=2, num_heads=4,
                                         num_kv_heads=2)  # fmt: skip
    return DecoderLM(config)


def test_the_update_is_the_formula():
    torch.manual_seed(0)
    base = nn.Linear(7, 5)
    layer = LoRALinear(base, rank=3, alpha=6.0)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(2, 4, 7, dtype=torch.float64)
    layer = layer.double()
    want = x @ base.weight.double().t() + base.bias.double() + \
        (x @ layer.lora_A.t() @ layer.lora_B.t()) * 2.0  # fmt: skip
    err = float((layer(x) - want).abs().max().detach())
    assert err <= 1e-12, f"max error {err:.3g}"


@torch.no_grad()
def test_adapters_start_as_the_model_and_count_what_trains():
    model = _model().eval()
    ids = torch.randint(0, 101, (2, 9))
    before = model(ids)
    names = add_lora(model, TARGETS, rank=4, alpha=8)
    assert len(names) == 2 * 5 and all(isinstance(model.get_submodule(n), LoRALinear)
                                       for n in names)  # fmt: skip
    err = float((model(ids) - before).abs().max())
    assert err == 0.0, f"zero B changes the output by {err:.3g}"
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    want = sum(4 * (m.base.in_features + m.base.out_features)
               for m in (model.get_submodule(n) for n in names))  # fmt: skip
    assert sum(trainable.values()) == want and set(trainable) == set(lora_parameters(model))


def test_a_training_step_moves_only_the_adapters_and_merging_keeps_the_logits():
    model = _model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    add_lora(model, TARGETS, rank=4, alpha=8, dropout=0.1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 101, (2, 9))
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    moved = {n.replace(".base", "") for n, p in model.named_parameters()
             if "lora_" not in n and not torch.equal(p, frozen[n.replace(".base", "")])}  # fmt: skip
    assert not moved, moved
    assert all(float(p.detach().abs().max()) > 0 for n, p in lora_parameters(model).items()
               if n.endswith("lora_B"))  # fmt: skip
    model.eval()
    with torch.no_grad():
        adapted = model(ids)
        merged = merge_lora(model)(ids)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    err = float((merged - adapted).abs().max())
    assert err <= 1e-5, f"merged vs adapted: max error {err:.3g}"


def test_bad_targets_and_sizes_are_refused():
    with pytest.raises(ValueError, match=r"LoRA target '\*.nothing' matches no linear"):
        add_lora(_model(), ["*.nothing"])
    for kwargs, match in [({"rank": 0}, "rank"), ({"alpha": -1}, "alpha"),
                          ({"dropout": 1.0}, "dropout")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            add_lora(_model(), TARGETS, **kwargs)
    with pytest.raises(TypeError, match=r"nn\.Linear"):
        LoRALinear(nn.Conv1d(2, 2, 1), rank=2, alpha=2)
