"""Loading a Hugging Face-format folder: config, weights and tokenizer -> a bundle.

``config.json``'s ``model_type`` picks the converter:

    "bert"   -> Encoder     (hf.bert)     sentence-transformers files read when present
    "gpt2"   -> DecoderLM   (hf.gpt2)
    "llama"  -> DecoderLM   (hf.llama)     RoPE scaling, attention biases
    "mistral", "qwen2", "qwen3", "gemma2", "phi3"
             -> DecoderLM   (hf.decoders)  Llama plus generic options
    "bart", "t5", "marian"
             -> Seq2SeqTransformer (hf.seq2seq)

The tokenizer is ``tokenizer.json`` when there is one; otherwise it is rebuilt from the older
files (``vocab.txt`` for WordPiece; ``vocab.json`` + ``merges.txt`` for byte-level BPE); a folder
with none of them loads with ``tokenizer=None``. Special tokens and the chat template come from
``tokenizer_config.json`` (or ``chat_template.jinja``).

For sentence-transformers folders (all-MiniLM-L6-v2) the input limit is
``sentence_bert_config.json``'s ``max_seq_length`` (256), the pooling is
``1_Pooling/config.json``'s, and normalisation follows ``modules.json``; a plain BERT folder
gets mean pooling and normalisation.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkv.checks import positive_int
from qkv.data.files import BadFileError, read_json, reading
from qkv.models import DecoderLM, Encoder
from qkv.pretrained.bundle import DecoderBundle, EncoderBundle
from qkv.pretrained.hf.bert import bert_config, bert_entries, bert_ignored
from qkv.pretrained.hf.common import build_checked, check_folder_model, open_weights
from qkv.pretrained.hf.decoders import HF_DECODERS
from qkv.pretrained.hf.gpt2 import gpt2_config, gpt2_entries, gpt2_ignored
from qkv.pretrained.hf.llama import HF_LLAMA_NAMES, llama_config, llama_entries, llama_ignored
from qkv.pretrained.hf.tokenizer import tokenizer_from_folder
from qkv.pretrained.weights import Entry

__all__ = ["MODEL_TYPES", "load_hf_folder", "tokenizer_from_folder"]

SEQ2SEQ_TYPES = ("bart", "t5", "marian")  # loaded by qkv.pretrained.hf.seq2seq
MODEL_TYPES = ("bert", "gpt2", "llama", *HF_DECODERS, *SEQ2SEQ_TYPES)
def _pooling_folder(folder: Path, modules_file: Path, value: Any) -> Path:
    """The pooling module's folder named in ``modules.json``: a relative path inside ``folder``."""
    if not isinstance(value, str) or not value or Path(value).is_absolute() or ".." in Path(
            value).parts:  # fmt: skip
        raise BadFileError(f"{modules_file}: module path {value!r} is not a folder inside "
                           f"{folder}", path=modules_file)  # fmt: skip
    return folder / value


def _sentence_transformers(folder: Path, hf: dict[str, Any]) -> tuple[str, bool, int]:
    """``(pooling, normalize, max_length)`` from sentence-transformers files, or defaults."""
    pooling, normalize = "mean", True
    with reading(folder / "config.json", "a BERT config.json"):
        max_length = positive_int("max_position_embeddings",
                                  hf.get("max_position_embeddings", 512))  # fmt: skip
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file():
        with reading(st_config, "a sentence-transformers config"):
            max_length = positive_int("max_seq_length",
                                      read_json(st_config).get("max_seq_length", max_length))
    modules_file = folder / "modules.json"
    if modules_file.is_file():
        modules = [m for m in read_json(modules_file, kind=list) if isinstance(m, dict)]
        types = [str(m.get("type", "")) for m in modules]
        normalize = any(t.endswith("Normalize") for t in types)
        for m, kind in zip(modules, types, strict=True):
            if kind.endswith("Pooling"):
                cfg_file = _pooling_folder(folder, modules_file, m.get("path", "1_Pooling"))
                cfg = read_json(cfg_file / "config.json")
                modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
                mapping = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
                if len(modes) != 1 or modes[0] not in mapping:
                    raise BadFileError(
                        f"{cfg_file / 'config.json'}: sentence-transformers pooling {modes} is "
                        "not supported (expected one of mean or cls)",
                        path=cfg_file / "config.json",
                    )
                pooling = mapping[modes[0]]
    return pooling, normalize, max_length


@dataclass(frozen=True)
class _Family:
    """How one ``model_type`` becomes a qkv model: config, tensor names, unused names."""

    model: type[nn.Module]
    entries: Callable[[Any, Iterable[str]], list[Entry]]
    ignored: Callable[[Any], Callable[[str], bool]]


_FAMILIES = {
    "bert": _Family(Encoder, bert_entries, lambda c: bert_ignored),
    "gpt2": _Family(DecoderLM, gpt2_entries, gpt2_ignored),
    "llama": _Family(DecoderLM, lambda c, names: llama_entries(c, HF_LLAMA_NAMES), llama_ignored),
    **{kind: _Family(DecoderLM, lambda c, names, f=family: f.entries(c), family.ignored)
       for kind, family in HF_DECODERS.items()},
}


def _config(kind: str, hf: dict[str, Any], folder: Path, config_file: Path) -> tuple[Any, tuple]:
    """The qkv config for ``config.json`` (and, for BERT, the sentence-transformers extras)."""
    where = str(config_file)
    extras: tuple = ()
    with reading(config_file, f"a Hugging Face {kind} config.json"):
        if kind == "bert":
            extras = _sentence_transformers(folder, hf)
            return bert_config(hf, where=where, pooling=extras[0]), extras
        if kind == "gpt2":
            return gpt2_config(hf, where=where), extras
        if kind in HF_DECODERS:
            return HF_DECODERS[kind].config(hf, where=where), extras
        return llama_config(hf, where=where), extras


def _untie_if_distinct(config: Any, weights: Any, kind: str, config_file: Path) -> Any:
    """A Llama-like config that says ``tie_word_embeddings`` while the folder stores an
    ``lm_head.weight`` unequal to the embeddings is loaded untied, with that head, as
    transformers loads it (it warns and does not tie); a warning names the file."""
    if kind in ("bert", "gpt2") or not getattr(config, "tie_embeddings", False):
        return config
    embed, head = HF_LLAMA_NAMES["embed"], HF_LLAMA_NAMES["lm_head"]
    if head not in weights.shapes or weights.shapes[head] != weights.shapes.get(embed):
        return config
    found = weights.read_some((embed, head))
    if len(found) < 2 or torch.equal(found[embed], found[head]):
        return config
    warnings.warn(f"{config_file}: tie_word_embeddings is true but {head} differs from the "
                  f"embeddings; loaded untied with the stored head, as transformers does "
                  f"(set tie_word_embeddings to false to silence this)", stacklevel=3)
    return dataclasses.replace(config, tie_embeddings=False)


def load_hf_folder(folder: str | Path, *, name: str | None = None) -> Any:
    """Load a Hugging Face-format folder (BERT, GPT-2, the Llama-like decoders, or an
    encoder-decoder: BART, T5, Marian) into a bundle.

    ``config.json`` is checked against the weights' header (names and shapes) before the model
    is built (see :mod:`qkv.checkpoint.backing`), and the weights are checked finite once read.

    Args:
        folder: holds ``config.json`` and the weights.
        name: the name to show (default: the folder).

    Returns:
        An :class:`EncoderBundle` (BERT), a :class:`DecoderBundle` (GPT-2, Llama, Mistral,
        Qwen2, Qwen3, Gemma 2, Phi-3) or the encoder-decoder bundle of
        :func:`qkv.pretrained.hf.seq2seq.load_hf_seq2seq_folder`; model in eval mode, float32.

    Raises:
        qkv.data.files.MissingFileError (a FileNotFoundError): no ``config.json`` or no
            weights.
        qkv.data.files.BadFileError (a ValueError): an unsupported ``model_type`` (the known
            ones are listed), unsupported options, sizes the weights do not back, missing,
            unexpected, misshaped or non-finite tensors (named), malformed tokenizer files;
            every message names the file.
    """
    folder = Path(folder)
    config_file = folder / "config.json"
    hf = read_json(config_file, what="config.json")
    kind = hf.get("model_type")
    if kind in SEQ2SEQ_TYPES:
        from qkv.pretrained.hf.seq2seq import load_hf_seq2seq_folder

        return load_hf_seq2seq_folder(folder, hf, name=name)
    if not isinstance(kind, str) or kind not in MODEL_TYPES:
        raise BadFileError(
            f"{config_file}: config.json model_type={kind!r} is not supported; known: "
            f"{MODEL_TYPES}",
            path=config_file,
        )
    family = _FAMILIES[kind]
    weights = open_weights(folder)  # the header only: shapes, no data
    config, extras = _config(kind, hf, folder, config_file)
    config = _untie_if_distinct(config, weights, kind, config_file)
    ignored = family.ignored(config)
    entries = check_folder_model(config, weights, family.model, entries=family.entries,
                                 ignored=ignored, config_file=config_file)  # fmt: skip
    # The tokenizer files are small: read them before the weights, so a bad one fails early.
    if kind == "bert":
        _, normalize, max_length = extras
        tokenizer = tokenizer_from_folder(folder, max_length=min(max_length, config.max_len))
    else:
        tokenizer = tokenizer_from_folder(folder)
    model = build_checked(config, weights, family.model, entries, ignored)
    source = {"format": "huggingface", "model_type": kind, "path": str(folder)}
    name = name or str(folder)
    if kind == "bert":
        return EncoderBundle(model, tokenizer, name, source, normalize=normalize)
    return DecoderBundle(model, tokenizer, name, source)
