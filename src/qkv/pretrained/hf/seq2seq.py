"""Loading a Hugging Face encoder-decoder folder (BART, T5, Marian) into a :class:`Seq2SeqBundle`.

``config.json``'s ``model_type`` picks the adapter, which only maps names and options:

    "bart"    -> hf.bart      learned positions (offset 2), embedding LayerNorm, GELU
    "marian"  -> hf.marian    split sinusoidal positions, sqrt(E) embedding scale, SiLU
    "t5"      -> hf.t5        pre-norm RMSNorm, relative position bias, no biases

The steps are those of every qkv loader (:mod:`qkv.checkpoint.backing`): the config is checked
against the weights' header (sizes, then every tensor's name and shape) and the model is built
on the meta device before anything is allocated; then the tokenizer files are read (small,
so a bad one fails before the weights are), the weights read and checked finite, and copied
by the adapter's explicit name map.

Tokenizer: ``tokenizer.json`` when the folder has one (special tokens from
``tokenizer_config.json`` / ``special_tokens_map.json``); otherwise Marian's sentencepiece
files (:class:`~qkv.pretrained.hf.marian.MarianTokenizer`, needs ``sentencepiece``); a folder
with neither loads with ``tokenizer=None`` (inputs are then token ids).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.data.files import BadFileError, read_json, reading
from qkv.models import Seq2SeqConfig, Seq2SeqTransformer
from qkv.pretrained.generation_config import read_generation_config
from qkv.pretrained.hf.bart import bart_config, bart_entries, bart_ignored
from qkv.pretrained.hf.common import build_checked, check_folder_model, open_weights
from qkv.pretrained.hf.marian import (
    MarianTokenizer,
    marian_config,
    marian_entries,
    marian_ignored,
)
from qkv.pretrained.hf.t5 import t5_config, t5_entries, t5_ignored
from qkv.pretrained.hf.tokenizer import tokenizer_from_folder
from qkv.pretrained.seq2seq_bundle import Seq2SeqBundle
from qkv.pretrained.tokenizer import PretrainedTokenizer
from qkv.pretrained.weights import Entry

__all__ = ["SEQ2SEQ_TYPES", "load_hf_seq2seq_folder", "seq2seq_tokenizer"]

@dataclass(frozen=True)
class _Family:
    """How one ``model_type`` becomes a :class:`Seq2SeqConfig` and a name map."""

    config: Callable[[dict[str, Any], str, Iterable[str]], Seq2SeqConfig]
    entries: Callable[[Seq2SeqConfig, Iterable[str]], list[Entry]]
    ignored: Callable[[Seq2SeqConfig], Callable[[str], bool]]


_FAMILIES = {
    "bart": _Family(lambda hf, where, names: bart_config(hf, where=where), bart_entries,
                    bart_ignored),
    "marian": _Family(lambda hf, where, names: marian_config(hf, where=where), marian_entries,
                      marian_ignored),
    "t5": _Family(lambda hf, where, names: t5_config(hf, where=where, names=names), t5_entries,
                  t5_ignored),
}
SEQ2SEQ_TYPES = tuple(_FAMILIES)


def seq2seq_tokenizer(folder: str | Path) -> PretrainedTokenizer | MarianTokenizer | None:
    """The tokenizer of an encoder-decoder folder, or None when it has no tokenizer files.

    Raises:
        ImportError: ``tokenizers`` (for ``tokenizer.json``) or ``sentencepiece`` (for
            Marian's ``source.spm``) missing, with the install command.
        qkv.data.files.BadFileError (a ValueError): a tokenizer file that is malformed or
            that the library refuses (named).
    """
    folder = Path(folder)
    tokenizer = tokenizer_from_folder(folder)
    if tokenizer is not None:
        return tokenizer
    if (folder / "source.spm").is_file():
        tok_config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (folder / name).is_file():
                tok_config.update(read_json(folder / name))
        return MarianTokenizer.from_folder(folder, tok_config)
    return None


def load_hf_seq2seq_folder(
    folder: Path, hf: dict[str, Any], *, name: str | None = None
) -> Seq2SeqBundle:
    """Load a Hugging Face encoder-decoder folder (BART, T5 or Marian) into a bundle.

    Args:
        folder: holds ``config.json``, the weights and the tokenizer files.
        hf: the parsed ``config.json`` (``model_type`` one of :data:`SEQ2SEQ_TYPES`).
        name: the name to show (default: the folder).

    Returns:
        A :class:`Seq2SeqBundle`, model in eval mode, float32.

    Raises:
        qkv.data.files.MissingFileError (a FileNotFoundError): no weights.
        qkv.data.files.BadFileError (a ValueError): an unsupported ``model_type`` or option,
            sizes the weights do not back, missing, unexpected, misshaped or non-finite
            tensors (named), malformed tokenizer files; every message names the file.
        ImportError: a tokenizer library that is needed is missing.
    """
    folder = Path(folder)
    config_file = folder / "config.json"
    kind = hf.get("model_type")
    if kind not in _FAMILIES:
        raise BadFileError(f"{config_file}: model_type={kind!r} is not an encoder-decoder qkv "
                           f"loads; known: {SEQ2SEQ_TYPES}", path=config_file)  # fmt: skip
    family = _FAMILIES[kind]
    weights = open_weights(folder)  # the header only: shapes, no data
    with reading(config_file, f"a Hugging Face {kind} config.json"):
        config = family.config(hf, str(config_file), weights.shapes)
    ignored = family.ignored(config)
    entries = check_folder_model(config, weights, Seq2SeqTransformer, entries=family.entries,
                                 ignored=ignored, config_file=config_file)  # fmt: skip
    tokenizer = seq2seq_tokenizer(folder)
    model = build_checked(config, weights, Seq2SeqTransformer, entries, ignored)
    source = {"format": "huggingface", "model_type": kind, "path": str(folder)}
    generation = read_generation_config(folder, config.eos_id)
    return Seq2SeqBundle(model, tokenizer, name or str(folder), source, generation)
