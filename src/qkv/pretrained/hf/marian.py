"""Marian (Opus-MT) checkpoints in Hugging Face format -> :class:`qkv.models.Seq2SeqTransformer`.

Marian (Junczys-Dowmunt et al., 2018) translation models, the Helsinki-NLP Opus-MT family, are
BART-shaped post-norm encoder-decoders with the paper's sinusoidal positions, but laid out with
all sines first and all cosines after (``sinusoidal_layout="split"``), embeddings scaled by
``sqrt(E)`` (``scale_embedding``: ``embed_scale=None``), SiLU ("swish") feed-forwards, no
embedding norm, one vocabulary shared by source, target and output, and a
``final_logits_bias``. Decoding starts from PAD (``decoder_start_token_id``). Tensor names are
BART's (:func:`~qkv.pretrained.hf.bart.bart_family_entries`) without position tables or
embedding norms; a position table some older files store is computed, so it is not read.

Tokenizers: a folder with ``tokenizer.json`` uses it; the released Opus-MT folders instead hold
two sentencepiece models (``source.spm`` splits sources, ``target.spm`` joins outputs) and one
``vocab.json`` (piece -> id), read by :class:`MarianTokenizer` when the optional
``sentencepiece`` package is installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from qkv.data.files import BadFileError, read_json, reading
from qkv.models import Seq2SeqConfig
from qkv.pretrained.errors import require
from qkv.pretrained.hf.bart import bart_family_entries, family_config
from qkv.pretrained.hf.common import hf_flag
from qkv.pretrained.weights import Entry

__all__ = ["MarianTokenizer", "marian_config", "marian_entries", "marian_ignored"]

_UNREAD = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight",
           "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")  # fmt: skip


def marian_config(hf: Mapping[str, Any], *, where: str) -> Seq2SeqConfig:
    """A :class:`Seq2SeqConfig` from a Marian ``config.json``.

    Raises:
        ValueError: separate source and target vocabularies (``share_encoder_decoder_
            embeddings`` false or a ``decoder_vocab_size`` of its own), a pre-norm layout,
            different encoder/decoder sizes, an unknown activation, a missing size.
    """
    vocab, dec_vocab = hf.get("vocab_size"), hf.get("decoder_vocab_size")
    if not hf_flag(hf, "share_encoder_decoder_embeddings", where, True) or (
        dec_vocab is not None and dec_vocab != vocab
    ):
        raise ValueError(
            f"{where}: separate source and target vocabularies (share_encoder_decoder_"
            f"embeddings={hf.get('share_encoder_decoder_embeddings')!r}, vocab_size={vocab!r}, "
            f"decoder_vocab_size={dec_vocab!r}) are not supported; expected one shared vocabulary"
        )
    if hf_flag(hf, "normalize_before", where, False):
        raise ValueError(f"{where}: normalize_before=true (pre-norm Marian) is not supported")
    return family_config(hf, where=where, positions="sinusoidal", sinusoidal_layout="split")


def marian_entries(c: Seq2SeqConfig, names: Iterable[str] = ()) -> list[Entry]:
    """The tensors a Marian model with config ``c`` needs, under Marian's names."""
    return bart_family_entries(c, positions=False, embed_norm=False)


def marian_ignored(c: Seq2SeqConfig) -> Any:
    """Source names a Marian file may hold that are not read: the computed position tables
    and copies of the tied embedding."""
    unread = (*_UNREAD, "lm_head.weight") if c.tie_embeddings else _UNREAD
    return lambda name: name in unread


def _special(tok_config: Mapping[str, Any], key: str, default: str) -> str:
    value = tok_config.get(key, default)
    if isinstance(value, dict):
        value = value.get("content", default)
    return value if isinstance(value, str) else default


class MarianTokenizer:
    """Opus-MT's tokenizer: sentencepiece pieces looked up in one shared vocabulary.

    ``encode(text)``: an optional leading language code (``>>fra<<``, multilingual models)
    stays one token, the rest is split by ``source.spm``; pieces become ids through
    ``vocab.json`` (unknown pieces: ``<unk>``), and EOS ends the ids. ``decode(ids)``: ids
    become pieces, joined by ``target.spm``. This is what transformers' ``MarianTokenizer``
    does (without its optional Moses punctuation normaliser).

    Args:
        source, target: ``sentencepiece.SentencePieceProcessor`` for sources and outputs.
        vocab: piece -> id.
        eos_token, unk_token, pad_token: special pieces (in ``vocab``).

    Raises:
        ValueError: a special piece that is not in ``vocab``.
    """

    def __init__(self, source: Any, target: Any, vocab: Mapping[str, int], *,
                 eos_token: str = "</s>", unk_token: str = "<unk>",
                 pad_token: str = "<pad>") -> None:  # fmt: skip
        self.source, self.target = source, target
        self.vocab = dict(vocab)
        self.pieces = {i: p for p, i in self.vocab.items()}
        for key, token in (("eos_token", eos_token), ("unk_token", unk_token),
                           ("pad_token", pad_token)):  # fmt: skip
            if token not in self.vocab:
                raise ValueError(f"special token {key}={token!r} is not in the vocabulary")
        self.eos_id, self.unk_id = self.vocab[eos_token], self.vocab[unk_token]
        self.pad_id = self.vocab[pad_token]
        self.special_ids = {self.eos_id, self.unk_id, self.pad_id}

    @classmethod
    def from_folder(cls, folder: str | Path, tok_config: Mapping[str, Any]) -> MarianTokenizer:
        """Read ``source.spm``, ``target.spm`` and ``vocab.json`` from an Opus-MT folder.

        Raises:
            ImportError: ``sentencepiece`` is not installed (with the install command).
            qkv.data.files.MissingFileError / BadFileError: a missing or unreadable file.
        """
        spm = require("sentencepiece", "sentencepiece")
        folder = Path(folder)
        models = []
        for name in ("source.spm", "target.spm"):
            path = folder / name
            if not path.is_file():
                raise BadFileError(f"{folder}: has source.spm but no {name}; an Opus-MT folder "
                                   "holds both", path=path)  # fmt: skip
            with reading(path, "a sentencepiece model", errors=(Exception,)):
                models.append(spm.SentencePieceProcessor(model_file=str(path)))
        vocab = read_json(folder / "vocab.json")
        with reading(folder / "vocab.json", "a Marian vocabulary: piece -> int id"):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()):
                raise ValueError("vocab.json must map each piece to an int id")
            return cls(models[0], models[1], vocab,
                       eos_token=_special(tok_config, "eos_token", "</s>"),
                       unk_token=_special(tok_config, "unk_token", "<unk>"),
                       pad_token=_special(tok_config, "pad_token", "<pad>"))  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, EOS last (with ``add_special_tokens``).

        Raises:
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        code: list[str] = []
        end = text.find("<<") if text.startswith(">>") else -1
        if end != -1:  # a target-language code (">>fra<<") opening a multilingual input
            code, text = [text[: end + 2]], text[end + 2 :]
        pieces = code + list(self.source.encode(text, out_type=str))
        ids = [self.vocab.get(p, self.unk_id) for p in pieces]
        return [*ids, self.eos_id] if add_special_tokens else ids

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``: runs of pieces joined by the target sentencepiece model, special
        tokens (kept unless ``skip_special_tokens``) written as they are, followed by a space.
        """
        if isinstance(ids, Tensor):
            ids = ids.reshape(-1).tolist()
        out, run = "", []
        for i in (int(i) for i in ids):
            if i in self.special_ids:
                if not skip_special_tokens:
                    out += self.target.decode_pieces(run) + self.pieces[i] + " "
                    run = []
                continue
            run.append(self.pieces.get(i, self.pieces[self.unk_id]))
        out += self.target.decode_pieces(run)
        return out.replace("\u2581", " ").strip()
