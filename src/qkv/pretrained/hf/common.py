"""Reading Hugging Face-format folders: ``config.json``, the weights, activation names.

A Hugging Face model folder holds ``config.json`` (sizes and options; ``model_type`` says the
family) and the weights as ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), or as the older pickled ``pytorch_model.bin``, which is
read with ``torch.load(weights_only=True)`` so that no code in it can run.

:func:`open_weights` reads only the weights' shapes (safetensors headers), so that the loader can
check ``config.json`` against them before it builds anything; :meth:`HFWeights.read` then
reads the data and checks every tensor finite.
"""

from __future__ import annotations

import math
import os
import pickle
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.checkpoint.backing import check_derived_buffers, check_sizes, meta_model
from qkv.checkpoint.tensor_file import TensorFile, check_finite
from qkv.checks import is_int
from qkv.data.files import BadFileError, MissingFileError, library_error, read_json
from qkv.pretrained.errors import require
from qkv.pretrained.weights import Entry, check_entries, load_entries, skip_init

__all__ = [
    "HF_ACTIVATIONS",
    "HFWeights",
    "build_checked",
    "check_folder_model",
    "hf_activation",
    "hf_flag",
    "open_weights",
    "pad_token_id",
    "read_state_dict",
    "token_id",
]

# Hugging Face activation name -> qkv feed-forward kind.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def hf_activation(hf: Mapping[str, Any], key: str, where: str, default: str = "gelu") -> str:
    """The qkv activation for ``hf[key]``.

    Raises:
        ValueError: an activation qkv does not have (the message lists the known ones).
    """
    name = hf.get(key, default)
    if not isinstance(name, str) or name not in HF_ACTIVATIONS:
        raise ValueError(
            f"{where}: {key}={name!r} is not supported; known: {sorted(HF_ACTIVATIONS)}"
        )
    return HF_ACTIVATIONS[name]


def hf_flag(hf: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    """A true/false option of ``config.json`` (``default`` when absent or null).

    Raises:
        ValueError: anything but a JSON boolean (the string "false" is not false; transformers'
            config classes refuse it too), named with ``where``.
    """
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key}={value!r} must be true or false")
    return value


def pad_token_id(hf: Mapping[str, Any], where: str) -> int | None:
    """``pad_token_id`` of a model whose embeddings keep a row for it (BART, Marian: PyTorch's
    ``padding_idx``, which transformers builds and which refuses an id outside the table):
    None when absent or null.

    Raises:
        ValueError: an id that is not an int in ``[0, vocab_size)``.
    """
    value, vocab = hf.get("pad_token_id"), hf.get("vocab_size")
    if value is None:
        return None
    if not is_int(value) or value < 0 or (is_int(vocab) and value >= vocab):
        raise ValueError(f"{where}: pad_token_id={value!r} must be an int in [0, vocab_size="
                         f"{vocab!r}): the embeddings keep that row for padding")
    return value


def token_id(hf: Mapping[str, Any], key: str) -> int | None:
    """A special token id from ``config.json``: the first of a list; None when absent or
    outside ``[0, vocab_size)`` (GPT-2's defaults say 50256 even for small test vocabularies,
    and an id the model cannot produce is no stopping criterion)."""
    value = hf.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    vocab = hf.get("vocab_size")
    ok = is_int(value) and value >= 0
    return value if ok and (not isinstance(vocab, int) or value < vocab) else None


class HFWeights:
    """The weights of a Hugging Face folder, opened: shapes known, data not yet checked.

    Attributes:
        path: the weights file (``model.safetensors``, the shard index, or
            ``pytorch_model.bin``), named in messages.
        shapes: tensor name -> shape, over every shard.
        nbytes: the size of the weight file(s) in bytes.
    """

    def __init__(self, path: Path, files: list[TensorFile] | None = None,
                 pickled: dict[str, Tensor] | None = None) -> None:  # fmt: skip
        self.path = path
        self._files = files or []
        self._pickled = pickled
        if pickled is not None:
            self.shapes = {k: tuple(v.shape) for k, v in pickled.items()}
            self.nbytes = path.stat().st_size
        else:
            self.shapes = {}
            for f in self._files:
                for name, shape in f.shapes.items():
                    if name in self.shapes:
                        raise BadFileError(f"{f.path}: tensor {name!r} is also in another shard "
                                           f"of {path}; expected each tensor once", path=f.path)
                    self.shapes[name] = shape
            self.nbytes = sum(f.nbytes for f in self._files)

    @property
    def numel(self) -> int:
        """Number of values stored, over all tensors."""
        return sum(math.prod(shape) for shape in self.shapes.values())

    def read_some(self, names: tuple[str, ...]) -> dict[str, Tensor]:
        """Only the tensors ``names`` that the folder holds, on the CPU (not checked)."""
        if self._pickled is not None:
            return {n: self._pickled[n] for n in names if n in self._pickled}
        from safetensors import safe_open

        found: dict[str, Tensor] = {}
        for f in self._files:
            wanted = [n for n in names if n in f.shapes]
            if wanted:
                with safe_open(str(f.path), framework="pt") as handle:
                    found.update({n: handle.get_tensor(n) for n in wanted})
        return found

    def read(self) -> dict[str, Tensor]:
        """Every tensor on the CPU, each floating-point one checked finite.

        Raises:
            BadFileError: unreadable data, or a tensor holding NaN or infinity (named).
        """
        if self._pickled is not None:
            for name, t in self._pickled.items():
                check_finite(name, t, self.path)
            return dict(self._pickled)
        state: dict[str, Tensor] = {}
        for f in self._files:
            state.update(f.read("cpu"))
        return state


_CONVERT = ("convert it to model.safetensors with a tool you trust (transformers: "
            "save_pretrained(folder, safe_serialization=True))")  # fmt: skip


def _open_pickled(file: Path) -> dict[str, Tensor]:
    """``pytorch_model.bin`` through ``torch.load(weights_only=True)``, after checks on its zip.

    torch's zip format stores every record uncompressed; a compressed record (a zip bomb) or
    the legacy non-zip format (whose storages are sized by the pickle, not the file) is refused
    before torch reads anything.
    """
    size = file.stat().st_size
    try:
        with zipfile.ZipFile(file) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise BadFileError(
            f"{file}: not a zip archive ({err}); expected the zip format torch.save has written "
            f"since PyTorch 1.6 (the legacy format is refused); or {_CONVERT}",
            path=file,
        ) from None
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED or r.file_size > size:
            raise BadFileError(
                f"{file}: zip record {r.filename!r} is compressed or larger than the file "
                f"({r.file_size} bytes); expected torch.save's uncompressed records",
                path=file,
            )
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        lines = [line for line in str(err).splitlines() if "unsupported" in line.lower()]
        found = lines[0].strip() if lines else str(err).splitlines()[0]
        raise BadFileError(
            f"{file}: refused: the pickle holds more than tensors ({found}); qkv reads it with "
            f"torch.load(weights_only=True) and never runs code from a file. Expected a state "
            f"dict of tensors: {_CONVERT}",
            path=file,
        ) from None
    except BaseException as err:  # torch's zip reader raises RuntimeError on corrupt records
        if not library_error(err):
            raise
        raise BadFileError(f"{file}: not a readable torch.save file, truncated or corrupt "
                           f"({type(err).__name__}: {str(err)[:300]})", path=file) from None
    if not isinstance(loaded, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()
    ):
        raise BadFileError(f"{file}: expected a state dict (tensor name -> tensor), got "
                           f"{type(loaded).__name__}", path=file)  # fmt: skip
    return dict(loaded)


def open_weights(folder: str | os.PathLike) -> HFWeights:
    """Open the weights of a Hugging Face folder: shapes now, data on :meth:`HFWeights.read`.

    Looks for, in order: ``model.safetensors``, ``model.safetensors.index.json`` (shards),
    ``pytorch_model.bin`` (``torch.load(..., weights_only=True)``: never runs code).

    Raises:
        qkv.data.files.MissingFileError (a FileNotFoundError): none of those files is in
            ``folder`` (the message lists them), or a shard the index names is missing.
        qkv.data.files.BadFileError: a truncated or corrupt file, a shard name that is not a
            plain file name, or a pickle that holds more than tensors.
        ImportError: ``safetensors`` is missing (with the install command).
    """
    folder = Path(folder)
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    pickled = folder / "pytorch_model.bin"
    if single.is_file() or index.is_file():
        require("safetensors", "safetensors")
        if single.is_file():
            return HFWeights(single, [TensorFile(single)])
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise BadFileError(f"{index}: expected a non-empty 'weight_map' object, got "
                               f"{type(weight_map).__name__}", path=index)  # fmt: skip
        shards = sorted({str(v) for v in weight_map.values()})
        for shard in shards:
            if Path(shard).name != shard or not shard:
                raise BadFileError(f"{index}: shard {shard!r} is not a plain file name in the "
                                   "folder", path=index)  # fmt: skip
        return HFWeights(index, [TensorFile(folder / shard) for shard in shards])
    if pickled.is_file():
        return HFWeights(pickled, pickled=_open_pickled(pickled))
    raise MissingFileError(
        f"{folder} has no weights: expected model.safetensors, model.safetensors.index.json "
        "or pytorch_model.bin",
        path=folder,
    )


def read_state_dict(folder: str | os.PathLike) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face folder, by name, on the CPU, checked finite.

    ``open_weights(folder).read()``; see :func:`open_weights` for the files and errors.
    """
    return open_weights(folder).read()


def check_folder_model(
    config: Any, weights: HFWeights, build: Callable[[Any], nn.Module], *,
    entries: Callable[[Any, Iterable[str]], list[Entry]], ignored: Callable[[str], bool],
    config_file: Path,
) -> list[Entry]:
    """The checks before a model is built from a folder, in order: 1) sizes the header bounds,
    2) tensor names and shapes, 3) computed buffers (:mod:`qkv.checkpoint.backing`).

    Args:
        config: the qkv config translated from ``config.json``.
        weights: the folder's weights (header only, no data read yet).
        build: ``config -> model`` (run on the meta device only here).
        entries: ``(config, names) -> [Entry]``, the family's name map.
        ignored: names in the file the model does not use.
        config_file: the ``config.json`` (named in errors).

    Returns:
        the entries, for :func:`build_checked`.

    Raises:
        qkv.data.files.BadFileError: sizes the tensors do not back; missing, unexpected or
            misshaped tensors (named).
    """
    check_sizes(config, tensors=len(weights.shapes), numel=weights.numel,
                config_file=config_file, data_file=weights.path)  # fmt: skip
    found = entries(config, weights.shapes)
    check_entries(weights.shapes, found, where=weights.path, ignore=ignored,
                  origin=f"the model {config_file} describes")  # fmt: skip
    check_derived_buffers(meta_model(lambda: build(config)), file_bytes=weights.nbytes,
                          config_file=config_file)  # fmt: skip
    return found


def build_checked(
    config: Any, weights: HFWeights, build: Callable[[Any], nn.Module], entries: list[Entry],
    ignored: Callable[[str], bool],
) -> nn.Module:
    """Build the model without random initialisation and load the folder's tensors into it
    (after :func:`check_folder_model`); returns it in eval mode."""
    with skip_init():
        model = build(config)
    load_entries(model, weights.read(), entries, where=weights.path, ignore=ignored)
    return model.eval()
