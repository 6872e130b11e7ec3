"""``qkv.pretrained.save_hf``: qkv models written as Hugging Face folders.

Random-weight GPT-2-, Llama- and BERT-style qkv models are saved; transformers'
``from_pretrained`` must give the same logits (hidden states for BERT) to 1e-5, and
``qkv.pretrained.load`` of the folder must give back the same tensors exactly and the same
config (``dropout`` aside: a loaded model is for inference).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import assert_close
from qkv.models import DecoderLM, DecoderLMConfig, Encoder, EncoderConfig
from qkv.pretrained import DecoderBundle, EncoderBundle, PretrainedTokenizer, load, save_hf
from qkv.pretrained.hf.save import invert_entries
from qkv.pretrained.weights import Entry

V = 48
SMALL = dict(d_model=32, num_layers=2, num_heads=4, max_len=16)
MODELS = {
    "gpt2": lambda: DecoderLM(DecoderLMConfig.gpt2_style(V, **SMALL)),
    "gpt2 untied gelu": lambda: DecoderLM(DecoderLMConfig.gpt2_style(
        V, **SMALL, tie_embeddings=False, activation="gelu", d_ff=40, norm_eps=1e-6, eos_id=3)),
    "llama gqa": lambda: DecoderLM(DecoderLMConfig.llama_style(V, **SMALL, num_kv_heads=2)),
    "llama untied": lambda: DecoderLM(DecoderLMConfig.llama_style(
        V, **SMALL, num_kv_heads=1, d_head=16, tie_embeddings=False, rope_base=500000.0,
        bos_id=1, eos_id=2, pad_id=0)),
    "bert": lambda: Encoder(EncoderConfig(V, **SMALL, dropout=0.0)),
    "bert cls gelu_tanh": lambda: Encoder(EncoderConfig(
        V, **SMALL, pooling="cls", activation="gelu_tanh", type_vocab_size=1, pad_id=None)),
}


def _model(name: str):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():  # nonzero biases and norm weights too, so every tensor matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _config_fields(c):
    return {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "dropout"}


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_loads_equal_outputs_and_qkv_round_trips(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _model(name)
    folder = save_hf(model, tmp_path / "hf")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary left"
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, -3:] = 0
    encoder = isinstance(model, Encoder)
    auto = transformers.AutoModel if encoder else transformers.AutoModelForCausalLM
    hf = auto.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
        out = hf(ids, attention_mask=mask)
    theirs = out.last_hidden_state if encoder else out.logits
    keep = mask.bool()[..., None]
    assert_close(ours * keep, theirs * keep, atol=1e-5, rtol=1e-5, name=f"{name} outputs")

    back = load(folder).model
    assert type(back) is type(model)
    mine, loaded = model.state_dict(), back.state_dict()
    assert list(mine) == list(loaded)
    for key in mine:
        assert torch.equal(mine[key], loaded[key]), f"{key} changed in the round trip"
    ours_c, back_c = _config_fields(model.config), _config_fields(back.config)
    for key in ("d_ff", "d_head", "num_kv_heads"):  # None means the default width / count
        if key in ours_c:
            ours_c[key] = back_c[key] = None
    assert ours_c == back_c


def test_bundle_with_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(V - 3))]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok = PretrainedTokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
                              chat_template=template)
    bundle = DecoderBundle(_model("llama gqa"), tok, "tiny")
    folder = save_hf(bundle, tmp_path / "hf")
    back = load(folder)
    text = "w1 w5 w9 zz"
    assert back.tokenizer.encode(text) == tok.encode(text) == [4, 8, 12, 0]
    assert back.tokenizer.chat_template == template
    assert back.tokenizer.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == [4, 8, 12, 0]

    enc = EncoderBundle(_model("bert cls gelu_tanh"), None, "enc", normalize=False)
    folder = save_hf(enc, tmp_path / "enc")
    again = load(folder)
    assert again.normalize is False and again.model.config.pooling == "cls"


def test_refusals_name_the_option(tmp_path):
    with pytest.raises(ValueError, match="norm_kind='layernorm'"):
        save_hf(DecoderLM(DecoderLMConfig.llama_style(V, **SMALL, norm_kind="layernorm")),
                tmp_path / "a")
    with pytest.raises(ValueError, match="positions='alibi'"):
        save_hf(DecoderLM(DecoderLMConfig.gpt2_style(V, **SMALL, positions="alibi")),
                tmp_path / "b")
    with pytest.raises(ValueError, match="norm='post'"):
        save_hf(DecoderLM(DecoderLMConfig.gpt2_style(V, **SMALL, norm="post")), tmp_path / "c")
    with pytest.raises(ValueError, match="type_vocab_size=0"):
        save_hf(Encoder(EncoderConfig(V, **SMALL, type_vocab_size=0)), tmp_path / "d")
    with pytest.raises(TypeError, match="got Linear"):
        save_hf(torch.nn.Linear(2, 2), tmp_path / "e")
    bundle = DecoderBundle(_model("gpt2"), object(), "x")
    with pytest.raises(TypeError, match="no Hugging Face form"):
        save_hf(bundle, tmp_path / "f")
    assert not list(tmp_path.iterdir()), "a refused save wrote something"
    save_hf(_model("gpt2"), tmp_path / "g")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf(_model("gpt2"), tmp_path / "g")
    save_hf(_model("llama gqa"), tmp_path / "g", overwrite=True)
    assert json.loads((tmp_path / "g" / "config.json").read_text())["model_type"] == "llama"
    (tmp_path / "empty").mkdir()  # issue 27: an existing empty folder was refused
    save_hf(_model("gpt2"), tmp_path / "empty")
    assert (tmp_path / "empty" / "config.json").is_file()


def test_invert_entries_checks_coverage_and_ties():
    a = torch.arange(6.0).reshape(2, 3)
    fused = Entry("fused", (2, 3), (("x", lambda t: t[:, :2]), ("y", lambda t: t[:, 2:])))
    got = invert_entries([fused], {"x": a[:, :2], "y": a[:, 2:]})
    assert torch.equal(got["fused"], a)
    transposed = Entry("w", (3, 2), (("w", lambda t: t.t()),))
    assert torch.equal(invert_entries([transposed], {"w": a})["w"], a.t())
    with pytest.raises(ValueError, match="filled by no model tensor"):
        invert_entries([Entry("fused", (2, 3), (("x", lambda t: t[:, :2]),))], {"x": a[:, :2]})
    tied = Entry("e", (2, 3), (("x", None), ("y", None)))
    with pytest.raises(ValueError, match="differ"):
        invert_entries([tied], {"x": a, "y": a + 1})
    with pytest.raises(ValueError, match="have no Hugging Face name"):
        invert_entries([Entry("x", (2, 3), (("x", None),))], {"x": a, "z": a})


def test_a_file_or_an_empty_path_is_never_written_over(tmp_path):
    """Issue 31: overwrite=True onto a regular file replaced it; '' meant the current folder."""
    model = _model("llama gqa")
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    with pytest.raises(FileExistsError, match="is a file, not a folder"):
        save_hf(model, target, overwrite=True)
    assert target.read_text() == "mine"
    with pytest.raises(ValueError, match="path is empty"):
        save_hf(model, "", overwrite=True)
