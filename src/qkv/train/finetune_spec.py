"""What a fine-tuning run is given, as records: :class:`FineTuneSpec` (the base model, the data,
:class:`LoRAOptions`, the training settings, the run folder), :class:`Words` (how messages name
those, for a Python caller or for ``qkv train --from``) and the :class:`~qkv.train.TrainConfig`
a spec trains with (:func:`finetune_config`), and its record in the run folder
(:func:`write_record`, ``finetune.json``, written atomically). :mod:`qkv.train.finetuning` runs
them.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qkv.data.files import BadFileError, read_json
from qkv.train.config import TrainConfig

__all__ = ["DEFAULT_TARGETS", "FINETUNE_FILE", "PYTHON_WORDS", "FineTuneSpec", "LoRAOptions",
           "Words", "finetune_config", "write_record"]  # fmt: skip

FINETUNE_FILE = "finetune.json"
# Attention's four projections, as PEFT's LoRA examples and the LoRA paper adapt.
DEFAULT_TARGETS = ("*.q_proj", "*.k_proj", "*.v_proj", "*.out_proj")
# Fine-tuning defaults (the spec's ``train`` keys win over them): AdamW without weight decay,
# a cosine schedule, packed rows of up to 512 tokens.
FINETUNE_TRAIN = dict(steps=200, batch_size=8, block_size=512, schedule="cosine",
                      weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip=1.0,
                      metric="loss", log_every=10, pack=True)  # fmt: skip
LR = {"lora": 2e-4, "full": 2e-5}
KINDS = ("chat", "text")


@dataclass(frozen=True)
class Words:
    """How the messages of :func:`~qkv.train.finetune` and :func:`~qkv.train.resume_finetune`
    name what they were given: Python's names (:data:`PYTHON_WORDS`, the default), or the
    options of ``qkv train`` (which passes its own). Messages only: nothing else reads them."""

    command: str = "qkv.train.finetuning"  # opens the first line; "... fine-tunes decoder LMs"
    resume_command: str = "qkv.train.resume_finetune"  # opens a resumed run's first line
    fine_tuning: str = "fine-tuning"  # what trains on packed documents
    base: str = "base"
    out: str = "out"
    resume: str = "run_dir"  # the folder a run resumes from
    steps: str = "steps"
    lora_targets: str = "LoRAOptions.targets"
    context_parallel: str = "train['context_parallel']"
    config: str = "train"  # where the training keys are set


PYTHON_WORDS = Words()


@dataclass(frozen=True)
class LoRAOptions:
    """Low-rank adapters (:func:`qkv.nn.lora.add_lora`) on the layers named by ``targets``.

    Attributes:
        rank: ``r``, the adapters' rank (an int >= 1).
        alpha: the update's scale is ``alpha / rank``; None: twice the rank.
        dropout: dropout on the adapters' input, in [0, 1).
        targets: layer-name patterns (``fnmatch``; default attention's four projections;
            ``"*.ffn.*"`` adds the feed-forward).

    Raises:
        ValueError: naming the field (``LoRAOptions.rank must be ...``), what was given and
            what was expected.
    """

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRAOptions.rank must be an int >= 1, got {self.rank!r}")
        alpha = 2.0 * self.rank if self.alpha is None else self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not (
                0 <= alpha < math.inf):  # fmt: skip
            raise ValueError(f"LoRAOptions.alpha must be a finite number >= 0, got {alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not (
                0 <= self.dropout < 1):  # fmt: skip
            raise ValueError(f"LoRAOptions.dropout must lie in [0, 1), got {self.dropout!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t.strip() for t in targets):
            raise ValueError("LoRAOptions.targets must name layer patterns such as "
                             f"('*.q_proj', '*.v_proj'), got {self.targets!r}")  # fmt: skip
        object.__setattr__(self, "alpha", float(alpha))
        object.__setattr__(self, "dropout", float(self.dropout))
        object.__setattr__(self, "targets", targets)


@dataclass(frozen=True)
class FineTuneSpec:
    """A fine-tuning run: what adapts, to what, how, and where it goes.

    Attributes:
        base: the pretrained decoder: what :func:`qkv.pretrained.load` takes (a packaged
            name, a Hugging Face folder, a ``.gguf`` file, a qkv text checkpoint), or a loaded
            :class:`~qkv.pretrained.DecoderBundle`, whose model is then adapted, trained and
            merged in place.
        data: a path (``kind="chat"``: a ``.jsonl`` of ``{"messages": [...]}`` lines;
            ``"text"``: a text file or folder, or the records of a ``.jsonl``/``.csv``/``.tsv``
            with ``text_column``), or the documents themselves: a sequence of
            :class:`~qkv.data.LabeledDocument` (:func:`qkv.pretrained.chat_document`) or of
            token-id lists.
        out: the run folder (it must not hold a run).
        kind: ``"chat"`` (learned on the assistant turns) or ``"text"``.
        text_column: ``kind="text"`` records: the column or key (default ``"text"``).
        lora: the adapters, or None: every weight trains (full fine-tuning).
        train: :class:`~qkv.train.TrainConfig` keys over the fine-tuning defaults (AdamW
            without weight decay, cosine schedule with a tenth of the steps as warm-up, lr
            2e-4 with LoRA and 2e-5 without, 200 steps of 8 packed rows of 512 tokens, the
            model's length if shorter, validation every quarter of the run).

    ``base`` or ``data`` is None only in a spec read back from a run folder
    (:meth:`read`) whose model or documents were given in memory.

    Raises:
        ValueError: a field of the wrong type or value, named.
    """

    base: Any
    data: Any
    out: str | os.PathLike
    kind: str = "chat"
    text_column: str | None = None
    lora: LoRAOptions | None = None
    train: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"FineTuneSpec.kind must be 'chat' or 'text', got {self.kind!r}")
        if self.lora is not None and not isinstance(self.lora, LoRAOptions):
            raise ValueError("FineTuneSpec.lora must be a LoRAOptions or None, got "
                             f"{type(self.lora).__name__}")  # fmt: skip
        if not isinstance(self.train, Mapping):
            raise ValueError("FineTuneSpec.train must be a mapping of TrainConfig keys, got "
                             f"{type(self.train).__name__}")  # fmt: skip
        if self.data is not None and not _is_path(self.data) and (
                not isinstance(self.data, Sequence) or not self.data):  # fmt: skip
            raise ValueError("FineTuneSpec.data must be a path or a non-empty sequence of "
                             f"documents, got {type(self.data).__name__}")  # fmt: skip
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "train", dict(self.train))

    def to_json(self) -> dict[str, Any]:
        """The record in ``<out>/finetune.json`` (a model or documents given in memory: null)."""
        base = str(self.base) if isinstance(self.base, str | os.PathLike) else None
        data = str(self.data) if _is_path(self.data) else None
        return {"base": base, "data": data, "kind": self.kind, "text_column": self.text_column,
                "lora": None if self.lora is None else asdict(self.lora)}  # fmt: skip

    @classmethod
    def read(cls, file: Path) -> FineTuneSpec:
        """The spec a run folder's ``finetune.json`` records (``out``: its folder).

        Raises:
            BadFileError: a file that is not a fine-tuning record, named.
        """
        record = read_json(file)
        try:
            lora = record["lora"]
            return cls(record["base"], record["data"], Path(file).parent, record["kind"],
                       record["text_column"], None if lora is None else LoRAOptions(
                           lora["rank"], lora["alpha"], lora["dropout"],
                           tuple(lora["targets"])))  # fmt: skip
        except (KeyError, TypeError, ValueError) as err:
            why = f"no {err.args[0]!r} entry" if isinstance(err, KeyError) else str(err)
            raise BadFileError(f"{file}: not a qkv fine-tuning record ({why}); it is written "
                               "by qkv train --from (qkv.train.finetuning)", path=file) from None


def _is_path(data: Any) -> bool:
    return isinstance(data, str | os.PathLike)


def finetune_config(spec: FineTuneSpec, max_len: int, words: Words = PYTHON_WORDS
                    ) -> TrainConfig:  # fmt: skip
    """The fine-tuning defaults, then ``spec.train``, as a TrainConfig (``run_dir``: ``out``);
    the default block size is shortened to the model's ``max_len`` positions.

    Raises:
        ValueError: a bad TrainConfig key or value (naming it), context parallelism, or a
            block longer than the model's positions.
    """
    table = spec.train
    fields = {**FINETUNE_TRAIN, "lr": LR["lora" if spec.lora else "full"], **table,
              "run_dir": str(spec.out)}  # fmt: skip
    if "block_size" not in table:  # the default, shortened to the model's positions
        fields["block_size"] = min(fields["block_size"], max_len)
    if "warmup" not in table:
        fields["warmup"] = max(1, fields["steps"] // 10) if isinstance(fields["steps"], int) \
            else 1
    if "eval_every" not in table and isinstance(fields["steps"], int):
        fields["eval_every"] = max(1, fields["steps"] // 4)
    if fields.get("context_parallel", 1) != 1:
        raise ValueError(f"{words.context_parallel} {fields['context_parallel']}: "
                         f"{words.fine_tuning} trains on packed documents, which context "
                         f"parallelism does not take yet; drop {words.context_parallel}")
    config = TrainConfig.from_dict(fields)
    if config.block_size > max_len:
        raise ValueError(f"block_size {config.block_size} is longer than the model's "
                         f"{max_len} positions; lower it in {words.config}")  # fmt: skip
    return config


def write_record(spec: FineTuneSpec, extra: dict[str, Any]) -> None:
    """``<spec.out>/finetune.json``: the spec's record and ``extra``, written atomically (a
    temporary sibling, flushed, renamed over it: a reader sees the old file or the new)."""
    out = Path(spec.out) / FINETUNE_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({**spec.to_json(), **extra}, indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp's 0600 made what open() would make
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
