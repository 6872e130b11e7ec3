"""Data-parallel training runs on real gloo process groups, and the same runs on one process.

``start(scenarios, world, out)`` starts ``world`` processes (spawned: each imports torch
afresh, which is most of the cost, so one set of processes runs every scenario). For each
scenario every process joins a new gloo group through
:func:`qkv.distributed.data_parallel.init_distributed` (torchrun's environment variables, the
scenario's timeout), runs ``SCENARIOS[name]`` and adds ``{"ok": true, ...}`` or ``{"ok":
false, "type", "message"}`` under ``name`` in ``rank<r>.json``. :func:`finish` waits up to a
deadline, kills what is left and returns the records, so a hang fails the test instead of
blocking the suite.

The runs themselves (``lm_run``, ``s2s_run``) are plain functions: the test process calls
them without a process group for the single-process reference.

For the tests that run ``qkv`` itself under torchrun: :func:`torchrun` starts
``python -m torch.distributed.run ... -m qkv ARGS``, :func:`ended` waits for it (bounded), and
:func:`assert_same_weights` compares two runs' tensors.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

from helpers import assert_close
from qkv.data import CharTokenizer, make_task
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.train import TrainConfig, seed_everything, train_lm, train_seq2seq

V = 20
# Global batch 5 on 2 ranks: shares of 3 and 2 rows (uneven on purpose). eps = 1 makes AdamW's
# step proportional to the gradient (Adam proper ignores its scale), so a gradient off by any
# factor shows in the weights.
LM_CONFIG = TrainConfig(steps=4, batch_size=5, block_size=8, lr=0.5, eps=1.0, warmup=2,
                        schedule="cosine", clip=5.0, eval_batches=3, seed=1, progress=False,
                        plot=False)  # fmt: skip
HALF = 2  # the step a checkpoint is taken at, to resume from
TASK = make_task("copy", n_train=60, n_valid=9, n_test=4, max_len=5, seed=0)
TOK = CharTokenizer.fit("0123456789")
# 7 pairs of 1-5 digits per batch: the ranks' shares hold different numbers of real tokens.
S2S_CONFIG = TrainConfig(steps=3, batch_size=7, lr=3e-3, warmup=1, eval_every=3, eval_examples=9,
                         seed=2, progress=False, plot=False)  # fmt: skip


def lm_stream() -> torch.Tensor:
    return torch.randint(0, V, (400,), generator=torch.Generator().manual_seed(7))


def lm_model(seed: int = 0, dropout: float = 0.0) -> DecoderLM:
    seed_everything(seed)
    # no biases: a key bias has an exact gradient of zero, see test_data_parallel.py
    return DecoderLM(DecoderLMConfig(V, d_model=16, num_layers=2, num_heads=2, max_len=16,
                                     bias=False, dropout=dropout))


def s2s_model(seed: int = 0) -> Seq2SeqTransformer:
    seed_everything(seed)
    return Seq2SeqTransformer(Seq2SeqConfig(TOK.vocab_size, TOK.vocab_size, d_model=16,
                                            num_heads=2, d_ff=32, num_encoder_layers=1,
                                            num_decoder_layers=1, max_len=16,
                                            dropout=0.0))  # fmt: skip


def lm_run(config: TrainConfig, init_seed: int = 0, resume=None, dropout: float = 0.0,
           callbacks=None, model=None):  # fmt: skip
    """``(model, result)`` of :func:`train_lm` on the test stream (validated on 3 batches of
    5 windows of another stream: 3 + 2 per rank)."""
    model = lm_model(init_seed, dropout) if model is None else model
    valid = torch.randint(0, V, (200,), generator=torch.Generator().manual_seed(8))
    return model, train_lm(model, lm_stream(), config, valid_ids=valid, resume=resume,
                           callbacks=callbacks)  # fmt: skip


def s2s_run(config: TrainConfig, init_seed: int = 0):
    """``(model, result)`` of :func:`train_seq2seq` on the copy task (with validation)."""
    model = s2s_model(init_seed)
    return model, train_seq2seq(model, TASK, TOK, TOK, config)


def digest(model: torch.nn.Module) -> str:
    """A hash of every tensor's bytes: equal digests = bitwise equal weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _record(name: str, model, result, out: Path, rank: int) -> dict:
    if rank == 0:
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()},
                  str(out / f"{name}.safetensors"))  # fmt: skip
    return {"digest": digest(model), "losses": [h["loss"] for h in result.history],
            "evals": result.evals, "steps": result.steps}  # fmt: skip


def scenario_train(out: Path, rank: int) -> dict:
    """Every equality run, one after another in one group. Rank 1 builds its model from
    another seed: the wrappers must start every rank from rank 0's weights."""
    init = 0 if rank == 0 else 123
    runs = {}
    model, result = lm_run(LM_CONFIG, init)
    runs["lm_ddp"] = _record("lm_ddp", model, result, out, rank)
    held: list[int] = []  # parameter elements the caller's module holds at each event
    mine = lm_model(init)
    model, result = lm_run(LM_CONFIG.replace(fsdp=True, accumulate=2, eval_every=2), model=mine,
                           callbacks=[lambda e: held.append(sum(p.numel() for p in
                                                                mine.parameters()))])  # fmt: skip
    runs["lm_fsdp_acc2"] = _record("lm_fsdp_acc2", model, result, out, rank)
    runs["fsdp_held"] = held
    model, result = lm_run(LM_CONFIG.replace(batch_size=1, steps=2), init)  # rank 1 borrows
    runs["lm_b1"] = _record("lm_b1", model, result, out, rank)
    model, result = s2s_run(S2S_CONFIG, init)
    runs["s2s_ddp"] = _record("s2s_ddp", model, result, out, rank)
    # 2 -> 1: two ranks (FSDP: gathered state) write the half-way checkpoint
    lm_run(LM_CONFIG.replace(steps=HALF, fsdp=True, run_dir=str(out / "two")), init)
    # 1 -> 2: continue the single-process half-way checkpoint on two ranks
    for name, fsdp in (("resume_ddp", False), ("resume_fsdp", True)):
        config = LM_CONFIG.replace(fsdp=fsdp, run_dir=str(out / name))
        model, result = lm_run(config, init, resume=out / "one" / "last")
        runs[name] = _record(name, model, result, out, rank)
    # dropout on: stopped half-way and resumed on 2 ranks, each rank continues its own stream
    model, _ = lm_run(LM_CONFIG, init, dropout=0.3)
    runs["dropout_whole"] = {"digest": digest(model)}
    lm_run(LM_CONFIG.replace(steps=HALF, run_dir=str(out / "drop")), init, dropout=0.3)
    model, _ = lm_run(LM_CONFIG.replace(run_dir=str(out / "drop")), init, True, dropout=0.3)
    runs["dropout_resumed"] = {"digest": digest(model)}
    return runs


def _failing_callback(rank: int, stall: float | None):
    def callback(event: dict) -> None:
        if rank == 1 and event["event"] == "step" and event["step"] == 2:
            if stall is None:
                raise ValueError("rank 1 fails on purpose at step 2")
            time.sleep(stall)  # hangs longer than the group's timeout

    return callback


def scenario_fail(out: Path, rank: int, stall: float | None = None) -> dict:
    model = lm_model()
    train_lm(model, lm_stream(), LM_CONFIG.replace(steps=6),
             callbacks=[_failing_callback(rank, stall)])  # fmt: skip
    return {}


# name -> (run, timeout of its group in seconds). ``stall``: rank 1 hangs past the timeout.
SCENARIOS = {
    "train": (scenario_train, 60.0),
    "stall": (lambda out, rank: scenario_fail(out, rank, stall=8.0), 2.0),
    "fail": (scenario_fail, 10.0),
}


def _entry(rank: int, world: int, ports: list[int], scenarios: list[str], out: str) -> None:
    """Run ``scenarios`` one after another, each in a new gloo group of its own."""
    torch.set_num_threads(1)
    from qkv.distributed.data_parallel import init_distributed, shutdown

    records: dict[str, dict] = {}
    for name, port in zip(scenarios, ports, strict=True):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        run, group_timeout = SCENARIOS[name]
        start = time.perf_counter()
        try:
            init_distributed("cpu", timeout=group_timeout)
            record = {"ok": True, **run(Path(out), rank)}
        except Exception as err:
            record = {"ok": False, "type": type(err).__name__, "message": str(err),
                      "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        record["seconds"] = time.perf_counter() - start
        records[name] = record
        # a failed rank leaves: its sockets close and its partner's collective fails at once
        shutdown()
        Path(out, f"rank{rank}.json").write_text(json.dumps(records), encoding="utf-8")
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(scenarios: list[str], world: int, out: Path) -> list:
    """Start ``world`` processes running ``scenarios``; pass the result to :func:`finish`."""
    ctx = multiprocessing.get_context("spawn")
    ports = [free_port() for _ in scenarios]
    procs = [ctx.Process(target=_entry, args=(r, world, ports, scenarios, str(out)), daemon=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    return procs


def finish(procs: list, out: Path, timeout: float) -> list[dict]:
    """Wait up to ``timeout`` seconds for every process, kill the rest; each rank's
    ``{scenario: record}`` (what it wrote before it stopped)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    records = []
    for r in range(len(procs)):
        file = out / f"rank{r}.json"
        records.append(json.loads(file.read_text()) if file.exists() else {})
    return records


REL = 1e-5


def assert_same_weights(actual: dict, expected: dict, what: str, noise: float = 0.0) -> None:
    """Every tensor within 1e-5 of its own largest entry (relative), names equal; key
    biases within ``noise`` (absolute): their exact gradient is zero (softmax does not change
    when a query's scores all move by the same amount), so they carry rounding noise only."""
    assert actual.keys() == expected.keys(), f"{what}: tensor names differ"
    for name, e in expected.items():
        if name.endswith("k_proj.bias"):
            assert_close(actual[name], e, atol=noise, name=f"{what}: {name} (noise)")
            continue
        scale = float(e.abs().max()) or 1.0
        assert_close(actual[name], e, atol=REL * scale, rtol=REL, name=f"{what}: {name}")


def torchrun(nproc: int, args: list[str]) -> subprocess.Popen:
    """``python -m torch.distributed.run --nproc-per-node nproc -m qkv *args``, started on a
    free local port, one thread per process, its output captured; see :func:`ended`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "-m", "qkv", *args]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def ended(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """The finished job of :func:`torchrun`, waited for up to ``timeout`` seconds (killed
    past it, and :class:`subprocess.TimeoutExpired` raised)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
