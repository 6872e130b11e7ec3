"""``qkv bench``: the attention benchmark suite of the repository's ``benchmarks/`` folder.

The measurements live in ``benchmarks/suite.py`` (plain functions returning records), the
target checklist in ``benchmarks/targets.py``; this command parses options, runs them,
prints and saves. ``benchmarks/`` is part of the source tree, not of the installed package:
the command finds it beside ``src/`` and says so clearly when it is not there.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Annotated

import torch
import typer
from rich.console import Console

import qkv

__all__ = ["command", "find_benchmarks", "load_benchmarks", "parse_dtypes", "parse_ints"]

NAME = "bench"
DTYPES = ("float32", "bfloat16", "float64")


def find_benchmarks() -> Path:
    """The repository's ``benchmarks/`` folder (``src/qkv/../../benchmarks``).

    Raises:
        FileNotFoundError: qkv is not running from a source checkout (an installed wheel).
    """
    folder = Path(qkv.__file__).resolve().parents[2] / "benchmarks"
    if not (folder / "suite.py").is_file():
        raise FileNotFoundError(
            f"qkv bench needs the repository's benchmarks/ folder, looked for {folder}; it "
            "is not part of an installed wheel: clone the repository and install it with "
            "`pip install -e '.[cli,plots]'`"
        )
    return folder


def load_benchmarks() -> dict[str, ModuleType]:
    """Import ``common``, ``suite``, ``targets``, ``report`` and ``plot`` from ``benchmarks/``.

    Raises:
        FileNotFoundError: as :func:`find_benchmarks`.
    """
    folder = str(find_benchmarks())
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the scripts import each other as top-level modules
    names = ("common", "suite", "targets", "report", "plot")
    return {name: importlib.import_module(name) for name in names}


def parse_ints(text: str, option: str) -> tuple[int, ...]:
    """``"256,1024"`` -> ``(256, 1024)``.

    Raises:
        ValueError: an empty list, or an item that is not an int >= 1.
    """
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or not all(s.isdigit() and int(s) >= 1 for s in items):
        raise ValueError(f"{option} must be comma-separated ints >= 1, got {text!r}")
    return tuple(int(s) for s in items)


def parse_dtypes(text: str) -> tuple[str, ...]:
    """``"float32,bfloat16"`` -> ``("float32", "bfloat16")``.

    Raises:
        ValueError: an empty list or an unknown dtype.
    """
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in items if s not in DTYPES]
    if not items or bad:
        raise ValueError(f"--dtypes must be a comma-separated subset of {DTYPES}, got {text!r}")
    return items


def command(
    quick: Annotated[
        bool, typer.Option("--quick", help="Tiny sizes: checks the suite in under a minute.")
    ] = False,
    lengths: Annotated[
        str | None, typer.Option("--lengths", help="T = S of the attention runs, e.g. 256,1024.")
    ] = None,
    dtypes: Annotated[
        str | None, typer.Option("--dtypes", help="Dtypes, e.g. float32,bfloat16.")
    ] = None,
    decode_lengths: Annotated[
        str | None, typer.Option("--decode-lengths", help="S of the decoding (T = 1) runs.")
    ] = None,
    threads: Annotated[
        int | None, typer.Option("--threads", help="torch threads, fixed for the whole run "
                                 "(default: torch's choice).")
    ] = None,
    repeats: Annotated[
        int | None, typer.Option("--repeats", help="Timed repeats (default 5; quick 3).")
    ] = None,
    max_seconds: Annotated[
        float | None, typer.Option("--max-seconds", help="Time budget of one configuration; "
                                   "longer ones are skipped (default 300; quick 10).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Folder for the JSON and the PNG plot "
                                  "(default: benchmarks/results).")
    ] = None,
    no_memory: Annotated[
        bool, typer.Option("--no-memory", help="Skip the peak-memory subprocesses.")
    ] = False,
    huge: Annotated[
        bool, typer.Option("--huge", help="Also flash forward+backward at T = 65536.")
    ] = False,
) -> None:
    """Time attention (qkv flash, auto, math and torch's kernel) side by side on this machine.

    Forward and forward+backward, float32 and bfloat16, causal and not, decoding, ALiBi.

    Peak memory of each configuration in a fresh subprocess, beside qkv.explain's prediction.

    Prints the targets as a checklist; writes JSON and a log-log plot.

    [bold]Example:[/bold] qkv bench --quick --threads 1 --out /tmp/bench
    """
    # Wide enough for the result tables even when the output is not a terminal.
    console = Console(highlight=False, width=max(Console().width, 160))
    err = Console(stderr=True, highlight=False)
    try:
        mods = load_benchmarks()
        suite = mods["suite"]
        config = suite.QUICK if quick else suite.BenchConfig()
        changes: dict = {"memory": not no_memory, "huge": huge,
                         "threads": threads if threads is not None else torch.get_num_threads()}
        if lengths is not None:
            changes["lengths"] = parse_ints(lengths, "--lengths")
        if decode_lengths is not None:
            changes["decode_lengths"] = parse_ints(decode_lengths, "--decode-lengths")
        if dtypes is not None:
            changes["dtypes"] = parse_dtypes(dtypes)
        if repeats is not None:
            if repeats < 1:
                raise ValueError(f"--repeats must be >= 1, got {repeats}")
            changes["repeats"] = repeats
        if max_seconds is not None:
            if not max_seconds > 0:
                raise ValueError(f"--max-seconds must be > 0, got {max_seconds}")
            changes["max_seconds"] = max_seconds
        if changes["threads"] < 1:
            raise ValueError(f"--threads must be >= 1, got {changes['threads']}")
        config = suite.BenchConfig(**{**suite.config_dict(config), **changes})
    except (ValueError, FileNotFoundError) as e:
        err.print(f"[red]error:[/red] {e}", markup=True)
        raise typer.Exit(2) from None

    records = suite.run_suite(config, progress=lambda line: console.print(line, markup=False))
    header = {**suite.config_dict(config), **mods["common"].machine_info(), "quick": quick}
    header["threads"] = config.threads
    targets = mods["targets"].check_targets(records, quick=quick)
    mods["report"].print_report(console, header, records, targets)
    folder = out if out is not None else find_benchmarks() / "results"
    stem = "bench-quick" if quick else "bench"
    path = mods["report"].write_json(folder / f"{stem}.json", header, records, targets)
    console.print(f"wrote {path}", markup=False)
    png = mods["plot"].plot(records, folder / f"{stem}.png")
    if png is not None:
        console.print(f"wrote {png}", markup=False)
