"""A tiny pretrained decoder folder and chat data for the fine-tuning tests
(``tests/cli/test_train_from.py``, ``tests/distributed/test_finetune_torchrun.py``): a
random-weight Llama-style model (GQA) saved as a Hugging Face folder with a word-level
tokenizer and a chat template whose role markers are special tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from qkv.models import DecoderLM, DecoderLMConfig
from qkv.pretrained import DecoderBundle, PretrainedTokenizer, save_hf

WORDS = ["<unk>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>",
         *(f"w{i}" for i in range(58))]  # fmt: skip
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")  # fmt: skip


def tokenizer() -> PretrainedTokenizer:
    import tokenizers as tk

    backend = tk.Tokenizer(tk.models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                               unk_token="<unk>"))  # fmt: skip
    backend.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tk.AddedToken(t, special=True) for t in WORDS[1:6]])
    return PretrainedTokenizer(backend, special_tokens={"bos_token": "<s>",
                               "eos_token": "<|end|>"}, chat_template=TEMPLATE)  # fmt: skip


def tiny_base(folder: Path) -> Path:
    """The base model's folder (written once per call; seeded, so always the same)."""
    torch.manual_seed(0)
    cfg = DecoderLMConfig.llama_style(len(WORDS), d_model=32, num_layers=2, num_heads=4,
                                      num_kv_heads=2, d_ff=64, max_len=128)  # fmt: skip
    return save_hf(DecoderBundle(DecoderLM(cfg), tokenizer(), "tiny"), folder)


def write_chats(path: Path, n: int = 20) -> Path:
    """``n`` conversations: a system word, a user's two words, the assistant's next two."""
    r = random.Random(0)
    lines = []
    for _ in range(n):
        a = r.randrange(20)
        lines.append(json.dumps({"messages": [
            {"role": "system", "content": "w50"},
            {"role": "user", "content": f"w{a} w{a + 1}"},
            {"role": "assistant", "content": f"w{a + 2} w{a + 3}"},
        ]}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
