"""Checkpoints: round trips (weights, tied weights, tokenizers, optimizer, RNG), only
safetensors + JSON on disk, atomic replacement when a save crashes, and a clear error naming
the file for every kind of damage or mismatch."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import qkv.checkpoint.folder as ckmod
from qkv.data import ByteTokenizer, CharTokenizer
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.train import CheckpointError, TrainConfig, load_checkpoint, make_optimizer, save_checkpoint
from qkv.train.state import get_rng, set_rng


def _lm(seed=0, **overrides):
    torch.manual_seed(seed)
    sizes = dict(d_model=16, num_layers=2, num_heads=2, max_len=16)
    config = DecoderLMConfig.gpt2_style(30, **{**sizes, **overrides})
    return DecoderLM(config)


def _s2s(seed=0, share=False):
    torch.manual_seed(seed)
    V = 20 if share else 22
    return Seq2SeqTransformer(Seq2SeqConfig(20, V, d_model=16, num_heads=2, d_ff=32, tie_embeddings=True,
                                            share_embeddings=share))


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _trained_optimizer(model):
    optimizer = make_optimizer(model, TrainConfig(lr=1e-2, warmup=1))
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    model(torch.randint(0, 30, (2, 5))).sum().backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("make", [_lm, _s2s, lambda: _s2s(share=True)])
def test_model_round_trip_builds_the_model_from_config(tmp_path, make):
    model = make()
    tok = CharTokenizer.fit("hello world")
    save_checkpoint(tmp_path / "ck", model, tokenizers={"src": tok, "tgt": ByteTokenizer()})
    ckpt = load_checkpoint(tmp_path / "ck")
    assert type(ckpt.model) is type(model) and ckpt.model.config == model.config
    assert _same_weights(ckpt.model, model)
    assert ckpt.tokenizers["src"].chars == tok.chars
    assert isinstance(ckpt.tokenizers["tgt"], ByteTokenizer)
    assert ckpt.train_state is None
    # Only safetensors and JSON on disk: nothing that could hold pickled code.
    assert {p.suffix for p in (tmp_path / "ck").iterdir()} == {".safetensors", ".json"}


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    model = _lm()
    save_checkpoint(tmp_path / "ck", model)
    stored = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert "embed.weight" in stored and "lm_head.weight" not in stored
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert config["tied"] == {"lm_head.weight": "embed.weight"}
    loaded = load_checkpoint(tmp_path / "ck").model
    assert loaded.lm_head.weight is loaded.embed.weight
    assert _same_weights(loaded, model)


def test_views_of_one_storage_are_saved_as_copies(tmp_path):
    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(12.0))

        def state_dict(self, *args, **kwargs):  # two views of one tensor, as packed weights give
            return {"w": self.w, "w_half": self.w.detach()[6:]}

    save_checkpoint(tmp_path / "ck", Packed())
    stored = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert torch.equal(stored["w_half"], torch.arange(6.0, 12.0))


def test_optimizer_and_rng_round_trip(tmp_path):
    model = _lm()
    optimizer = _trained_optimizer(model)
    torch.manual_seed(3), random.seed(4), np.random.seed(5)
    info, tensors = get_rng()
    save_checkpoint(tmp_path / "ck", model, optimizer=optimizer, train_state={"step": 7, "rng": info},
                    train_tensors=tensors)  # fmt: skip
    expected = (torch.rand(3), random.random(), np.random.rand())

    fresh = _lm(seed=1)
    fresh_opt = make_optimizer(fresh, TrainConfig())
    ckpt = load_checkpoint(tmp_path / "ck", fresh, optimizer=fresh_opt)
    assert ckpt.train_state["step"] == 7 and _same_weights(fresh, model)
    a, b = optimizer.state_dict(), fresh_opt.state_dict()
    for index, entries in a["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, b["state"][index][key]), f"optimizer {index}.{key}"
    assert a["param_groups"] == b["param_groups"]
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    set_rng(ckpt.train_state["rng"], ckpt.train_tensors, "test")
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


def test_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model = _lm()
    save_checkpoint(tmp_path / "last", model)
    changed = _lm(seed=5)

    def half_then_crash(tensors, path, *args, **kwargs):
        save_file(tensors, path)
        with open(path, "r+b") as f:  # leave a truncated file behind, as a crash would
            f.truncate(100)
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckmod, "save_file", half_then_crash)
    with pytest.raises(OSError, match=r"disk full"):
        save_checkpoint(tmp_path / "last", changed)
    monkeypatch.undo()
    assert _same_weights(load_checkpoint(tmp_path / "last").model, model)
    assert [p.name for p in tmp_path.iterdir()] == ["last"], "temporary folders left behind"


def test_crash_between_the_two_renames_is_recovered(tmp_path, monkeypatch):
    model = _lm()
    save_checkpoint(tmp_path / "last", model)
    real_replace = ckmod.os.replace
    calls = []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(ckmod.os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "last", _lm(seed=5))
    monkeypatch.undo()
    assert not (tmp_path / "last").exists()
    # The old checkpoint was moved aside, not deleted: loading finds it.
    assert _same_weights(load_checkpoint(tmp_path / "last").model, model)


@pytest.fixture
def saved(tmp_path):
    model = _lm()
    optimizer = _trained_optimizer(model)
    folder = save_checkpoint(tmp_path / "ck", model, optimizer=optimizer, train_state={"step": 1},
                             tokenizers={"text": CharTokenizer.fit("ab")})  # fmt: skip
    return folder, model


def test_truncated_safetensors(saved):
    folder, _ = saved
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file, truncated or corrupt"):
        load_checkpoint(folder)


def test_missing_tensor(saved):
    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["blocks.1.self_attn.q_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensors do not match the model: missing \['blocks.1.self_attn.q_proj.weight'\]"):
        load_checkpoint(folder)


def test_wrong_shape(saved):
    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["pos.weight"] = torch.zeros(3, 16)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'pos.weight' has shape \(3, 16\), the model expects \(16, 16\)"):
        load_checkpoint(folder)


def test_unexpected_tensor(saved):
    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected \['extra.weight'\]"):
        load_checkpoint(folder)


@pytest.mark.parametrize("name", ["config.json", "train_state.json", "tokenizer-text.json"])
def test_bad_json(saved, name):
    folder, _ = saved
    (folder / name).write_text('{"format": ')
    with pytest.raises(CheckpointError, match=rf"{name}( is not valid JSON|: cannot read tokenizer)"):
        load_checkpoint(folder, _lm(), optimizer=make_optimizer(_lm(), TrainConfig()))


def test_wrong_model_class(saved):
    folder, _ = saved
    with pytest.raises(CheckpointError, match=r"config.json: the checkpoint holds a 'DecoderLM', but the model given is a 'Seq2SeqTransformer'"):
        load_checkpoint(folder, _s2s())


def test_mismatched_model_config(saved):
    folder, _ = saved
    with pytest.raises(CheckpointError, match=r"config.json: model_config differs from the model's .*num_layers: 2 vs 3"):
        load_checkpoint(folder, _lm(num_layers=3))


def test_unknown_model_class_and_format(saved):
    folder, _ = saved
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_class": "os.system"}))
    with pytest.raises(CheckpointError, match=r"model_class 'os.system' is not one qkv can build"):
        load_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps({**config, "format": "pickle"}))
    with pytest.raises(CheckpointError, match=r"config.json: format is 'pickle', not 'qkv.checkpoint'"):
        load_checkpoint(folder)


def test_optimizer_mismatch_and_missing_state_files(saved, tmp_path):
    folder, model = saved
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(CheckpointError, match=r"train_state.json \+ train_state.safetensors: optimizer state for 2 groups"):
        load_checkpoint(folder, _lm(), optimizer=other)
    (folder / "train_state.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"train_state.safetensors: file missing"):
        load_checkpoint(folder)
    with pytest.raises(CheckpointError, match=r"no checkpoint folder there"):
        load_checkpoint(tmp_path / "nothing")
    save_checkpoint(tmp_path / "model_only", model)
    with pytest.raises(CheckpointError, match=r"a model-only checkpoint has no optimizer state"):
        load_checkpoint(tmp_path / "model_only", optimizer=make_optimizer(model, TrainConfig()))
