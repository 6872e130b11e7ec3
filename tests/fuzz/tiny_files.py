"""Tiny model files for the hostile-file tests and the fuzzers, written inside the tests.

Every file kind qkv reads, from one random model each (a few hundred KiB at most):

* :func:`qkv_checkpoint`: a qkv checkpoint folder saved by qkv itself (optionally with its
  training state);
* :func:`hf_llama` / :func:`hf_bert`: Hugging Face-format folders (``config.json``, weights as
  ``model.safetensors`` or a pickled ``pytorch_model.bin``, tokenizer files, the
  sentence-transformers files for BERT);
* :func:`gguf_llama`: a llama.cpp GGUF file (float32 or Q8_0 tensors, query/key rows permuted
  as llama.cpp's converter does);
* :func:`tokenizer_files`: qkv's char, byte, BPE and WordPiece tokenizer files.

The tensor names come from the loaders' own name tables (``llama_entries``, ``bert_entries``);
whether those tables are right is the parity tests' job (tests/pretrained), not these files'.

Also here: :func:`hard_deadline` (a hang fails the test instead of stalling it) and
:class:`PeakMemory` (how much resident memory a load added).
"""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from qkv.checkpoint import save_checkpoint
from qkv.data.subword import BPETokenizer, WordPieceTokenizer
from qkv.data.tokenizers import ByteTokenizer, CharTokenizer
from qkv.models import DecoderLM, DecoderLMConfig, Encoder, EncoderConfig
from qkv.pretrained.gguf.llama import GGUF_LLAMA_NAMES
from qkv.pretrained.hf.bert import bert_entries
from qkv.pretrained.hf.llama import HF_LLAMA_NAMES, llama_entries


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


SPELL = _bytes_to_unicode()
TOKENS = [SPELL[b] for b in range(256)] + ["he", "hel", "Ġw", "<|end|>", "<s>"]
MERGES = ["h e", "he l", "Ġ w"]
BOS, EOS = len(TOKENS) - 1, len(TOKENS) - 2
# Row lengths are multiples of 32, so every weight can also be stored as Q8_0 blocks.
LM_CONFIG = DecoderLMConfig.llama_style(
    len(TOKENS), d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_len=32,
    tie_embeddings=False, norm_eps=1e-6, bos_id=BOS, eos_id=EOS,
)  # fmt: skip
BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s"] + [
    f"w{i}" for i in range(12)
]
BERT_CONFIG = EncoderConfig(
    vocab_size=len(BERT_WORDS), d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=24,
    type_vocab_size=2, dropout=0.0, norm="post", activation="gelu", norm_eps=1e-12,
    positions="learned", pooling="mean",
)  # fmt: skip
TEXT = "hello world, the tiny corpus says hello again " * 8
# What the fuzzers saw: "loaded" or "refused" (a BadFileError naming the changed file).
OUTCOMES: Counter[str] = Counter()


def tiny_lm(seed: int = 0) -> DecoderLM:
    """A random Llama-style decoder (2 layers x 32, GQA 4/2) with norms away from 1."""
    torch.manual_seed(seed)
    model = DecoderLM(LM_CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=1))


def qkv_checkpoint(folder: Path, *, training: bool = False) -> Path:
    """A qkv checkpoint of :func:`tiny_lm` with a char tokenizer, saved by qkv itself;
    ``training`` adds an AdamW state and a train state (train_state.*)."""
    model = tiny_lm()
    extra = {}
    if training:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        optimizer.step()
        extra = dict(optimizer=optimizer, train_state={"step": 1, "history": [0.5]},
                     train_tensors={"rng": torch.get_rng_state()})  # fmt: skip
    return save_checkpoint(folder, model, tokenizers={"text": CharTokenizer.fit(TEXT)}, **extra)


def _inverse(model: torch.nn.Module, entries, permute=None) -> dict[str, torch.Tensor]:
    """The source tensors ``entries`` map onto ``model``'s parameters (one target each)."""
    params = model.state_dict()
    state = {}
    for e in entries:
        key = e.targets[0][0]
        t = params[key].detach().clone()
        state[e.source] = permute(e.source, t) if permute else t
    return state


def _hf_tokenizer(folder: Path) -> None:
    import tokenizers as tk

    vocab = {tok: i for i, tok in enumerate(TOKENS)}
    backend = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[tuple(m.split()) for m in MERGES]))
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    backend.add_special_tokens([tk.AddedToken(t, special=True) for t in ("<|end|>", "<s>")])
    backend.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {
        "bos_token": "<s>", "eos_token": {"content": "<|end|>"},
        "chat_template": "{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}",
    })  # fmt: skip


def hf_llama_config(**overrides: object) -> dict:
    c = LM_CONFIG
    return {
        "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.d_model,
        "intermediate_size": c.ffn_dim, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "max_position_embeddings": c.max_len, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_base, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": BOS, "eos_token_id": EOS, **overrides,
    }  # fmt: skip


def hf_llama(folder: Path, *, pickled: bool = False, model: DecoderLM | None = None,
             **overrides: object) -> Path:  # fmt: skip
    """A Hugging Face Llama folder of :func:`tiny_lm` (or ``model``): config.json, weights
    (``pytorch_model.bin`` when ``pickled``), tokenizer.json and tokenizer_config.json;
    ``overrides`` replace config.json entries."""
    folder.mkdir(parents=True, exist_ok=True)
    model = model or tiny_lm()
    state = _inverse(model, llama_entries(model.config, HF_LLAMA_NAMES))
    if pickled:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, str(folder / "model.safetensors"))
    _write_json(folder / "config.json", hf_llama_config(**overrides))
    _hf_tokenizer(folder)
    return folder


def hf_bert(folder: Path) -> Path:
    """A sentence-transformers BERT folder: config.json, model.safetensors, vocab.txt,
    modules.json, 1_Pooling/config.json, sentence_bert_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    encoder = Encoder(BERT_CONFIG).eval()
    save_file(_inverse(encoder, bert_entries(BERT_CONFIG, [])), str(folder / "model.safetensors"))
    c = BERT_CONFIG
    _write_json(folder / "config.json", {
        "model_type": "bert", "vocab_size": c.vocab_size, "hidden_size": c.d_model,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "intermediate_size": c.d_ff, "max_position_embeddings": c.max_len,
        "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.norm_eps, "hidden_act": "gelu",
    })  # fmt: skip
    (folder / "vocab.txt").write_text("\n".join(BERT_WORDS) + "\n")
    _write_json(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ])  # fmt: skip
    (folder / "1_Pooling").mkdir()
    _write_json(folder / "1_Pooling" / "config.json",
                {"word_embedding_dimension": c.d_model, "pooling_mode_mean_tokens": True})
    _write_json(folder / "sentence_bert_config.json", {"max_seq_length": 16})
    return folder


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of query/key rows."""
    rows, E = w.shape
    return w.reshape(heads, 2, rows // heads // 2, E).swapaxes(1, 2).reshape(rows, E)


def gguf_llama(path: Path, *, quantized: bool = False, model: DecoderLM | None = None,
               metadata: dict | None = None) -> Path:  # fmt: skip
    """A llama.cpp GGUF file of :func:`tiny_lm` (or ``model``), float32 or Q8_0 (2-D weights);
    ``metadata`` entries (``key: int``) override or add integer keys (written as uint64)."""
    import gguf

    model = model or tiny_lm()
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    meta = {
        "llama.block_count": c.num_layers, "llama.context_length": c.max_len,
        "llama.embedding_length": c.d_model, "llama.feed_forward_length": c.ffn_dim,
        "llama.attention.head_count": c.num_heads, "llama.attention.head_count_kv": c.num_kv_heads,
        "llama.rope.dimension_count": c.head_dim, **(metadata or {}),
    }  # fmt: skip
    for key, value in meta.items():
        w.add_uint64(key, value)
    w.add_float32("llama.rope.freq_base", c.rope_base)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", c.norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - 2) + [3, 3])  # 3 = control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")
    H, Hkv = c.num_heads, c.num_kv_heads

    def permute(name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith("attn_q.weight"):
            return llama_cpp_permute(t, H)
        return llama_cpp_permute(t, Hkv) if name.endswith("attn_k.weight") else t

    for name, t in _inverse(model, llama_entries(c, GGUF_LLAMA_NAMES), permute).items():
        array = np.ascontiguousarray(t.numpy(), dtype=np.float32)
        if quantized and array.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tokenizer_files(folder: Path) -> dict[str, Path]:
    """qkv's four tokenizer files (char, byte, BPE, WordPiece), as their ``save`` writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "char": CharTokenizer.fit(TEXT).save(folder / "char.json"),
        "byte": ByteTokenizer().save(folder / "byte.json"),
        "bpe": BPETokenizer.train(TEXT, 270, min_frequency=1).save(folder / "bpe.json"),
        "wordpiece": WordPieceTokenizer.train(TEXT, 40, min_frequency=1).save(
            folder / "wordpiece.json"),
    }  # fmt: skip


class Hang(BaseException):
    """Raised by :func:`hard_deadline` in the main thread when the block overruns."""


@contextmanager
def hard_deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block with :class:`Hang` after ``seconds`` (SIGALRM, main thread only).

    A Python loop is interrupted; a hang inside one C call is caught when the call returns.
    Off the main thread (or without SIGALRM) the block runs unbounded.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(
            signal, "SIGALRM"):  # fmt: skip
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class PeakMemory:
    """Peak resident memory added since :meth:`reset` (Linux ``/proc/self``; else None)."""

    def __init__(self) -> None:
        self.start = 0

    @staticmethod
    def _hwm() -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    @staticmethod
    def _rss() -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def reset(self) -> None:
        """Start measuring: the kernel's peak is reset to the current resident size."""
        with suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        self.start = self._rss() or 0

    def added(self) -> int | None:
        """Bytes the peak rose above the resident size at :meth:`reset`, or None."""
        hwm = self._hwm()
        return None if hwm is None else max(0, hwm - self.start)
