"""The run spec: what a training run trains on, enough to rebuild its splits later.

A *run spec* says what to train on, which model and how: built from command-line options
and, optionally, a small TOML file::

    steps = 2000              # TrainConfig fields at the top level (qkv.train.TrainConfig)
    lr = 1e-3

    [data]                    # one source: task = "dates" | pairs = "file.tsv" | text = "path"
    task = "dates"
    n_train = 20000           # tasks: split sizes and the task's own options (max_len, ...)

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
from qkv.data import TASKS, load_pairs_tsv, load_text, make_task, train_valid_split
from qkv.data.files import read_toml

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
# Data keys that a [data] table may hold besides the source; any other key is a task option.
DATA_KEYS = ("task", "pairs", "text", "n_train", "n_valid", "n_test", "valid_fraction", "seed")


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
        kind: ``"task"`` (a :func:`qkv.data.make_task` task), ``"pairs"`` (a TSV file of
            ``source<TAB>target`` lines) or ``"text"`` (a file or folder, for a language model).
        source: the task name or the path.
        seed: seeds the task, or the held-out split of pairs and text.
        n_train, n_valid, n_test: task split sizes.
        valid_fraction: pairs: the share held out for validation and again for test; text:
            the share held out for validation.
        options: the task's own options (``max_len``, ...).
    """

    kind: str
    source: str
    seed: int = 0
    n_train: int = 10_000
    n_valid: int = 500
    n_test: int = 1_000
    valid_fraction: float = 0.1
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, table: dict[str, Any], *, task: str | None = None, pairs: Path | None = None,
              text: Path | None = None, seed: int | None = None) -> DataSpec:  # fmt: skip
        """From a ``[data]`` table and the command line's source (which wins).

        Raises:
            ValueError: no source or more than one, a bad size or fraction.
        """
        table = dict(table)
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
        return cls(kind=kind, source=str(source), seed=table.get("seed", 0) if seed is None
                   else seed, valid_fraction=float(fraction), options=options, **sizes)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-able dict (what ``data.json`` holds)."""
        return asdict(self)


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
        pairs = load_pairs_tsv(spec.source)
        held = max(1, round(spec.valid_fraction * len(pairs)))
        if len(pairs) < 2 * held + 1:
            raise ValueError(
                f"{spec.source} holds {len(pairs)} pairs: too few to hold out {held} for "
                "validation and test and still train"
            )
        random.Random(spec.seed).shuffle(pairs)
        return Dataset(pairs[2 * held :], pairs[:held], pairs[held : 2 * held])
    text = load_text(spec.source)
    train, valid = train_valid_split(text, spec.valid_fraction, spec.seed)
    return Dataset(train, valid)
