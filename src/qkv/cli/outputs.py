"""Results out of the command line: JSON lines on stdout, embeddings to a file.

* :func:`print_jsonl`: ``--json`` on commands that print results: one JSON object per item,
  one per line (``{"prompt": ..., "text": ...}``), nothing else on stdout.
* :func:`write_embeddings`: ``qkv embed --out FILE``, the format chosen by the extension:
  ``.npy`` (an ``(N, E)`` float32 array, numpy's format), ``.jsonl`` (``{"text", "embedding"}``
  per line) or ``.safetensors`` (tensor ``embeddings (N, E)``, the texts in the metadata as a
  JSON list). Written atomically: the file appears whole or not at all; missing folders
  above it are created (as ``qkv train --out`` creates its run folder). :func:`check_out_file`
  refuses, before any work, an extension it does not know, an existing file (never
  overwritten, as ``train`` never overwrites a run), a folder, or a path under a file.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import Tensor

from qkv.cli.common import check_out_folder
from qkv.inspect.files import atomic_write

__all__ = ["EMBEDDING_FORMATS", "check_out_file", "print_jsonl", "write_embeddings"]

EMBEDDING_FORMATS = (".npy", ".jsonl", ".safetensors")


def print_jsonl(records: Iterable[dict]) -> None:
    """Each record as one line of JSON on stdout (UTF-8 text kept as is, not escaped)."""
    for record in records:
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def check_out_file(path: str | Path, option: str = "--out") -> Path:
    """``path`` as a new embeddings file: a known extension, not an existing file or folder,
    and no file where a folder above it should be (missing folders are fine: created later).

    Raises:
        ValueError: the message names ``option`` and the path (or the file in the way).
    """
    if not str(path).strip():
        raise ValueError(f"{option} is empty; name a file such as vectors.npy")
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder; name a file in it, e.g. "
                         f"{path / 'embeddings.npy'}")  # fmt: skip
    suffix = path.suffix.lower()
    if suffix not in EMBEDDING_FORMATS:
        raise ValueError(f"{option} {path}: unknown extension {suffix or '(none)'!r}; expected "
                         f"one of {', '.join(EMBEDDING_FORMATS)}")  # fmt: skip
    if path.exists():
        raise ValueError(f"{option} {path} already exists; it is not overwritten: remove it or "
                         "choose another file name")  # fmt: skip
    for above in path.parents:  # a file where a folder should be
        if above.is_dir():
            break
        if above.exists():
            raise ValueError(f"{option} {path} cannot be created: {above} is a file, not a "
                             "folder")  # fmt: skip
    return path


def write_embeddings(path: Path, texts: Sequence[str], embeddings: Tensor) -> Path:
    """Save ``embeddings (N, E)`` of ``texts`` to ``path`` in the format of its extension,
    creating the folders above it.

    Raises:
        ValueError: an extension other than ``.npy``, ``.jsonl``, ``.safetensors``; a file
            where a folder above ``path`` should be; ``N`` texts and a different number of
            rows.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in EMBEDDING_FORMATS:
        raise ValueError(f"--out {path}: unknown extension {suffix or '(none)'!r}; expected "
                         f"one of {', '.join(EMBEDDING_FORMATS)}")  # fmt: skip
    if embeddings.dim() != 2 or embeddings.shape[0] != len(texts):
        raise ValueError(f"embeddings must be ({len(texts)}, E), got {tuple(embeddings.shape)}")
    emb = embeddings.detach().float().cpu().contiguous()  # (N, E)
    if suffix == ".npy":
        import numpy as np

        buffer = io.BytesIO()
        np.save(buffer, emb.numpy(), allow_pickle=False)
        data = buffer.getvalue()
    elif suffix == ".jsonl":
        lines = (json.dumps({"text": t, "embedding": row}, ensure_ascii=False)
                 for t, row in zip(texts, emb.tolist(), strict=True))  # fmt: skip
        data = ("\n".join(lines) + "\n").encode("utf-8")
    else:
        from safetensors.torch import save

        data = save({"embeddings": emb}, metadata={"texts": json.dumps(list(texts),
                                                                       ensure_ascii=False)})
    if path.parent != Path("."):
        check_out_folder(path.parent, "--out").mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)
    return path

