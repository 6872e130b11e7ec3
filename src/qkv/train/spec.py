"""The run spec: what a training run trains on, enough to rebuild its splits later.

A *run spec* says what to train on, which model and how: built from command-line options
and, optionally, a small TOML file::

    steps = 2000              # TrainConfig fields at the top level (qkv.train.TrainConfig)
    lr = 1e-3

    [data]                    # one source: task = "dates" | pairs = "file.tsv" | text = "path"
    task = "dates"
    n_train = 20000           # tasks: split sizes and the task's own options (max_len, ...)
    tokenizer = "char"        # "char" | "byte" | "bpe" (with vocab_size = 1000)

    [model]                   # fields of Seq2SeqConfig (tasks, pairs) or DecoderLMConfig (text)
    d_model = 64

``qkv train`` builds it from this file and its options (which win); every unknown key is an
error that names it. A run writes the data part to ``<run dir>/data.json`` so that ``qkv eval``
can rebuild the same held-out split later. Building and running the model: :mod:`qkv.train.runs`.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qkv.checks import is_int, is_number
from qkv.data import TASKS, load_text, make_task, train_valid_split
from qkv.data.files import read_toml
from qkv.data.records import RECORD_SUFFIXES, load_pairs, load_records_text

__all__ = [
    "DATA_FILE",
    "DataSpec",
    "Dataset",
    "load_dataset",
    "read_data_spec",
    "read_spec_toml",
]

DATA_FILE = "data.json"
KINDS = ("task", "pairs", "text")
TOKENIZERS = ("char", "byte", "bpe")
DEFAULT_BPE_VOCAB = 1000
# Data keys that a [data] table may hold besides the source; any other key is a task option.
DATA_KEYS = ("task", "pairs", "text", "n_train", "n_valid", "n_test", "valid_fraction", "seed",
             "tokenizer", "vocab_size", "source_column", "target_column", "text_column")


def read_spec_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The tables of a run-spec TOML file: ``{"train": {...}, "data": {...}, "model": {...}}``.

    Raises:
        FileNotFoundError: no file; ValueError: invalid TOML, or a table other than
            ``[data]`` and ``[model]`` (the message names the file).
    """
    file = Path(path)
    raw = read_toml(file, what="config file")
    tables = {k: v for k, v in raw.items() if isinstance(v, dict)}
    unknown = sorted(set(tables) - {"data", "model"})
    if unknown:
        raise ValueError(f"{file}: unknown table(s) {unknown}; the tables are [data] and [model]")
    train = {k: v for k, v in raw.items() if not isinstance(v, dict)}
    return {"train": train, "data": tables.get("data", {}), "model": tables.get("model", {})}


@dataclass(frozen=True)
class DataSpec:
    """Where the data of a run come from, enough to rebuild its splits.

    Attributes:
        kind: ``"task"`` (a :func:`qkv.data.make_task` task), ``"pairs"`` (a ``.tsv``,
            ``.csv`` or ``.jsonl`` file of pairs, :func:`qkv.data.records.load_pairs`) or
            ``"text"`` (a file or folder, for a language model; a ``.jsonl`` file, or a
            ``.csv``/``.tsv`` with ``text_column``, gives one column of its records).
        source: the task name or the path.
        seed: seeds the task, or the held-out split of pairs and text.
        n_train, n_valid, n_test: task split sizes.
        valid_fraction: pairs: the share held out for validation and again for test; text:
            the share held out for validation.
        options: the task's own options (``max_len``, ...).
        tokenizer: ``"char"`` (characters of the training split), ``"byte"`` (UTF-8 bytes)
            or ``"bpe"`` (byte-level BPE trained on the training split, ``vocab_size``).
        vocab_size: the BPE vocabulary (None = 1000 for ``"bpe"``); only with ``"bpe"``.
        source_column, target_column: pairs: the column (CSV/TSV) or key (JSONL) names
            (None = ``"source"``/``"target"``; a TSV without names has no header).
        text_column: text: the column or key of records (None = ``"text"`` for JSONL;
            a CSV/TSV without it is read as plain text).
    """

    kind: str
    source: str
    seed: int = 0
    n_train: int = 10_000
    n_valid: int = 500
    n_test: int = 1_000
    valid_fraction: float = 0.1
    options: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "char"
    vocab_size: int | None = None
    source_column: str | None = None
    target_column: str | None = None
    text_column: str | None = None

    @classmethod
    def build(cls, table: dict[str, Any], *, task: str | None = None, pairs: Path | None = None,
              text: Path | None = None, seed: int | None = None,
              **options: Any) -> DataSpec:  # fmt: skip
        """From a ``[data]`` table and the command line's source and ``options`` (which win):
        ``tokenizer``, ``vocab_size``, ``source_column``, ``target_column``, ``text_column``
        (None = not given).

        Raises:
            ValueError: no source or more than one, a bad size or fraction, a bad tokenizer
                choice or column option.
        """
        table = {**table, **{k: v for k, v in options.items() if v is not None}}
        given = {k: v for k, v in (("task", task), ("pairs", pairs), ("text", text)) if v}
        if not given:
            given = {k: table[k] for k in KINDS if k in table}
        for k in KINDS:
            table.pop(k, None)
        if len(given) != 1:
            what = f"got {sorted(given)}" if given else "got none"
            raise ValueError(
                "give one data source: a TASK name, --pairs PATH or --text PATH (or task/pairs/"
                f"text in the config's [data] table); {what}"
            )
        ((kind, source),) = given.items()
        if kind == "task" and source not in TASKS:
            raise ValueError(f"unknown task {source!r}; the tasks are {', '.join(TASKS)}")
        for name in ("n_train", "n_valid", "n_test", "seed"):
            v = table.get(name, 0)
            if not is_int(v) or v < 0:
                raise ValueError(f"[data] {name} must be an int >= 0, got {v!r}")
        fraction = table.get("valid_fraction", 0.1)
        if not is_number(fraction) or not 0 < fraction < 0.5:
            raise ValueError(
                f"[data] valid_fraction must be a number in (0, 0.5), got {fraction!r}"
            )
        options = {k: v for k, v in table.items() if k not in DATA_KEYS}
        if kind != "task" and options:
            raise ValueError(f"unknown [data] key(s) {sorted(options)} for {kind} data; known: "
                             f"{sorted(DATA_KEYS)}")  # fmt: skip
        if options:
            try:  # no pairs asked for: only the options are checked
                make_task(str(source), n_train=0, n_valid=0, n_test=0, **options)
            except TypeError:
                raise ValueError(
                    f"unknown [data] key(s) {sorted(options)}: not among {sorted(DATA_KEYS)} "
                    f"nor the options of task {source!r} (see qkv.data.tasks)"
                ) from None
        sizes = {k: table[k] for k in ("n_train", "n_valid", "n_test") if k in table}
        extra = _tokenizer_and_columns(kind, str(source), table)
        return cls(kind=kind, source=str(source), seed=table.get("seed", 0) if seed is None
                   else seed, valid_fraction=float(fraction), options=options, **sizes,
                   **extra)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-able dict (what ``data.json`` holds)."""
        return asdict(self)


def _tokenizer_and_columns(kind: str, source: str, table: dict[str, Any]) -> dict[str, Any]:
    """The checked ``tokenizer``, ``vocab_size`` and column fields of a spec."""
    tokenizer, vocab = table.get("tokenizer", "char"), table.get("vocab_size")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    if vocab is not None and tokenizer != "bpe":
        raise ValueError(f"--vocab-size applies to --tokenizer bpe, not {tokenizer!r} (whose "
                         "vocabulary is fixed by the data or by bytes)")  # fmt: skip
    if vocab is not None and (not is_int(vocab) or vocab < 260):
        raise ValueError(f"--vocab-size must be an int >= 260 (4 specials + 256 bytes), got "
                         f"{vocab!r}")  # fmt: skip
    columns = {k: table.get(k) for k in ("source_column", "target_column", "text_column")}
    for name, value in columns.items():
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"--{name.replace('_', '-')} must be a non-empty name, got "
                             f"{value!r}")  # fmt: skip
    # source/target columns belong to pairs, the text column to text, none to a task
    wrong = [k for k, v in columns.items() if v is not None
             and (kind == "task" or (k == "text_column") != (kind == "text"))]  # fmt: skip
    if wrong:
        names = ", ".join(f"--{k.replace('_', '-')}" for k in wrong)
        raise ValueError(f"{names}: does not apply to {kind} data ({source})")
    return {"tokenizer": tokenizer, "vocab_size": vocab, **columns}


def read_data_spec(run_dir: Path) -> DataSpec | None:
    """The :class:`DataSpec` that ``qkv train`` wrote into ``run_dir``, or None.

    Raises:
        ValueError: a ``data.json`` that is not a valid spec.
    """
    file = run_dir / DATA_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        return DataSpec(**data)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{file}: not a qkv data spec ({err})") from None


@dataclass
class Dataset:
    """The splits of a run: string pairs (tasks and pairs) or text (language models)."""

    train: Any
    valid: Any
    test: Any = None


def load_dataset(spec: DataSpec) -> Dataset:
    """Build the splits that ``spec`` describes (the same every time).

    Raises:
        ValueError, TypeError: bad task options or sizes, a malformed TSV file, too little data.
        FileNotFoundError: a missing file or folder.
    """
    if spec.kind == "task":
        task = make_task(spec.source, seed=spec.seed, n_train=spec.n_train,
                         n_valid=spec.n_valid, n_test=spec.n_test, **spec.options)  # fmt: skip
        if not task.train:
            raise ValueError("[data] n_train must be >= 1, got 0")
        return Dataset(task.pairs("train"), task.pairs("valid"), task.pairs("test"))
    if spec.kind == "pairs":
        pairs = load_pairs(spec.source, source=spec.source_column, target=spec.target_column)
        held = max(1, round(spec.valid_fraction * len(pairs)))
        if len(pairs) < 2 * held + 1:
            raise ValueError(
                f"{spec.source} holds {len(pairs)} pairs: too few to hold out {held} for "
                "validation and test and still train"
            )
        random.Random(spec.seed).shuffle(pairs)
        return Dataset(pairs[2 * held :], pairs[:held], pairs[held : 2 * held])
    suffix = Path(spec.source).suffix.lower()
    structured = suffix == ".jsonl" or (suffix in RECORD_SUFFIXES and spec.text_column)
    if structured and Path(spec.source).is_file():
        text = load_records_text(spec.source, key=spec.text_column or "text")
    else:
        text = load_text(spec.source)
    train, valid = train_valid_split(text, spec.valid_fraction, spec.seed)
    return Dataset(train, valid)
