"""Hugging Face-format folders and qkv checkpoints, made inside the tests from random models.

GPT-2 (safetensors and pickled ``pytorch_model.bin``, tied and untied head), Llama (GQA, RoPE
base) and BERT folders written by transformers' ``save_pretrained`` load into qkv models whose
outputs equal the originals'; a folder with a missing, unexpected or misshaped tensor fails
naming it; a qkv checkpoint round-trips.
"""

from __future__ import annotations

import json

import pytest
import torch
from pretrained_refs import need

import qkv.pretrained
from helpers import assert_close
from qkv.models import DecoderLM, DecoderLMConfig, Encoder
from qkv.pretrained import DecoderBundle, EncoderBundle


def _gpt2(tmp_path, *, tied=True, safe=True, **overrides):
    transformers = need("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=40, n_embd=48, n_layer=2, n_head=4,
        tie_word_embeddings=tied, **overrides,
    )  # fmt: skip
    ref = transformers.GPT2LMHeadModel(config).eval()
    ref.save_pretrained(tmp_path, safe_serialization=safe)
    return ref


def _ids(V: int, B: int = 2, T: int = 13) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("tied", "safe"), [(True, True), (False, True), (True, False)],
                         ids=["tied-safetensors", "untied", "pytorch_model.bin"])
def test_gpt2_folder_matches_transformers(tmp_path, tied, safe):
    ref = _gpt2(tmp_path, tied=tied, safe=safe)
    bundle = qkv.pretrained.load(tmp_path)
    assert isinstance(bundle, DecoderBundle) and bundle.tokenizer is None
    assert bundle.config.tie_embeddings == tied and bundle.config.activation == "gelu_tanh"
    ids = _ids(97)
    with torch.no_grad():
        assert_close(bundle.model(ids), ref(ids).logits, atol=1e-5, name="GPT-2 logits")


def test_gpt2_greedy_ids_without_a_tokenizer(tmp_path):
    ref = _gpt2(tmp_path)
    bundle = qkv.pretrained.load(str(tmp_path))
    prompt = [5, 17, 33]
    ours = bundle.generate_ids(prompt, max_new_tokens=6)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert len(ours) == 6 and ours == out[0, 3:].tolist()
    with pytest.raises(TypeError, match="has no tokenizer; pass the prompt as token ids"):
        bundle.generate("text")


def test_llama_folder_matches_transformers(tmp_path):
    transformers = need("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.save_pretrained(tmp_path)
    bundle = qkv.pretrained.load(tmp_path)
    assert (bundle.config.num_kv_heads, bundle.config.rope_base) == (2, 5000.0)
    ids = _ids(101)
    with torch.no_grad():
        assert_close(bundle.model(ids), ref(ids).logits, atol=1e-5, name="Llama logits")


def test_bert_folder_matches_transformers(tmp_path):
    transformers = need("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=80, max_position_embeddings=32,
    )  # fmt: skip
    ref = transformers.BertModel(config, add_pooling_layer=True).eval()
    ref.save_pretrained(tmp_path)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s"]
    (tmp_path / "vocab.txt").write_text("\n".join(words + [f"w{i}" for i in range(42)]))
    bundle = qkv.pretrained.load(tmp_path)
    assert isinstance(bundle, EncoderBundle) and isinstance(bundle.model, Encoder)
    assert bundle.tokenizer.encode("Hello worlds") == [2, 5, 6, 7, 3]
    ids, keep = bundle.tokenizer.encode_batch(["hello", "hello world worlds"])
    with torch.no_grad():
        ours = bundle.model(ids, attention_mask=keep)
        theirs = ref(input_ids=ids, attention_mask=keep.long()).last_hidden_state
    real = keep[..., None]
    assert_close(ours * real, theirs * real, atol=1e-5, name="BERT hidden states")
    assert bundle.encode(["hello", "world"]).shape == (2, 48)


def _edit_safetensors(folder, edit):
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("transformer.h.1.mlp.c_fc.weight"),
         r"missing tensor\(s\) 'transformer.h.1.mlp.c_fc.weight'"),
        (lambda s: s.__setitem__("transformer.h.0.extra.weight", torch.zeros(2)),
         r"unexpected tensor\(s\) 'transformer.h.0.extra.weight'"),
        (lambda s: s.__setitem__("transformer.wpe.weight", torch.zeros(41, 48)),
         r"misshaped tensor\(s\): 'transformer.wpe.weight' has shape \(41, 48\), "
         r"expected \(40, 48\)"),
    ],
    ids=["missing", "unexpected", "misshaped"],
)
def test_bad_folder_names_the_tensor(tmp_path, edit, message):
    _gpt2(tmp_path)
    _edit_safetensors(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        qkv.pretrained.load(tmp_path)


def test_unsupported_folders_say_why(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(ValueError, match=r"model_type='falcon' is not supported; known: "
                       r"\('bert', 'gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', "
                       r"'phi3', 'bart', 't5', 'marian'\)"):
        qkv.pretrained.load(tmp_path)
    _gpt2(tmp_path, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True is not supported"):
        qkv.pretrained.load(tmp_path)


def test_folder_without_weights_or_model(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no model: expected config\.json"):
        qkv.pretrained.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 5}))
    with pytest.raises(FileNotFoundError, match=r"has no weights: expected model\.safetensors"):
        qkv.pretrained.load(tmp_path)


def test_qkv_checkpoint_round_trips(tmp_path):
    from qkv.train.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama_style(61, d_model=32, num_layers=2, num_heads=4,
                                                  num_kv_heads=2, max_len=64)).eval()  # fmt: skip
    save_checkpoint(tmp_path / "ckpt", model)
    bundle = qkv.pretrained.load(tmp_path / "ckpt")
    assert isinstance(bundle, DecoderBundle) and bundle.source["format"] == "qkv.checkpoint"
    ids = _ids(61)
    with torch.no_grad():
        assert_close(bundle.model(ids), model(ids), atol=0.0, name="checkpoint logits")


def test_qkv_encoder_checkpoint_with_its_tokenizer(tmp_path):
    from qkv.data.tokenizers import ByteTokenizer
    from qkv.models import EncoderConfig
    from qkv.train.checkpoint import save_checkpoint

    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = Encoder(EncoderConfig(tok.vocab_size, d_model=16, num_layers=1, num_heads=2)).eval()
    save_checkpoint(tmp_path / "enc", model, tokenizers={"text": tok})
    bundle = qkv.pretrained.load(tmp_path / "enc")
    assert isinstance(bundle, EncoderBundle)
    emb = bundle.encode(["ab", "", "abc"])
    assert emb.shape == (3, 16) and not emb.isnan().any()
    assert_close(emb[1], torch.zeros(16), atol=0.0, name="empty text")
    assert_close(emb[0].norm(), torch.tensor(1.0), atol=1e-6, name="norm")
    assert bundle.tokenizer.decode(bundle.tokenizer.encode("héllo")) == "héllo"
