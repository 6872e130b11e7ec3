"""``qkv bench``: the attention benchmark suite (:mod:`qkv.bench`), from a checkout or a wheel.

The measurements live in :mod:`qkv.bench.suite` (plain functions returning records), the target
checklist in :mod:`qkv.bench.targets`; this command gathers its options into one
:class:`BenchOptions` (checked once), runs the suite and prints (:mod:`qkv.cli.bench_report`).
The JSON and the plot are written only where ``--out`` says: nothing is written into the
package or a source checkout unless asked. A ``--quick`` run measures tiny sizes, noisy and far
from the targets' lengths: it prints its figures and is not graded against the targets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console

from qkv.cli.common import FLAG, fail

__all__ = ["BenchOptions", "command", "parse_dtypes", "parse_ints"]

NAME = "bench"
DTYPES = ("float32", "bfloat16", "float64")

Quick = Annotated[bool, typer.Option(
    "--quick", metavar=FLAG,
    help="Tiny sizes: checks the suite in under a minute (not graded against the targets).",
)]
Lengths = Annotated[str | None, typer.Option(
    "--lengths", help="T = S of the attention runs, e.g. 256,1024.",
)]
Dtypes = Annotated[str | None, typer.Option("--dtypes", help="Dtypes, e.g. float32,bfloat16.")]
DecodeLengths = Annotated[str | None, typer.Option(
    "--decode-lengths", help="S of the decoding (T = 1) runs.",
)]
Threads = Annotated[int | None, typer.Option(
    "--threads", help="torch threads, fixed for the whole run (default: torch's choice).",
)]
Repeats = Annotated[int | None, typer.Option(
    "--repeats", help="Timed repeats (default 5; quick 3).",
)]
MaxSeconds = Annotated[float | None, typer.Option(
    "--max-seconds", help="Time budget of one configuration; longer ones are skipped "
    "(default 300; quick 10).",
)]
Out = Annotated[Path | None, typer.Option(
    "--out", help="Save the JSON and the PNG plot in this folder (default: print only, write "
    "nothing).",
)]
Memory = Annotated[bool, typer.Option(
    "--memory/--no-memory", metavar=FLAG,
    help="Measure each configuration's peak memory in a fresh subprocess, or skip it.",
)]
Huge = Annotated[bool, typer.Option(
    "--huge", metavar=FLAG, help="Also flash forward+backward at T = 65536.",
)]
Load = Annotated[bool, typer.Option(
    "--load", metavar=FLAG, help="Run one busy process beside the measurement (the load of a "
    "browser or a data loader): compare with a quiet run.",
)]
Pretrained = Annotated[bool, typer.Option(
    "--pretrained", metavar=FLAG, help="Also time the pretrained models against their "
    "reference libraries: SmolLM2 greedy (eager, compiled, int8) vs transformers, MiniLM vs "
    "sentence-transformers, decode time in context (needs the dev extra; minutes).",
)]
Device = Annotated[str, typer.Option(
    "--device", help="cpu (this suite) or cuda: the GPU suite (the triton backend, auto, "
    "torch's SDPA kernels and compiled flex on bf16 shapes: dense, decoding, paged, ALiBi, "
    "windows, block masks; --quick, --repeats and --out apply; writes gpu.json).",
)]


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


@dataclass(frozen=True)
class BenchOptions:
    """The options of one ``qkv bench`` run, as typed; checked once, when built.

    ``None`` means the option was not given (the suite's default, or ``--quick``'s). On
    ``device="cuda"`` only ``quick``, ``repeats`` and ``out`` apply (the GPU suite).

    Raises:
        ValueError: a value the suite refuses (``--repeats 0``, ``--lengths x``), or, on
            cuda, another device than ``cuda`` or an option of the CPU suite.
    """

    quick: bool = False
    lengths: str | None = None  # comma-separated T = S of the attention runs
    dtypes: str | None = None  # comma-separated subset of DTYPES
    decode_lengths: str | None = None  # comma-separated S of the decoding runs
    threads: int | None = None  # None: torch's current number of threads
    repeats: int | None = None
    max_seconds: float | None = None
    out: Path | None = None  # None: print only, write nothing
    memory: bool = True
    huge: bool = False
    load: bool = False
    pretrained: bool = False
    device: str = "cpu"  # "cpu" (this suite) or "cuda" (qkv.bench.gpu)

    def __post_init__(self) -> None:
        if self.device == "cpu":
            self.suite_config()  # every CPU option parsed and range-checked
            return
        if self.device != "cuda":  # (a device this machine lacks was refused: check_device)
            raise ValueError(f"--device {self.device}: the suites run on cpu or cuda (the "
                             "current GPU; CUDA_VISIBLE_DEVICES picks it)")  # fmt: skip
        if self.cpu_only():
            raise ValueError(f"{', '.join(self.cpu_only())}: the CPU suite's options; --device "
                             "cuda runs the GPU suite (--quick, --repeats and --out apply)")
        if self.repeats is not None and self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")

    def cpu_only(self) -> list[str]:
        """The options given that only the CPU suite reads, as typed (``--lengths``, ...)."""
        given = {"--lengths": self.lengths, "--dtypes": self.dtypes,
                 "--decode-lengths": self.decode_lengths, "--threads": self.threads,
                 "--max-seconds": self.max_seconds, "--huge": self.huge, "--load": self.load,
                 "--pretrained": self.pretrained}  # fmt: skip
        return [k for k, v in given.items() if v]

    def suite_config(self) -> Any:
        """The :class:`qkv.bench.suite.BenchConfig` of the CPU suite: ``--quick``'s or the
        default one, with the options given.

        Raises:
            ValueError: a list that does not parse, or a count or budget out of range.
        """
        from qkv.bench import suite

        base = suite.QUICK if self.quick else suite.BenchConfig()
        threads = self.threads if self.threads is not None else torch.get_num_threads()
        changes: dict = {"memory": self.memory, "huge": self.huge, "threads": threads}
        if self.lengths is not None:
            changes["lengths"] = parse_ints(self.lengths, "--lengths")
        if self.decode_lengths is not None:
            changes["decode_lengths"] = parse_ints(self.decode_lengths, "--decode-lengths")
        if self.dtypes is not None:
            changes["dtypes"] = parse_dtypes(self.dtypes)
        if self.repeats is not None:
            if self.repeats < 1:
                raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
            changes["repeats"] = self.repeats
        if self.max_seconds is not None:
            if not self.max_seconds > 0:
                raise ValueError(f"--max-seconds must be > 0, got {self.max_seconds}")
            changes["max_seconds"] = self.max_seconds
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        return suite.BenchConfig(**{**suite.config_dict(base), **changes})


def command(
    quick: Quick = False,
    lengths: Lengths = None,
    dtypes: Dtypes = None,
    decode_lengths: DecodeLengths = None,
    threads: Threads = None,
    repeats: Repeats = None,
    max_seconds: MaxSeconds = None,
    out: Out = None,
    memory: Memory = True,
    huge: Huge = False,
    load: Load = False,
    pretrained: Pretrained = False,
    device: Device = "cpu",
) -> None:
    """Time attention (qkv flash, auto, math and torch's kernel) side by side on this machine.

    Forward and forward+backward, float32 and bfloat16, causal and not, decoding, ALiBi.

    Peak memory of each configuration in a fresh subprocess, beside qkv.explain's prediction.

    Prints the targets as a checklist; writes JSON and a log-log plot. With --pretrained,
    also the pretrained models against transformers and sentence-transformers.

    [bold]Example:[/bold] qkv bench --quick --threads 1 --out /tmp/bench

    [bold]On a GPU:[/bold] qkv bench --device cuda --out /tmp/bench
    """
    options = BenchOptions(
        quick=quick, lengths=lengths, dtypes=dtypes, decode_lengths=decode_lengths,
        threads=threads, repeats=repeats, max_seconds=max_seconds, out=out, memory=memory,
        huge=huge, load=load, pretrained=pretrained, device=device,
    )
    if options.device == "cuda":
        run_gpu(options)
    else:
        run_cpu(options)


def run_cpu(options: BenchOptions) -> None:
    """The CPU suite: measure, print the report (and the pretrained timings), save."""
    from qkv.bench.measure import machine_info
    from qkv.bench.suite import config_dict
    from qkv.bench.targets import check_targets
    from qkv.cli.bench_report import print_report

    # Wide enough for the result tables even when the output is not a terminal.
    console = Console(highlight=False, width=max(Console().width, 160))
    config = options.suite_config()
    records = _measure(console, config, options.load)
    header = {**config_dict(config), **machine_info(), "quick": options.quick,
              "load": options.load}  # fmt: skip
    header["threads"] = config.threads
    # Quick figures are tiny and noisy: printed, never graded against the full targets.
    targets = [] if options.quick else check_targets(records, quick=False)
    print_report(console, header, records, targets)
    if options.quick:
        console.print("quick run: tiny sizes, not graded against the targets (run `qkv bench` "
                      "for the checklist)")  # fmt: skip
    speeds = _pretrained(console, config.threads, options.quick) if options.pretrained else None
    if options.out is None:
        console.print("not saved: give --out FOLDER to write the JSON and the plot")
        return
    _save(console, options, header, records, targets, speeds)


def _measure(console: Console, config: Any, load: bool) -> list[dict]:
    """The suite's records, each line of progress printed (``load``: a busy core beside)."""
    from contextlib import nullcontext

    from qkv.bench import suite
    from qkv.bench.measure import busy_core

    with busy_core() if load else nullcontext():
        return suite.run_suite(config, progress=lambda line: console.print(line, markup=False))


def _save(console: Console, options: BenchOptions, header: dict, records: list[dict],
          targets: list, speeds: list[dict] | None) -> None:  # fmt: skip
    """Write the JSON, the pretrained timings' JSON and the plot under ``--out``."""
    from qkv.bench.plot import plot_png
    from qkv.cli.bench_report import write_json
    from qkv.inspect.files import atomic_write

    assert options.out is not None
    stem = "bench-quick" if options.quick else "bench"
    path = write_json(options.out / f"{stem}.json", header, records, targets)
    console.print(f"wrote {path}", markup=False)
    if speeds is not None:
        text = json.dumps({"config": header, "results": speeds}, indent=2)
        written = atomic_write(options.out / f"{stem}-pretrained.json", text.encode())
        console.print(f"wrote {written}", markup=False)
    image = plot_png(records)
    if image is not None:
        png = atomic_write(options.out / f"{stem}.png", image)
        console.print(f"wrote {png}", markup=False)


def run_gpu(options: BenchOptions) -> None:
    """``qkv bench --device cuda``: the GPU suite of :mod:`qkv.bench.gpu`."""
    from qkv.bench import gpu

    argv = ["--device", "cuda", *(["--quick"] if options.quick else []),
            *(["--repeats", str(options.repeats)] if options.repeats is not None else [])]
    if options.out is not None:
        options.out.mkdir(parents=True, exist_ok=True)
        argv += ["--out", str(options.out / "gpu.json")]
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
