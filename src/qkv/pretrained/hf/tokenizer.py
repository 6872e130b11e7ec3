"""The tokenizer of a Hugging Face folder: ``tokenizer.json``, or the older files.

``tokenizer.json`` when there is one; otherwise the tokenizer is rebuilt from ``vocab.txt``
(WordPiece) or ``vocab.json`` + ``merges.txt`` (byte-level BPE). Special tokens and the chat
template come from ``special_tokens_map.json`` / ``tokenizer_config.json`` (or
``chat_template.jinja``). Every loader of Hugging Face folders (decoders, encoders,
encoder-decoders) reads tokenizers here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.data.files import BadFileError, read_json, reading
from qkv.pretrained.errors import require
from qkv.pretrained.tokenizer import PretrainedTokenizer

__all__ = ["tokenizer_from_folder"]

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
        with reading(jinja, "a UTF-8 Jinja template"):
            template = jinja.read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt",
                   "tokenizer_config.json", "special_tokens_map.json")


def _refuse_non_files(folder: Path) -> None:
    """A tokenizer file name that is a folder (or anything but a file) is refused: skipping it
    loaded a model with no tokenizer and no word (issue 31)."""
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.exists() and not path.is_file():
            raise BadFileError(f"{path}: expected a file, found a "
                               f"{'folder' if path.is_dir() else 'special file'}", path=path)


def _backend(folder: Path, tok_config: dict[str, Any]) -> Any | None:
    """A ``tokenizers.Tokenizer`` from the folder's files, or None when there are none.

    The ``tokenizers`` library parses the files; what it refuses (its own exception type, or a
    panic) becomes a BadFileError naming the file.
    """
    tk = require("tokenizers", "tokenizers")
    if (folder / "tokenizer.json").is_file():
        with reading(folder / "tokenizer.json", "a tokenizers library tokenizer.json",
                     errors=(Exception,)):  # fmt: skip
            return tk.Tokenizer.from_file(str(folder / "tokenizer.json"))
    if (folder / "vocab.txt").is_file():
        with reading(folder / "vocab.txt", "a WordPiece vocabulary, one token a line",
                     errors=(Exception,)):  # fmt: skip
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
        with reading(folder / "vocab.json", "a byte-level BPE vocab.json with its merges.txt",
                     errors=(Exception,)):  # fmt: skip
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
        qkv.data.files.BadFileError (a ValueError): a tokenizer file that is malformed,
            that the ``tokenizers`` library refuses, or that is a folder (named).
    """
    folder = Path(folder)
    _refuse_non_files(folder)
    tok_config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            tok_config.update(read_json(folder / name))
    with reading(folder / "tokenizer_config.json", "a tokenizer configuration"):
        template = _chat_template(folder, tok_config)
    backend = _backend(folder, tok_config)
    if backend is None:
        return None
    special = {k: _token_text(tok_config.get(k)) for k in _SPECIAL_KEYS}
    special = {k: v for k, v in special.items() if v is not None and backend.token_to_id(v)
               is not None}  # fmt: skip
    return PretrainedTokenizer(backend, max_length=max_length, special_tokens=special,
                               chat_template=template)  # fmt: skip
