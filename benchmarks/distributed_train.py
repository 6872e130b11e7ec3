"""Benchmark data-parallel training: DDP tokens/s on 1, 2, ... processes, side by side.

Usage::

    .venv/bin/python benchmarks/distributed_train.py                 # 1 and 2 processes, CPU
    .venv/bin/python benchmarks/distributed_train.py --procs 1 2 4 --device cuda
    .venv/bin/python benchmarks/distributed_train.py --steps 2       # a smoke run
    .venv/bin/python benchmarks/distributed_train.py --fsdp          # FSDP2 instead of DDP

Every run trains the same GPT-2-style :class:`~qkv.models.DecoderLM` (``--d-model``,
``--layers``) on the same random token stream with the same global batch (``--batch``
windows of ``--block`` tokens) through :func:`qkv.train.train_lm`, in fresh processes that
join a gloo (CPU) or NCCL (``--device cuda``) group the way ``torchrun`` would set them up.
Each process gets ``--threads`` torch threads (default: the machine's cores shared out, so
every row uses the whole machine). The first step is a warm-up and is not timed: tokens/s
counts the target tokens of the global batches of steps 2..N over their wall time on rank 0.

The table shows tokens/s, the speed-up over one process and the scaling efficiency
(speed-up / processes); ``--json PATH`` also writes the records with the machine's details.
Timings on a machine shared with other work are noise: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from common import machine_info


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One process of a run: join the group, train, rank 0 writes its timing."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(args.threads_per_proc[size])
    from qkv.distributed.data_parallel import init_distributed, shutdown
    from qkv.models import DecoderLM, DecoderLMConfig
    from qkv.train import TrainConfig, seed_everything, train_lm

    init_distributed(args.device, timeout=600)
    try:
        seed_everything(0)
        config = DecoderLMConfig.gpt2_style(args.vocab).to_dict()
        config.update(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                      max_len=args.block, dropout=0.0)  # fmt: skip
        model = DecoderLM(DecoderLMConfig.from_dict(config))
        ids = torch.randint(0, args.vocab, (200_000,), generator=torch.Generator().manual_seed(1))
        train = TrainConfig(steps=args.steps, batch_size=args.batch, block_size=args.block,
                            lr=1e-3, warmup=1, schedule="constant", device=args.device,
                            fsdp=args.fsdp, progress=False, plot=False)  # fmt: skip
        stamps: list[tuple[float, int]] = []
        train_lm(model, ids, train, callbacks=[
            lambda e: stamps.append((time.perf_counter(), e["tokens"])) if e["event"] == "step"
            else None])  # fmt: skip
        if rank == 0:
            (t0, _), (t1, _) = stamps[0], stamps[-1]
            tokens = sum(n for _, n in stamps[1:])
            record = {"processes": size, "threads_per_process": torch.get_num_threads(),
                      "timed_steps": len(stamps) - 1, "seconds": t1 - t0,
                      "tokens_per_s": tokens / (t1 - t0) if t1 > t0 else float("nan"),
                      "parameters": model.num_parameters()}  # fmt: skip
            Path(out).write_text(json.dumps(record), encoding="utf-8")
    finally:
        shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(size: int, args: argparse.Namespace) -> dict:
    """Train on ``size`` fresh processes; rank 0's record."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "record.json")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, size, port, args, out))
                 for r in range(size)]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        if not Path(out).exists():
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"the {size}-process run wrote no result (exit codes {codes})")
        return json.loads(Path(out).read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: the command line), run every process count, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (1 is warm-up)")
    parser.add_argument("--batch", type=int, default=16, help="global batch, windows")
    parser.add_argument("--block", type=int, default=128, help="window length T")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per process)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: cores / processes)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run at most")
    parser.add_argument("--json", type=Path, default=None, help="also write the records here")
    args = parser.parse_args(argv)
    if args.steps < 2 or min(args.procs) < 1:
        parser.error(f"--steps must be >= 2 and --procs >= 1, got {args.steps}, {args.procs}")
    cores = os.cpu_count() or 1
    args.threads_per_proc = {n: args.threads or max(1, cores // n) for n in args.procs}
    console = Console(highlight=False, width=120)
    records = []
    for n in args.procs:
        console.print(f"{n} process{'es' if n > 1 else ''} ...")
        records.append(run(n, args))
    base = next((r["tokens_per_s"] for r in records if r["processes"] == 1), None)
    kind = "FSDP2" if args.fsdp else "DDP"
    table = Table(title=f"{kind} on {args.device}: DecoderLM d_model {args.d_model}, "
                        f"{args.layers} layers ({records[0]['parameters']:,} parameters), global "
                        f"batch {args.batch} x {args.block} tokens")  # fmt: skip
    for col in ("processes", "threads/process", "timed steps", "seconds", "tokens/s",
                "speed-up", "efficiency"):
        table.add_column(col, justify="right")
    for r in records:
        up = r["tokens_per_s"] / base if base else None
        table.add_row(str(r["processes"]), str(r["threads_per_process"]), str(r["timed_steps"]),
                      f"{r['seconds']:.2f}", f"{r['tokens_per_s']:,.0f}",
                      "-" if up is None else f"{up:.2f}x",
                      "-" if up is None else f"{up / r['processes']:.0%}")  # fmt: skip
    console.print(table)
    if args.json is not None:
        payload = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                   "machine": machine_info(), "results": records}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
        console.print(f"results: {args.json}")


if __name__ == "__main__":
    main()
