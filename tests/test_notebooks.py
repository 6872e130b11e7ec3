"""The learners' notebooks (``notebooks/*.ipynb``) run top to bottom, offline, with pictures.

Each notebook runs in a fresh kernel started from this interpreter (``sys.executable``, so it
imports the same qkv) through a kernel spec built here: nothing is installed or registered
anywhere. The working folder is ``notebooks/``. A cell error (or a cell past its timeout)
fails the test naming the notebook and the cell; every notebook must show at least one
``image/png``; and the files in the repository must be stored stripped: no outputs, no
execution counts. A notebook that loads packaged pretrained weights
(``qkv.pretrained.load("<name>")`` in its code) is skipped, with the reason, where
``qkv.pretrained.locate`` does not find them (the check the pretrained tests rely on).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install 'qkv[notebooks]'")
nbclient = pytest.importorskip("nbclient", reason="pip install 'qkv[notebooks]'")
pytest.importorskip("ipykernel", reason="pip install 'qkv[notebooks]'")

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from nbclient.exceptions import CellExecutionError, CellTimeoutError  # noqa: E402

import qkv.pretrained  # noqa: E402

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 120
# qkv.pretrained.load("SmolLM2-135M-Instruct") in a code cell: the packaged weights it needs.
PRETRAINED = re.compile(r"""pretrained\.load\(\s*["']([^"']+)["']""")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _ThisPython(KernelSpecManager):
    """Every kernel name resolves to an IPython kernel of this very interpreter, whose
    IPython folder (profile, history) is ``ipython_dir``."""

    ipython_dir = ""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name=f"Python ({sys.executable})",
            language="python",
            env={
                **({"IPYTHONDIR": self.ipython_dir} if self.ipython_dir else {}),
                "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # debugpy's frozen-modules warning
                # One thread per kernel, as tests/conftest.py sets for the tests: `pytest -n 2`
                # then runs two notebooks on two cores without oversubscribing them (two
                # threads each on a busy 2-core machine made SmolLM2's forward 30x slower).
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
            },
        )


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6, f"expected the six notebooks in {NOTEBOOKS_DIR}, got {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_stripped(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        f"cell {i + 1} ({'outputs' if cell.get('outputs') else 'execution_count'})"
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count"))
    ]
    assert not dirty, f"{path.name} is stored with outputs; strip them: {', '.join(dirty)}"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", path.name


def _needed_weights(nb) -> list[str]:
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return sorted(set(PRETRAINED.findall(code)))


def _missing_weights(names: list[str]) -> str | None:
    for name in names:
        try:
            qkv.pretrained.locate(name)
        except ValueError:
            continue  # not a packaged name (a path): the notebook reports it if it is missing
        except (ImportError, FileNotFoundError) as err:
            return f"the pretrained weights of {name!r} are not installed: {err}"
    return None


def _where(path: Path, nb, index: int) -> str:
    cell = nb.cells[index]
    first = next((line for line in cell.source.splitlines() if line.strip()), "")
    return f"{path.name}, cell {index + 1} of {len(nb.cells)} (id {cell.get('id')}): {first!r}"


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path):
    nb = nbformat.read(path, as_version=4)
    missing = _missing_weights(_needed_weights(nb))
    if missing:
        pytest.skip(missing)
    before = _files(NOTEBOOKS_DIR)
    running = [0]

    def on_cell_execute(cell, cell_index):
        running[0] = cell_index

    # IPC sockets under tmp_path rather than TCP on localhost (ipykernel warns about the latter).
    specs = _ThisPython()
    specs.ipython_dir = str(tmp_path / "ipython")
    km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs,
                            transport="ipc", ip=str(tmp_path / "kernel"))
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
        on_cell_execute=on_cell_execute,
    )
    try:
        client.execute()
    except CellTimeoutError:
        pytest.fail(f"{_where(path, nb, running[0])} ran past {CELL_TIMEOUT_S} s",
                    pytrace=False)
    except CellExecutionError as err:
        failed = next((i for i, c in enumerate(nb.cells) if any(
            o.get("output_type") == "error" for o in c.get("outputs", []))), running[0])
        pytest.fail(f"{_where(path, nb, failed)} raised:\n{ANSI.sub('', str(err))}",
                    pytrace=False)

    kinds = [o.get("data", {}).keys() for c in nb.cells if c.cell_type == "code"
             for o in c.outputs]
    assert any("image/png" in k for k in kinds), f"{path.name} showed no picture (image/png)"
    assert _files(NOTEBOOKS_DIR) == before, (
        f"{path.name} wrote into notebooks/: {sorted(_files(NOTEBOOKS_DIR) - before)}"
    )
