"""What ``qkv train``, ``qkv translate`` and ``qkv eval`` share: the run spec, data, checkpoints.

A *run spec* says what to train on, which model and how: built from command-line options
and, optionally, a small TOML file::

    steps = 2000              # TrainConfig fields at the top level (qkv.train.TrainConfig)
    lr = 1e-3

    [data]                    # one source: task = "dates" | pairs = "file.tsv" | text = "path"
    task = "dates"
    n_train = 20000           # tasks: split sizes and the task's own options (max_len, ...)

    [model]                   # fields of Seq2SeqConfig (tasks, pairs) or DecoderLMConfig (text)
    d_model = 64

Options given on the command line win over the file. Every unknown key is an error that names
it. ``qkv train`` writes the data part to ``<run dir>/data.json`` so that ``qkv eval`` can
rebuild the same held-out split later.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

__all__ = [
    "DATA_FILE",
    "DataSpec",
    "Dataset",
    "fail",
    "find_checkpoint",
    "load_dataset",
    "load_run",
    "read_data_spec",
    "read_toml",
    "seq2seq_parts",
]

DATA_FILE = "data.json"
KINDS = ("task", "pairs", "text")
# Data keys that a [data] table may hold besides the source; any other key is a task option.
DATA_KEYS = ("task", "pairs", "text", "n_train", "n_valid", "n_test", "valid_fraction", "seed")


def fail(err: BaseException | str) -> typer.Exit:
    """Print ``error: <message>`` as one line on stderr; return the exit (status 2) to raise."""
    from rich.markup import escape

    message = " ".join(str(err).split()) or type(err).__name__
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[red]error:[/red] {escape(message)}", markup=True
    )
    return typer.Exit(2)


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The tables of a run-spec TOML file: ``{"train": {...}, "data": {...}, "model": {...}}``.

    Raises:
        FileNotFoundError: no file; ValueError: invalid TOML, or a table other than
            ``[data]`` and ``[model]`` (the message names the file).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no config file at {file}")
    toml = _toml()
    try:
        raw = toml.loads(file.read_text(encoding="utf-8"))
    except toml.TOMLDecodeError as err:
        raise ValueError(f"{file} is not valid TOML: {err}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not a UTF-8 text file") from None
    tables = {k: v for k, v in raw.items() if isinstance(v, dict)}
    unknown = sorted(set(tables) - {"data", "model"})
    if unknown:
        raise ValueError(f"{file}: unknown table(s) {unknown}; the tables are [data] and [model]")
    train = {k: v for k, v in raw.items() if not isinstance(v, dict)}
    return {"train": train, "data": tables.get("data", {}), "model": tables.get("model", {})}


def _toml() -> Any:
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ImportError("TOML on Python 3.10 needs tomli: pip install tomli") from None
    return tomllib


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
        if kind == "task":
            from qkv.data import TASKS

            if source not in TASKS:
                raise ValueError(f"unknown task {source!r}; the tasks are {', '.join(TASKS)}")
        for name in ("n_train", "n_valid", "n_test", "seed"):
            v = table.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"[data] {name} must be an int >= 0, got {v!r}")
        fraction = table.get("valid_fraction", 0.1)
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not (
            0 < fraction < 0.5
        ):
            raise ValueError(
                f"[data] valid_fraction must be a number in (0, 0.5), got {fraction!r}"
            )
        options = {k: v for k, v in table.items() if k not in DATA_KEYS}
        if kind != "task" and options:
            raise ValueError(f"unknown [data] key(s) {sorted(options)} for {kind} data; known: "
                             f"{sorted(DATA_KEYS)}")  # fmt: skip
        if options:
            from qkv.data import make_task

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
    from qkv.data import load_pairs_tsv, load_text, make_task, train_valid_split

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


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder at ``path``: the folder itself, or a run folder's ``best`` (else
    ``last``) checkpoint.

    Raises:
        FileNotFoundError: nothing there that looks like a qkv checkpoint.
    """
    root = Path(path)
    for folder in (root, root / "best", root / "last"):
        if (folder / "config.json").is_file():
            return folder
    if not root.exists():
        raise FileNotFoundError(f"no checkpoint at {root}: no such file or folder")
    raise FileNotFoundError(
        f"no checkpoint at {root}: expected a folder with config.json (a qkv checkpoint) or a "
        "run folder holding best/ or last/"
    )


def load_run(path: str | os.PathLike) -> tuple[Any, Path, DataSpec | None]:
    """Load the checkpoint at ``path`` (see :func:`find_checkpoint`).

    Returns:
        ``(checkpoint, folder, data spec of its run or None)``; the model is in eval mode.

    Raises:
        FileNotFoundError: no checkpoint; CheckpointError (a ValueError): a corrupt or
            unreadable one; ValueError: a bad ``data.json``.
    """
    from qkv.train.checkpoint import load_checkpoint

    folder = find_checkpoint(path)
    ckpt = load_checkpoint(folder)
    ckpt.model.eval()
    spec = read_data_spec(folder.parent) if folder.name in ("best", "last") else None
    return ckpt, folder, spec


def seq2seq_parts(ckpt: Any, folder: Path, command: str) -> tuple[Any, Any, Any]:
    """``(model, src_tok, tgt_tok)`` of an encoder-decoder checkpoint.

    Raises:
        ValueError: a decoder-only model, or a checkpoint without its tokenizers.
    """
    from qkv.generate import is_seq2seq

    if not is_seq2seq(ckpt.model):
        raise ValueError(
            f"{folder} holds a {type(ckpt.model).__name__}; qkv {command} needs an "
            "encoder-decoder (Seq2SeqTransformer) checkpoint"
        )
    toks = ckpt.tokenizers
    if "src" not in toks:
        raise ValueError(f"{folder} has no source tokenizer (tokenizer-src.json)")
    return ckpt.model, toks["src"], toks.get("tgt", toks["src"])
