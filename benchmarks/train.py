"""Benchmark the date-normalisation recipe of ``qkv demo``: throughput and time to 99%.

Usage::

    .venv/bin/python benchmarks/train.py                  # the full recipe, seed 0 (~2-3 min)
    .venv/bin/python benchmarks/train.py --seeds 0 1 2    # several seeds, one after another
    .venv/bin/python benchmarks/train.py --quick          # the --quick recipe: checks the script

Each seed trains :func:`qkv.train.recipes.date_recipe` from scratch with
:func:`~qkv.train.recipes.train_dates` (no run folder: nothing is written but the results) and
reports:

* **target tokens/s**: training throughput as the loop counts it (real target tokens of the
  optimizer steps per second of stepping; evaluations excluded);
* **time to 99%**: seconds from the start of training to the first validation evaluation
  (every ``eval_every`` steps) with exact match >= 99%, and its step; the run itself goes on
  to the recipe's stopping target (99.5%) or its time budget;
* **train s**: the whole training, evaluations included, and why it stopped;
* **test exact match** on the held-out test split.

The machine is shared, so each record keeps the 1-minute load average before and after the
run and the torch thread count. Results go to a rich table and to
``benchmarks/results/train.json`` (``--quick``: ``train-quick.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from common import machine_info
from qkv.train.recipes import date_recipe, train_dates

RESULTS = Path(__file__).resolve().parent / "results"
MILESTONE = 0.99


def run_seed(seed: int, quick: bool) -> dict:
    """Train one seed; returns its record (see the module docstring)."""
    recipe = date_recipe(quick, seed=seed, progress=False)
    stamps: list[tuple[int, float, float]] = []

    def watch(event: dict) -> None:  # returns None: watches, never stops the run
        if event["event"] == "eval":
            stamps.append((event["step"], time.perf_counter(), event["exact_match"]))

    load_before = os.getloadavg()[0]
    run = train_dates(recipe, callbacks=[watch])
    # seconds from the start of training (when the recipe's StopWhen started its clock)
    evals = [(s, t - run.stop.start, em) for s, t, em in stamps]
    first = next(((s, t) for s, t, em in evals if em >= MILESTONE), (None, None))
    return {
        "seed": seed,
        "steps": run.result.steps,
        "stopped": run.stop.reason or "steps",
        "train_s": run.train_seconds,
        "target_tokens_per_s": run.result.tokens_per_second,
        "step_to_99": first[0],
        "seconds_to_99": first[1],
        "valid_exact_match": run.result.final_metrics.get("exact_match"),
        "test_exact_match": run.test_metrics["exact_match"],
        "evals": [{"step": s, "seconds": t, "exact_match": em} for s, t, em in evals],
        "load_1min_before": load_before,
        "load_1min_after": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--quick", action="store_true", help="the --quick recipe")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "the recipe's, 1)")  # fmt: skip
    args = parser.parse_args()
    threads = args.threads or date_recipe(args.quick).threads
    if threads is not None:
        torch.set_num_threads(threads)
    console = Console(highlight=False, width=120)
    records = []
    for seed in args.seeds:
        console.print(f"seed {seed} ...")
        records.append(run_seed(seed, args.quick))
    table = Table(title=f"date recipe ({'quick' if args.quick else 'full'}), "
                        f"{torch.get_num_threads()} threads")  # fmt: skip
    for col in ("seed", "steps", "target tok/s", "to 99% (valid)", "train s", "stopped",
                "test exact match", "load before/after"):
        table.add_column(col, justify="right")
    for r in records:
        to99 = "-" if r["seconds_to_99"] is None else (
            f"{r['seconds_to_99']:.1f} s (step {r['step_to_99']})")  # fmt: skip
        table.add_row(str(r["seed"]), str(r["steps"]), f"{r['target_tokens_per_s']:,.0f}", to99,
                      f"{r['train_s']:.1f}", r["stopped"], f"{r['test_exact_match']:.1%}",
                      f"{r['load_1min_before']:.2f} / {r['load_1min_after']:.2f}")  # fmt: skip
    console.print(table)
    recipe = date_recipe(args.quick)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("train-quick.json" if args.quick else "train.json")
    config = {"recipe": {**dataclasses.asdict(recipe), "train": recipe.train.to_dict()},
              "machine": machine_info()}  # fmt: skip
    out.write_text(json.dumps({"config": config, "results": records}, indent=2) + "\n")
    console.print(f"results: {out}")


if __name__ == "__main__":
    main()
