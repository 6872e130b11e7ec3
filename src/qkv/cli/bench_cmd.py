"""``qkv bench``: the attention benchmark suite (:mod:`qkv.bench`), from a checkout or a wheel.

The measurements live in :mod:`qkv.bench.suite` (plain functions returning records), the target
checklist in :mod:`qkv.bench.targets`; this command parses options, runs them and prints
(:mod:`qkv.cli.bench_report`). The JSON and the plot are written only where ``--out`` says:
nothing is written into the package or a source checkout unless asked. A ``--quick`` run
measures tiny sizes, noisy and far from the targets' lengths: it prints its figures and is
not graded against the targets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console

from qkv.cli.common import FLAG, fail

__all__ = ["command", "parse_dtypes", "parse_ints"]

NAME = "bench"
DTYPES = ("float32", "bfloat16", "float64")


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
        bool, typer.Option("--quick", metavar=FLAG,
                           help="Tiny sizes: checks the suite in under a minute "
                           "(not graded against the targets).")
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
        Path | None, typer.Option("--out", help="Save the JSON and the PNG plot in this "
                                  "folder (default: print only, write nothing).")
    ] = None,
    memory: Annotated[
        bool, typer.Option("--memory/--no-memory", metavar=FLAG, help="Measure each "
                           "configuration's peak memory in a fresh subprocess, or skip it.")
    ] = True,
    huge: Annotated[
        bool, typer.Option("--huge", metavar=FLAG, help="Also flash forward+backward at T = 65536.")
    ] = False,
    load: Annotated[
        bool, typer.Option("--load", metavar=FLAG,
                           help="Run one busy process beside the measurement (the "
                           "load of a browser or a data loader): compare with a quiet run.")
    ] = False,
    pretrained: Annotated[
        bool, typer.Option("--pretrained", metavar=FLAG,
                           help="Also time the pretrained models against "
                           "their reference libraries: SmolLM2 greedy (eager, compiled, int8) "
                           "vs transformers, MiniLM vs sentence-transformers, decode time in "
                           "context (needs the dev extra; minutes).")
    ] = False,
    device: Annotated[
        str, typer.Option("--device", help="cpu (this suite) or cuda: the GPU suite (the "
                          "triton backend, auto, torch's SDPA kernels and compiled flex on "
                          "bf16 shapes: dense, decoding, paged, ALiBi, windows, block masks; "
                          "--quick, --repeats and --out apply; writes gpu.json).")
    ] = "cpu",
) -> None:
    """Time attention (qkv flash, auto, math and torch's kernel) side by side on this machine.

    Forward and forward+backward, float32 and bfloat16, causal and not, decoding, ALiBi.

    Peak memory of each configuration in a fresh subprocess, beside qkv.explain's prediction.

    Prints the targets as a checklist; writes JSON and a log-log plot. With --pretrained,
    also the pretrained models against transformers and sentence-transformers.

    [bold]Example:[/bold] qkv bench --quick --threads 1 --out /tmp/bench

    [bold]On a GPU:[/bold] qkv bench --device cuda --out /tmp/bench
    """
    if device != "cpu":
        cpu_only = {"--lengths": lengths, "--dtypes": dtypes, "--decode-lengths": decode_lengths,
                    "--threads": threads, "--max-seconds": max_seconds, "--huge": huge,
                    "--load": load, "--pretrained": pretrained}  # fmt: skip
        return _gpu(device, quick, repeats, out, [k for k, v in cpu_only.items() if v])
    # Wide enough for the result tables even when the output is not a terminal.
    console = Console(highlight=False, width=max(Console().width, 160))
    from qkv.bench import suite
    from qkv.bench.measure import machine_info
    from qkv.bench.plot import plot_png
    from qkv.bench.targets import check_targets
    from qkv.cli.bench_report import print_report, write_json
    from qkv.inspect.files import atomic_write

    try:
        config = suite.QUICK if quick else suite.BenchConfig()
        changes: dict = {"memory": memory, "huge": huge,
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
    except ValueError as e:
        raise fail(e) from None

    from contextlib import nullcontext

    from qkv.bench.measure import busy_core

    with busy_core() if load else nullcontext():
        records = suite.run_suite(config,
                                  progress=lambda line: console.print(line, markup=False))
    header = {**suite.config_dict(config), **machine_info(), "quick": quick, "load": load}
    header["threads"] = config.threads
    # Quick figures are tiny and noisy: printed, never graded against the full targets.
    targets = [] if quick else check_targets(records, quick=False)
    print_report(console, header, records, targets)
    if quick:
        console.print("quick run: tiny sizes, not graded against the targets (run `qkv bench` "
                      "for the checklist)")  # fmt: skip
    speeds = _pretrained(console, config.threads, quick) if pretrained else None
    if out is None:
        console.print("not saved: give --out FOLDER to write the JSON and the plot")
        return
    stem = "bench-quick" if quick else "bench"
    path = write_json(out / f"{stem}.json", header, records, targets)
    console.print(f"wrote {path}", markup=False)
    if speeds is not None:
        text = json.dumps({"config": header, "results": speeds}, indent=2)
        written = atomic_write(out / f"{stem}-pretrained.json", text.encode())
        console.print(f"wrote {written}", markup=False)
    image = plot_png(records)
    if image is not None:
        png = atomic_write(out / f"{stem}.png", image)
        console.print(f"wrote {png}", markup=False)


def _gpu(device: str, quick: bool, repeats: int | None, out: Path | None,
         cpu_only: list[str]) -> None:
    """``qkv bench --device cuda``: the GPU suite of :mod:`qkv.bench.gpu`."""
    if device != "cuda":  # (a device this machine lacks was refused before: check_device)
        raise fail(f"--device {device}: the suites run on cpu or cuda (the current GPU; "
                   "CUDA_VISIBLE_DEVICES picks it)")
    if cpu_only:
        raise fail(f"{', '.join(cpu_only)}: the CPU suite's options; --device cuda runs the GPU "
                   "suite (--quick, --repeats and --out apply)")
    if repeats is not None and repeats < 1:
        raise fail(f"--repeats must be >= 1, got {repeats}")
    from qkv.bench import gpu

    argv = ["--device", "cuda", *(["--quick"] if quick else []),
            *(["--repeats", str(repeats)] if repeats is not None else [])]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        argv += ["--out", str(out / "gpu.json")]
    code = gpu.main(argv)
    if code:
        raise typer.Exit(code)


def _pretrained(console: Console, threads: int, quick: bool) -> list[dict]:
    """Run :mod:`qkv.pretrained.speed` (quick: tiny sizes, no variants) and print its report."""
    from qkv.pretrained import speed

    torch.set_num_threads(threads)
    repeats = 1 if quick else 3
    try:
        records = [speed.bench_minilm(32 if quick else 256, repeats)]
        variants = () if quick else ("compiled", "int8")
        records.append(speed.bench_smollm2(32, 8 if quick else 128, repeats, variants))
        contexts = (128, 512) if quick else (128, 2048)
        records.append(speed.bench_context(contexts, 4 if quick else 16, repeats))
    except (ImportError, OSError, ValueError, RuntimeError) as e:
        raise fail(e) from None
    speed.report(console, {"threads": threads}, records)
    return records
