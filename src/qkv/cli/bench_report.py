"""Print and save the suite's results: rich tables, the target checklist, JSON."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from qkv.bench.measure import UNSTABLE_SPREAD, machine_line
from qkv.bench.targets import Target
from qkv.inspect.files import atomic_write

__all__ = ["print_report", "write_json"]

NAMES = {"flash": "qkv flash", "auto": "qkv auto", "math": "qkv math",
         "qkv-torch": "qkv torch", "torch": "torch"}
MiB = 2**20


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _ms(t: dict | None, key: str) -> str:
    if not t:
        return "-"
    s = t[key]
    text = f"{s * 1e3:.3g}" if s >= 1e-3 else f"{s * 1e3:.2g}"
    return text + ("!" if key == "median_s" and t.get("unstable") else "")


def _speedup(rec: dict, records: dict[tuple, dict]) -> str:
    """``t_torch / t_this`` in the same configuration (above 1: faster than torch)."""
    ref = records.get((*_config_key(rec), "torch"))
    if not (rec.get("time") and ref and ref.get("time")):
        return "-"
    return f"{ref['time']['min_s'] / rec['time']['min_s']:.2f}"


def _config_key(r: dict) -> tuple:
    return (r["kind"], r["dtype"], r["mode"], r["T"], r["S"], r["causal"], r["alibi"])


def _table(title: str, rows: list[dict], by_key: dict[tuple, dict]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("T", "S", "causal", "backend", "min ms", "med ms", "GF/s", "x torch",
                "err vs fp64", "peak MiB", "pred MiB", "meas/pred"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for r in rows:
        name = NAMES[r["backend"]] + (f" ({r['chosen']})" if r["backend"] == "auto" else "")
        head = (str(r["T"]), str(r["S"]), "yes" if r["causal"] else "no", name)
        if r["skipped"]:
            table.add_row(*head, f"skipped: {r['skipped']}", *[""] * 7)
            continue
        t, m = r["time"], r.get("memory") or {}
        err = r.get("error_vs_fp64")
        ratio = m.get("predicted_ratio")
        table.add_row(
            *head, _ms(t, "min_s"), _ms(t, "median_s"), f"{t['gflops']:.1f}",
            _speedup(r, by_key), "-" if err is None else f"{err:.1e}",
            _mib(m.get("peak_extra_bytes")), _mib(r.get("predicted_peak_bytes")),
            "-" if ratio is None else f"{ratio:.2f}",
        )
    return table


def _checklist(targets: list[Target]) -> Table:
    table = Table(title="targets (speed: t_torch / t_qkv from min times, same run)",
                  title_justify="left")
    for col in ("", "target", "needs", "measured", "where"):
        table.add_column(col)
    marks = {"met": "[green]met[/green]", "not met": "[red]NOT MET[/red]",
             "no data": "[yellow]no data[/yellow]"}
    for t in targets:
        value = "-" if t.value is None else f"{t.value:.3g}"
        star = "*" if t.indicative and t.status != "no data" else ""
        table.add_row(marks[t.status] + star, t.name, t.threshold, value, t.detail)
    return table


def print_report(console: Console, header: dict, records: list[dict],
                 targets: list[Target]) -> None:
    """Tables per (kind, dtype, mode), the memory model's accuracy, then the checklist."""
    console.print(
        f"B={header['B']}, H={header['H']}, D={header['D']}, threads={header['threads']} "
        f"(torch's setting; qkv may use fewer while other processes keep cores busy), "
        f"warmup={header['warmup']}, repeats={header['repeats']} (min and median); "
        f"{machine_line(header)}"
        + ("; one busy process beside the measurement (--load)" if header.get("load") else "")
    )
    by_key = {(*_config_key(r), r["backend"]): r for r in records}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["kind"], r["dtype"], r["mode"]), []).append(r)
    for (kind, dtype, mode), rows in groups.items():
        title = f"{kind} {dtype} {'forward' if mode == 'fwd' else 'forward+backward'}"
        console.print(_table(title, rows, by_key))
    ratios = [r["memory"]["predicted_ratio"] for r in records
              if r.get("memory") and r["memory"].get("predicted_ratio")
              and r["predicted_peak_bytes"] >= 8 * MiB]
    if ratios:
        console.print(
            f"memory model: measured / qkv.explain's predicted forward peak over {len(ratios)} "
            f"probes of 8 MiB or more: {min(ratios):.2f} .. {max(ratios):.2f}"
        )
    shaky = [r for r in records if (r.get("time") or {}).get("unstable")]
    if shaky:
        console.print(f"unstable: another process was running during {len(shaky)} of "
                      f"{len(records)} measurements (median/min > {UNSTABLE_SPREAD}; marked !)")
    if targets:
        console.print(_checklist(targets))
    if any(t.indicative and t.status != "no data" for t in targets):
        console.print("* measured away from the target's lengths (a --quick run or other "
                      "--lengths): indicative only")


def write_json(path: Path, header: dict, records: list[dict], targets: list[Target]) -> Path:
    """Everything of one run as JSON: the config and machine, every record, the checklist;
    written atomically (folders are created)."""
    data = {"config": header, "records": records, "targets": [t.as_dict() for t in targets]}
    return atomic_write(path, json.dumps(data, indent=1))
