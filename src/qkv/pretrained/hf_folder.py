"""Loading a Hugging Face-format folder: config, weights and tokenizer -> a bundle.

``config.json``'s ``model_type`` picks the converter:

    "bert"   -> Encoder     (hf_bert)     sentence-transformers files read when present
    "gpt2"   -> DecoderLM   (hf_gpt2)
    "llama"  -> DecoderLM   (hf_llama)

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

from pathlib import Path
from typing import Any

from qkv.data.files import read_json
from qkv.models import DecoderLM, Encoder
from qkv.pretrained.bundle import DecoderBundle, EncoderBundle
from qkv.pretrained.errors import require
from qkv.pretrained.hf_bert import bert_config, load_bert_weights
from qkv.pretrained.hf_common import read_state_dict
from qkv.pretrained.hf_gpt2 import gpt2_config, load_gpt2_weights
from qkv.pretrained.hf_llama import llama_config, load_llama_weights
from qkv.pretrained.tokenizer import PretrainedTokenizer
from qkv.pretrained.weights import skip_init

__all__ = ["MODEL_TYPES", "load_hf_folder", "tokenizer_from_folder"]

MODEL_TYPES = ("bert", "gpt2", "llama")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "cls_token", "sep_token",
                 "mask_token")  # fmt: skip


def _token_text(value: Any) -> str | None:
    """A special token as stored: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


def _backend(folder: Path, tok_config: dict[str, Any]) -> Any | None:
    """A ``tokenizers.Tokenizer`` from the folder's files, or None when there are none."""
    tk = require("tokenizers", "tokenizers")
    if (folder / "tokenizer.json").is_file():
        return tk.Tokenizer.from_file(str(folder / "tokenizer.json"))
    if (folder / "vocab.txt").is_file():
        wp = tk.Tokenizer(tk.models.WordPiece.from_file(str(folder / "vocab.txt"),
                                                        unk_token="[UNK]"))  # fmt: skip
        wp.normalizer = tk.normalizers.BertNormalizer(
            lowercase=bool(tok_config.get("do_lower_case", True))
        )
        wp.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
        cls_id, sep_id = wp.token_to_id("[CLS]"), wp.token_to_id("[SEP]")
        if cls_id is not None and sep_id is not None:
            wp.post_processor = tk.processors.BertProcessing(("[SEP]", sep_id), ("[CLS]", cls_id))
        wp.decoder = tk.decoders.WordPiece()
        return wp
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        bpe = tk.Tokenizer(tk.models.BPE.from_file(str(folder / "vocab.json"),
                                                   str(folder / "merges.txt")))  # fmt: skip
        bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = tk.decoders.ByteLevel()
        return bpe
    return None


def tokenizer_from_folder(
    folder: str | Path, *, max_length: int | None = None
) -> PretrainedTokenizer | None:
    """The tokenizer of a Hugging Face folder, or None when it has no tokenizer files.

    Args:
        folder: the model folder.
        max_length: truncate encodings to this many ids (None: never).

    Raises:
        ImportError: ``tokenizers`` missing (with the install command).
        ValueError: malformed JSON files.
    """
    folder = Path(folder)
    tok_config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            tok_config.update(read_json(folder / name))
    backend = _backend(folder, tok_config)
    if backend is None:
        return None
    special = {k: _token_text(tok_config.get(k)) for k in _SPECIAL_KEYS}
    special = {k: v for k, v in special.items() if v is not None and backend.token_to_id(v)
               is not None}  # fmt: skip
    return PretrainedTokenizer(
        backend, max_length=max_length, special_tokens=special,
        chat_template=_chat_template(folder, tok_config),
    )


def _sentence_transformers(folder: Path, hf: dict[str, Any]) -> tuple[str, bool, int]:
    """``(pooling, normalize, max_length)`` from sentence-transformers files, or defaults."""
    pooling, normalize = "mean", True
    max_length = int(hf.get("max_position_embeddings", 512))
    if (folder / "sentence_bert_config.json").is_file():
        max_length = int(read_json(folder / "sentence_bert_config.json").get(
            "max_seq_length", max_length))  # fmt: skip
    if (folder / "modules.json").is_file():
        modules = read_json_list(folder / "modules.json")
        types = [str(m.get("type", "")) for m in modules]
        normalize = any(t.endswith("Normalize") for t in types)
        for m in modules:
            if str(m.get("type", "")).endswith("Pooling"):
                cfg = read_json(folder / m.get("path", "1_Pooling") / "config.json")
                modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
                mapping = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
                if len(modes) != 1 or modes[0] not in mapping:
                    raise ValueError(
                        f"{folder}: sentence-transformers pooling {modes} is not supported "
                        "(mean or cls only)"
                    )
                pooling = mapping[modes[0]]
    return pooling, normalize, max_length


def read_json_list(path: Path) -> list[dict[str, Any]]:
    """``modules.json`` is a JSON list; read it with the same error messages as objects."""
    import json

    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list, got {type(data).__name__}")
    return [m for m in data if isinstance(m, dict)]


def load_hf_folder(folder: str | Path, *, name: str | None = None) -> EncoderBundle | DecoderBundle:
    """Load a Hugging Face-format folder (BERT, GPT-2 or Llama family) into a bundle.

    Args:
        folder: holds ``config.json`` and the weights.
        name: the name to show (default: the folder).

    Returns:
        An :class:`EncoderBundle` (BERT) or :class:`DecoderBundle` (GPT-2, Llama), model in
        eval mode, float32.

    Raises:
        FileNotFoundError: no ``config.json`` or no weights.
        ValueError: an unsupported ``model_type`` (the known ones are listed), unsupported
            options, or missing, unexpected or misshaped tensors (named).
    """
    folder = Path(folder)
    where = str(folder)
    hf = read_json(folder / "config.json")
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(
            f"{where}: config.json model_type={kind!r} is not supported; known: {MODEL_TYPES}"
        )
    state = read_state_dict(folder)
    source = {"format": "huggingface", "model_type": kind, "path": where}
    name = name or where
    if kind == "bert":
        pooling, normalize, max_length = _sentence_transformers(folder, hf)
        with skip_init():
            encoder = Encoder(bert_config(hf, where=where, pooling=pooling))
        load_bert_weights(encoder, state, where=where)
        max_length = min(max_length, encoder.config.max_len)
        return EncoderBundle(encoder.eval(), tokenizer_from_folder(folder, max_length=max_length),
                             name, source, normalize=normalize)  # fmt: skip
    config = gpt2_config(hf, where=where) if kind == "gpt2" else llama_config(hf, where=where)
    with skip_init():
        decoder = DecoderLM(config)
    (load_gpt2_weights if kind == "gpt2" else load_llama_weights)(decoder, state, where=where)
    return DecoderBundle(decoder.eval(), tokenizer_from_folder(folder), name, source)
