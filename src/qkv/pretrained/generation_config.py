"""A Hugging Face folder's ``generation_config.json``: how its publisher decodes it.

transformers' ``generate`` starts from this file: Opus-MT's folders ask for beam search
(``num_beams`` 4 or 6), ban the padding token (``bad_words_ids: [[pad]]``), cap the length
(``max_length: 512``) and force EOS at that cap. :func:`read_generation_config` reads the keys
qkv acts on, checks them, and gives a :class:`FolderGeneration`; a bundle uses it for every
option its caller leaves unset, so a folder decodes as it does in transformers. Other keys
(sampling flags, ``output_*``, ids qkv reads from ``config.json``) are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qkv.checks import is_int, is_number
from qkv.data.files import BadFileError

__all__ = ["FolderGeneration", "read_generation_config"]


@dataclass(frozen=True)
class FolderGeneration:
    """The decoding a folder asks for (None or empty: not set there).

    Attributes:
        num_beams: beams (1: greedy).
        length_penalty, early_stopping: transformers' beam search ranking and stopping.
        max_length: the most decoder positions, the start token included.
        max_new_tokens: the most new tokens (wins over ``max_length``).
        bad_words_ids: token sequences never generated.
        no_repeat_ngram_size, repetition_penalty: as :class:`qkv.generate.GenerationControls`.
        forced_eos: EOS is forced at the length limit (``forced_eos_token_id`` = EOS).
    """

    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    max_length: int | None = None
    max_new_tokens: int | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    forced_eos: bool = False


def _get(data: dict, key: str, ok, what: str, file: Path, default):
    if key not in data or data[key] is None:
        return default
    value = data[key]
    if not ok(value):
        raise BadFileError(f"{file}: {key} must be {what}, got {value!r:.80}", path=file)
    return value


def _positive(v) -> bool:
    return is_int(v) and v >= 1


def _ids(v) -> bool:
    return isinstance(v, list) and all(
        isinstance(w, list) and w and all(is_int(t) and t >= 0 for t in w) for w in v)


def read_generation_config(folder: str | Path, eos_id: int | None) -> FolderGeneration | None:
    """The folder's ``generation_config.json`` (None when it has none).

    Raises:
        BadFileError: not JSON, not an object, or a key qkv acts on with a bad value (named).
    """
    file = Path(folder) / "generation_config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise BadFileError(f"{file}: not valid JSON ({err})", path=file) from None
    if not isinstance(data, dict):
        raise BadFileError(f"{file}: expected a JSON object, got {type(data).__name__}",
                           path=file)  # fmt: skip
    forced = _get(data, "forced_eos_token_id", is_int, "a token id", file, None)
    return FolderGeneration(
        num_beams=_get(data, "num_beams", _positive, "an int >= 1", file, 1),
        length_penalty=float(_get(data, "length_penalty", is_number, "a number", file, 1.0)),
        early_stopping=_get(data, "early_stopping", lambda v: v in (True, False, "never"),
                            'true, false or "never"', file, False),
        max_length=_get(data, "max_length", _positive, "an int >= 1", file, None),
        max_new_tokens=_get(data, "max_new_tokens", _positive, "an int >= 1", file, None),
        bad_words_ids=tuple(tuple(w) for w in _get(data, "bad_words_ids", _ids,
                                                   "a list of token-id lists", file, [])),
        no_repeat_ngram_size=_get(data, "no_repeat_ngram_size", lambda v: is_int(v) and v >= 0,
                                  "an int >= 0", file, 0),
        repetition_penalty=float(_get(data, "repetition_penalty",
                                      lambda v: is_number(v) and v > 0, "a number > 0", file,
                                      1.0)),
        forced_eos=forced is not None and forced == eos_id,
    )
