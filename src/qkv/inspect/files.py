"""Files :mod:`qkv.inspect` writes (PNGs, the trace, the viewer), each written atomically.

A file is first written to a temporary sibling, flushed to disk, then renamed over the
destination (``os.replace``, atomic on POSIX and Windows): a reader, or a run interrupted
half-way, sees the old file or the new one, never a truncated mix.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; folders above it are created.

    The file gets the permissions a plain ``open(path, "w")`` would give it.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the folder cannot be created or written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the mode open() would (0666 less the umask)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
