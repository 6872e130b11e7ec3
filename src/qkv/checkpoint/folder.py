"""The checkpoint folder: safetensors and JSON, written atomically, read without pickle.

This is qkv's own checkpoint format, shared by :mod:`qkv.train` (which writes ``best`` and
``last`` during a run and resumes from them) and :mod:`qkv.pretrained` (which loads a
checkpoint as a ready model); it sits below both so neither imports the other.

Layout of a checkpoint folder::

    model.safetensors           the model's tensors (a tied weight is stored once)
    config.json                 format, model class, model config, tied names, tokenizers
    tokenizer-<role>.json       each tokenizer ("src", "tgt" or "text"), as its save() writes
    train_state.safetensors     optimizer tensors and RNG states      (training checkpoints)
    train_state.json            step, data position, history, the rest (training checkpoints)

Writing goes into a fresh temporary folder next to the destination; every file is fsynced,
then the folder is renamed into place (the old one is moved aside first and deleted after),
so a crash in the middle of a save leaves the previous checkpoint whole. Loading reads only
safetensors and JSON, so it never runs code from the file, and every problem (a truncated or
corrupt file, a missing tensor, a wrong shape, bad JSON, another model class, a config the
tensors do not back, a NaN or infinite weight) is a :class:`CheckpointError` that names the
file and what is wrong. ``config.json`` is checked against ``model.safetensors``'s header
(names and shapes, :mod:`~qkv.checkpoint.backing`) before the model is built, and the tensors
are read last, each checked finite (:mod:`~qkv.checkpoint.tensor_file`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from qkv.checkpoint.backing import (
    check_derived_buffers,
    check_sizes,
    check_state_shapes,
    meta_model,
)
from qkv.checkpoint.optimizer import optimizer_from_flat, optimizer_to_flat
from qkv.checkpoint.tensor_file import TensorFile
from qkv.data.files import BadFileError, read_json, reading
from qkv.data.tokenizers import Tokenizer, load_tokenizer
from qkv.nn.lora import lora_layers, restore_lora

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointError",
    "is_qkv_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

FORMAT, VERSION = "qkv.checkpoint", 1
MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"
STATE_TENSORS, STATE_JSON = "train_state.safetensors", "train_state.json"
# The model classes a checkpoint may name, and their config classes, all in qkv.models.
MODEL_CLASSES = {
    "DecoderLM": "DecoderLMConfig",
    "Seq2SeqTransformer": "Seq2SeqConfig",
    "Encoder": "EncoderConfig",
    "ViT": "ViTConfig",
}


class CheckpointError(BadFileError):
    """A checkpoint that cannot be read or does not fit the model.

    A :class:`qkv.data.files.BadFileError` (so a ``ValueError``): the message names the file,
    what was expected and what was found; ``path`` is the file.
    """


def is_qkv_checkpoint(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a qkv checkpoint: a ``config.json`` whose ``"format"`` is
    ``"qkv.checkpoint"`` (a Hugging Face folder also has a ``config.json``, without it)."""
    try:
        config = read_json(Path(folder) / CONFIG_FILE)
    except (OSError, ValueError):
        return False
    return config.get("format") == FORMAT


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read.

    Attributes:
        path: the checkpoint folder.
        model: the model, with the checkpoint's weights loaded.
        tokenizers: ``{role: tokenizer}`` (e.g. ``"src"``, ``"tgt"``, ``"text"``).
        config: the whole of ``config.json``.
        train_state: the JSON training state, or None for a model-only checkpoint.
        train_tensors: the training-state tensors (RNG states, ...) other than the optimizer's.
    """

    path: Path
    model: nn.Module
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    train_state: dict[str, Any] | None = None
    train_tensors: dict[str, Tensor] = field(default_factory=dict)


def _model_config(model: nn.Module) -> dict[str, Any] | None:
    config = getattr(model, "config", None)
    return config.to_dict() if hasattr(config, "to_dict") else None


def _dedupe_tied(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Keep one name per shared tensor; ``tied`` maps each dropped name to the kept one."""
    kept: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.storage_offset(), tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        t = t.detach().cpu().contiguous()
        # Different views of one storage (e.g. slices of a packed weight) are stored as
        # copies: safetensors refuses tensors that share memory.
        kept[name] = t.clone() if t.numel() and ptr in storages else t
        storages.add(ptr)
    return kept, tied


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, allow_nan=True), encoding="utf-8")


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    *,
    tokenizers: dict[str, Tokenizer] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    train_state: dict[str, Any] | None = None,
    train_tensors: dict[str, Tensor] | None = None,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (and optionally tokenizers and training state) to the folder ``path``.

    Args:
        path: the checkpoint folder; an existing one is replaced atomically.
        model: any ``nn.Module``; its ``config.to_dict()`` is stored when it has one.
        tokenizers: ``{role: tokenizer}``; roles are simple names like ``"src"``.
        optimizer: its state goes into ``train_state.*``.
        train_state: JSON-able training state (step, data position, ...).
        train_tensors: further tensors of the training state (RNG states).
        info: JSON-able extras stored in ``config.json`` under ``"info"`` (metrics, step).

    Returns:
        the folder.

    Raises:
        ValueError: a role that is not a simple name.
        OSError: the folder cannot be written (the previous checkpoint is left untouched).
    """
    dest = Path(path)
    tokenizers = dict(tokenizers or {})
    for role in tokenizers:
        if not (isinstance(role, str) and role.isidentifier()):
            raise ValueError(f"tokenizer roles must be simple names, got {role!r}")
    tensors, tied = _dedupe_tied(model.state_dict())
    config = {
        "format": FORMAT,
        "version": VERSION,
        "model_class": type(model).__name__,
        "config_class": type(getattr(model, "config", None)).__name__,
        "model_config": _model_config(model),
        "tied": tied,
        "tokenizers": {role: f"tokenizer-{role}.json" for role in tokenizers},
        "training": optimizer is not None or train_state is not None,
        "info": info or {},
    }
    adapters = lora_layers(model)
    if adapters:
        config["lora"] = adapters

    def write(folder: Path) -> None:
        # 1) tensors first: the largest files, the most likely place for a crash
        save_file(tensors, str(folder / MODEL_FILE))
        # 2) tokenizers, each with its own save()
        for role, tok in tokenizers.items():
            tok.save(folder / config["tokenizers"][role])
        # 3) training state: tensors in safetensors, everything else in JSON
        if config["training"]:
            state = dict(train_state or {})
            extra = dict(train_tensors or {})
            if optimizer is not None:
                state["optimizer"], opt_tensors = optimizer_to_flat(optimizer)
                extra.update(opt_tensors)
            save_file({k: v.contiguous() for k, v in extra.items()}, str(folder / STATE_TENSORS))
            _write_json(folder / STATE_JSON, state)
        # 4) config.json last: a folder without it is never mistaken for a checkpoint
        _write_json(folder / CONFIG_FILE, config)

    _atomic_folder(dest, write)
    return dest


def _atomic_folder(dest: Path, write) -> None:
    """Run ``write(tmp)`` into a temporary sibling folder, then move it to ``dest`` atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        write(tmp)
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        if dest.exists():
            # POSIX cannot rename a folder over a non-empty one: move the old one aside first.
            old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
        _fsync(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return read_json(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file missing", path=file) from None
    except ValueError as err:
        raise CheckpointError(str(err), path=file) from None


def _open_tensors(file: Path) -> TensorFile:
    """The header of a safetensors file of the checkpoint (data not read yet)."""
    try:
        return TensorFile(file)
    except BadFileError as err:
        raise CheckpointError(str(err), path=file) from None


def _read_tensors(tensors: TensorFile, device: torch.device | str) -> dict[str, Tensor]:
    try:
        return tensors.read(device)
    except BadFileError as err:
        raise CheckpointError(str(err), path=tensors.path) from None


def _resolve(path: Path) -> Path:
    """``path``, or the copy a save moved aside if a crash hit between its two renames."""
    if path.is_dir():
        return path
    aside = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if aside:
        return aside[-1]
    raise CheckpointError(f"{path}: no checkpoint folder there", path=path)


def _tied(config: dict[str, Any], file: Path) -> dict[str, str]:
    tied = config.get("tied") or {}
    if not isinstance(tied, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tied.items()
    ):
        raise CheckpointError(f"{file}: 'tied' must map tensor names to tensor names, got "
                              f"{type(tied).__name__}", path=file)  # fmt: skip
    return tied


def _build_model(config: dict[str, Any], file: Path, weights: TensorFile, tied: dict[str, str]
                 ) -> nn.Module:  # fmt: skip
    """The model ``config.json`` names, built only once the weights' header backs its config."""
    name = config.get("model_class")
    if not isinstance(name, str) or name not in MODEL_CLASSES:
        raise CheckpointError(
            f"{file}: model_class {name!r} is not one qkv can build; expected one of "
            f"{sorted(MODEL_CLASSES)} (or pass model= to load into your own module)",
            path=file,
        )
    import qkv.models

    model_cls = getattr(qkv.models, name)
    config_cls = getattr(qkv.models, MODEL_CLASSES[name])
    try:
        model_config = config_cls.from_dict(config["model_config"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{file}: bad model_config for {name} ({err})", path=file) from None
    try:
        # 1) sizes bounded by the header, 2) the exact shapes, 3) computed buffers: all before
        # a single parameter is allocated (see qkv.checkpoint.backing)
        check_sizes(model_config, tensors=len(weights.shapes), numel=weights.numel,
                    config_file=file, data_file=weights.path)  # fmt: skip
        meta = meta_model(lambda: _adapted(model_cls(model_config), config, file))
        expected = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
        check_state_shapes(expected, weights.shapes, tied=tied, data_file=weights.path,
                           origin=f"the {name} {file} describes")  # fmt: skip
        check_derived_buffers(meta, file_bytes=weights.nbytes, config_file=file)
    except BadFileError as err:
        raise CheckpointError(str(err), path=err.path) from None
    return _adapted(model_cls(model_config), config, file)


def _adapted(model: nn.Module, config: dict[str, Any], file: Path) -> nn.Module:
    """``model`` with the LoRA adapters ``config.json`` lists (a run fine-tuned with LoRA)."""
    layers = config.get("lora")
    if layers is None:
        return model
    try:
        return restore_lora(model, layers)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{file}: bad 'lora' entry ({err})", path=file) from None


def _check_model(model: nn.Module, config: dict[str, Any], file: Path) -> None:
    if config.get("model_class") != type(model).__name__:
        raise CheckpointError(
            f"{file}: the checkpoint holds a {config.get('model_class')!r}, but the model "
            f"given is a {type(model).__name__!r}",
            path=file,
        )
    mine, theirs = _model_config(model), config.get("model_config")
    if mine is not None and isinstance(theirs, dict) and mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        details = ", ".join(f"{k}: {theirs.get(k)!r} vs {mine.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"{file}: model_config differs from the model's (checkpoint vs model): {details}",
            path=file,
        )


def _check_given(model: nn.Module, weights: TensorFile, tied: dict[str, str]) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    try:
        check_state_shapes(expected, weights.shapes, tied=tied, data_file=weights.path,
                           origin=f"the {type(model).__name__} given")  # fmt: skip
    except BadFileError as err:
        raise CheckpointError(str(err), path=err.path) from None


def _load_weights(model: nn.Module, tensors: dict[str, Tensor], tied: dict[str, str]) -> None:
    """Copy the (already shape-checked) tensors in; a tied name gets its source's tensor."""
    full = dict(tensors)
    for name, source in tied.items():
        if source in tensors:
            full[name] = tensors[source]
    model.load_state_dict(full, strict=True)


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
) -> Checkpoint:
    """Read a checkpoint folder written by :func:`save_checkpoint`.

    Args:
        path: the folder.
        model: load into this module (its class and config must match); None builds the
            model named in ``config.json`` from :mod:`qkv.models`.
        optimizer: if given, its state is restored from ``train_state.*``.
        device: where the model and its tensors go; default the model's device (CPU for a
            new model).

    Returns:
        a :class:`Checkpoint`.

    Raises:
        CheckpointError (a qkv.data.files.BadFileError, a ValueError): the folder or a file
            is missing, truncated or corrupt; a config whose sizes the tensors do not back
            (checked before the model is built); tensors that do not match the model or
            optimizer, or hold NaN or infinity (the message names the file and the problem).
    """
    folder = _resolve(Path(path))
    config_file = folder / CONFIG_FILE
    config = _read_json(config_file)
    if config.get("format") != FORMAT:
        raise CheckpointError(f"{config_file}: format is {config.get('format')!r}, not {FORMAT!r}",
                              path=config_file)  # fmt: skip
    if config.get("version") != VERSION:
        raise CheckpointError(f"{config_file}: version {config.get('version')!r} is not {VERSION}",
                              path=config_file)  # fmt: skip
    tied = _tied(config, config_file)
    # The weights' header (names and shapes, no data) is checked against the model first.
    weights = _open_tensors(folder / MODEL_FILE)
    if model is None:
        model = _build_model(config, config_file, weights, tied)
    else:
        _check_model(model, config, config_file)
        _check_given(model, weights, tied)
    if device is not None:
        model.to(device)
    # read on the CPU; loading copies each tensor to where its parameter lives
    _load_weights(model, _read_tensors(weights, "cpu"), tied)
    tokenizers: dict[str, Tokenizer] = {}
    roles = config.get("tokenizers") or {}
    if not isinstance(roles, dict):
        raise CheckpointError(f"{config_file}: 'tokenizers' must map roles to file names, got "
                              f"{type(roles).__name__}", path=config_file)  # fmt: skip
    for role, name in roles.items():
        if not isinstance(name, str) or not name or Path(name).name != name:
            raise CheckpointError(f"{config_file}: tokenizer file {name!r} is not a plain name",
                                  path=config_file)  # fmt: skip
        try:
            tokenizers[role] = load_tokenizer(folder / name)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{folder / name}: cannot read tokenizer {role!r} (listed in "
                                  f"{config_file}): {err}", path=folder / name) from None
    ckpt = Checkpoint(folder, model, tokenizers, config)
    if config.get("training"):
        state_file = folder / STATE_JSON
        ckpt.train_state = _read_json(state_file)
        tensors = _read_tensors(_open_tensors(folder / STATE_TENSORS), "cpu")
        if optimizer is not None:
            if "optimizer" not in ckpt.train_state:
                raise CheckpointError(f"{state_file}: no optimizer state", path=state_file)
            where = f"{state_file} + {STATE_TENSORS}"
            try:
                with reading(where, "the optimizer state qkv writes"):
                    optimizer_from_flat(optimizer, ckpt.train_state["optimizer"], tensors, where)
            except BadFileError as err:
                raise CheckpointError(str(err), path=state_file) from None
        ckpt.train_tensors = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    elif optimizer is not None:
        raise CheckpointError(f"{config_file}: a model-only checkpoint has no optimizer state "
                              "(its 'training' is not true)", path=config_file)
    return ckpt
