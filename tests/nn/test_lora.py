"""LoRA adapters (issue 30): at initialisation the model computes what it did; only the
adapters train (counted); a merged model equals the adapted one; the update is the formula."""

from __future__ import annotations

import json

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


def _trained(rank=4):
    """A Llama-style model with adapters whose B is not zero (as after training)."""
    model = _model().eval()
    add_lora(model, TARGETS, rank=rank, alpha=8)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)
    return model


@torch.no_grad()
def test_adapters_saved_and_loaded_on_a_fresh_base_give_the_same_logits(tmp_path):
    from qkv.checkpoint.adapters import load_adapters, save_adapters

    model, ids = _trained(), torch.randint(0, 101, (2, 9))
    path = save_adapters(model, tmp_path / "adapters.safetensors")
    assert path.stat().st_size < 64_000 and not list(tmp_path.glob(".*tmp"))
    fresh = load_adapters(_model().eval(), path)  # the same base (seed 0)
    err = float((fresh(ids) - model(ids)).abs().max())
    assert err == 0.0, f"max error {err:.3g}"
    assert sum(p.numel() for p in fresh.parameters() if p.requires_grad) == \
        sum(p.numel() for p in lora_parameters(model).values())  # fmt: skip


def test_bad_adapter_files_are_named(tmp_path):
    from safetensors.torch import save_file

    from qkv.checkpoint.adapters import load_adapters, save_adapters
    from qkv.data.files import BadFileError, MissingFileError

    with pytest.raises(MissingFileError, match="no adapter file"):
        load_adapters(_model(), tmp_path / "none.safetensors")
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(BadFileError, match="no qkv LoRA metadata"):
        load_adapters(_model(), plain)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(BadFileError, match="not a safetensors adapter file"):
        load_adapters(_model(), tmp_path / "junk.safetensors")
    path = save_adapters(_trained(rank=4), tmp_path / "a.safetensors")
    other = DecoderLM(DecoderLMConfig.llama_style(vocab_size=101, d_model=64, num_layers=2,
                                                  num_heads=4, num_kv_heads=2))  # fmt: skip
    with pytest.raises(BadFileError, match="shape"):
        load_adapters(other, path)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_adapters(_model(), tmp_path / "b.safetensors")


@torch.no_grad()
def test_a_merged_model_saved_for_transformers_gives_the_adapted_logits(tmp_path):
    """merge_lora, then save_hf: transformers loads the folder and its logits equal the
    adapted qkv model's; an unmerged model is refused with the way out."""
    transformers = pytest.importorskip("transformers")
    from qkv.pretrained import save_hf

    model, ids = _trained(), torch.randint(0, 101, (2, 9))
    with pytest.raises(ValueError, match="merge_lora"):
        save_hf(model, tmp_path / "unmerged")
    adapted = model(ids)
    folder = save_hf(merge_lora(model), tmp_path / "merged")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    err = float((ref(ids).logits - adapted).abs().max())
    assert err <= 1e-4, f"transformers vs adapted qkv: max error {err:.3g}"


@torch.no_grad()
def test_a_checkpoint_of_an_adapted_model_rebuilds_its_adapters(tmp_path):
    """save_checkpoint records the adapted layers; load_checkpoint (building the model itself,
    or into a model given) puts the same adapters back, frozen as before, equal outputs."""
    from qkv.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    model, ids = _trained(), torch.randint(0, 101, (2, 9))
    folder = save_checkpoint(tmp_path / "ckpt", model)
    for into in (None, add_lora_like(model)):
        back = load_checkpoint(folder, into).model.eval()
        err = float((back(ids) - model(ids)).abs().max())
        assert err == 0.0, f"reloaded adapted model: max error {err:.3g}"
        trainable = sorted(n for n, p in back.named_parameters() if p.requires_grad)
        assert trainable == sorted(lora_parameters(model)), trainable
    config = json.loads((folder / "config.json").read_text())
    config["lora"] = {"blocks.0.nothing": {"rank": 2, "alpha": 4.0, "dropout": 0.0}}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"bad 'lora' entry .*blocks.0.nothing"):
        load_checkpoint(folder)


def add_lora_like(model: DecoderLM) -> DecoderLM:
    """A fresh model with adapters on the same layers as ``model`` (zero B)."""
    fresh = _model()
    add_lora(fresh, TARGETS, rank=4, alpha=8)
    return fresh
