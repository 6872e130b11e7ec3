"""The attention benchmark suite behind ``qkv bench``: measurements as plain records.

``run_suite(config)`` measures, side by side in one run on this machine, qkv's ``flash``,
``auto`` and ``math`` backends and torch's kernel (``F.scaled_dot_product_attention``):

1. **attention**: forward (inference, ``no_grad``) and forward + backward, for each dtype,
   ``T = S`` in ``config.lengths``, causal and not; B=1, H=8, D=64.
2. **decode**: one query (``T = 1``) against ``S`` in ``config.decode_lengths`` keys.
3. **alibi**: forward with ALiBi slopes at ``config.alibi_length``, causal and not (torch's
   kernel gets the dense bias qkv's ``torch`` backend builds per call).
4. **huge** (``config.huge``): flash forward + backward at ``T = S = 65536``, B=1, H=1,
   causal, in a fresh subprocess, after checking the predicted peak against free memory.

Each record holds the time (min and median of ``repeats``, interleaved across backends), the
max error of the forward against a float64 reference on sampled query rows, the peak extra
memory of one call in a fresh subprocess (:mod:`qkv.bench.memprobe`) and, for the forward,
``qkv.explain``'s predicted peak beside it. Configurations that would not fit in memory or
would take longer than ``config.max_seconds`` are recorded as skipped, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import qkv
from qkv.attention.costs import _causal_pairs
from qkv.bench.measure import available_memory_bytes, summarise, time_interleaved
from qkv.bench.memprobe import attention_fn, make_inputs, probe

__all__ = ["BACKENDS", "QUICK", "BenchConfig", "config_dict", "run_suite"]

# "qkv-torch": qkv's torch backend, through qkv's entry point (its validation and dispatch
# included); "torch": F.scaled_dot_product_attention called directly. Their ratio is qkv's
# per-call overhead; ``auto`` is graded against qkv's own backends.
BACKENDS = ("flash", "auto", "math", "qkv-torch", "torch")
BACKWARD_FACTOR = 2.5  # backward flops per forward flop (two matmuls become five)
MEMORY_FRACTION = 0.8  # skip a configuration predicted to need more of the free memory
ERROR_ROWS = 128  # query rows sampled for the float64 reference
MATH_BACKWARD_MAX_T = 4096  # math forward + backward beyond this: O(T·S) time and memory


@dataclass(frozen=True)
class BenchConfig:
    """What ``run_suite`` measures; every field is recorded with the results."""

    lengths: tuple[int, ...] = (256, 1024, 4096, 16384)  # T = S of the attention runs
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    decode_lengths: tuple[int, ...] = (1024, 4096, 16384)  # S of the T = 1 runs
    alibi_length: int = 4096  # T = S of the ALiBi runs (0: none)
    threads: int = 1
    repeats: int = 5  # timed repeats (fewer when one call is long: see max_seconds)
    warmup: int = 1
    min_repeat_s: float = 0.05  # one timed repeat loops a fast call until this long
    max_seconds: float = 300.0  # time budget of one configuration (one backend)
    memory: bool = True  # a fresh-subprocess memory probe per configuration
    # "all", or "longest": only the float32 non-causal forward at the longest length.
    memory_scope: str = "all"
    huge: bool = False
    B: int = 1
    H: int = 8
    D: int = 64


def _flops(T: int, S: int, D: int, B: int, H: int, causal: bool, mode: str) -> float:
    """Useful flops: ``2·(D + Dv)`` per visible (query, key) pair, ×3.5 with backward."""
    pairs = _causal_pairs(T, S, 0) if causal else T * S
    fwd = 4 * D * pairs * B * H
    return fwd * (1 + BACKWARD_FACTOR) if mode == "fwd_bwd" else fwd


def _predict(backend: str, group: dict, slopes: torch.Tensor | None) -> tuple[str, int]:
    """qkv.explain's (chosen backend, predicted forward peak bytes), on zero-stride inputs."""
    dtype = getattr(torch, group["dtype"])
    zero = torch.zeros((), dtype=dtype)
    B, H, T, S, D = (group[k] for k in ("B", "H", "T", "S", "D"))
    q, kv = zero.expand(B, H, T, D), zero.expand(B, H, S, D)  # (B, H, T, D), (B, H, S, D)
    e = qkv.explain(q, kv, kv, is_causal=group["causal"], alibi_slopes=slopes)
    name = {"auto": e.chosen, "torch": "torch", "qkv-torch": "torch"}.get(backend, backend)
    return name, e.costs[name].peak_bytes


def _peak_estimate(backend: str, group: dict, forward_peak: int) -> int:
    """A safety estimate (not the model) of the peak, for skipping what cannot fit."""
    if group["mode"] == "fwd":
        return forward_peak
    inputs = 4 * group["B"] * group["H"] * (group["T"] + 2 * group["S"]) * group["D"]
    if backend == "math":
        return forward_peak * 5 // 3  # saved weights and exponentials, then their gradients
    return forward_peak + 3 * inputs  # three input gradients and their float32 partials


def reference_rows(q, k, v, rows: torch.Tensor, causal: bool, slopes) -> torch.Tensor:
    """Float64 attention output for query ``rows`` only: ``(B, H, R, D)``."""
    T, S, D = q.shape[2], k.shape[2], q.shape[3]
    q64 = q.detach()[:, :, rows].double()  # (B, H, R, D)
    k64, v64 = k.detach().double(), v.detach().double()  # (B, H, S, D)
    s = q64 @ k64.transpose(-2, -1) / math.sqrt(D)  # (B, H, R, S)
    j = torch.arange(S)[None, :]  # (1, S)
    if causal:
        s.masked_fill_(j > rows[:, None], float("-inf"))
    if slopes is not None:
        shift = 0 if causal else S - T
        distance = (rows[:, None] + shift - j).abs().double()  # (R, S)
        s -= slopes.double()[:, None, None] * distance  # (B, H, R, S)
    return torch.softmax(s, dim=-1) @ v64  # (B, H, R, D)


def _sample_rows(T: int) -> torch.Tensor:
    return torch.linspace(0, T - 1, min(T, ERROR_ROWS)).round().long().unique()


class _Runner:
    """Runs groups of configurations; remembers measured rates to predict later times."""

    def __init__(self, config: BenchConfig, progress: Callable[[str], None]) -> None:
        self.config = config
        self.progress = progress
        self.rates: dict[tuple, float] = {}  # seconds per useful flop, by configuration

    def group(self, kind: str, dtype: str, mode: str, T: int, S: int, causal: bool,
              alibi: bool = False, backends: tuple[str, ...] = BACKENDS) -> list[dict]:
        c = self.config
        base = dict(kind=kind, dtype=dtype, mode=mode, B=c.B, H=c.H, D=c.D, T=T, S=S,
                    causal=causal, alibi=alibi)
        flops = _flops(T, S, c.D, c.B, c.H, causal, mode)
        B, H, D = c.B, c.H, c.D
        backward = mode == "fwd_bwd"
        q, k, v, dout, slopes = make_inputs(B, H, H, T, S, D, getattr(torch, dtype),
                                            alibi=alibi, requires_grad=backward)
        records, fns, counts = {}, {}, {}
        free = available_memory_bytes()
        for name in backends:
            if name == "qkv-torch" and alibi:
                continue  # with ALiBi "torch" is already qkv's torch backend (a dense bias)
            key = (kind, name, dtype, mode, causal, alibi)
            chosen, predicted = _predict(name, base, slopes)
            rec = dict(base, backend=name, chosen=chosen, flops=flops, skipped=None,
                       time=None, error_vs_fp64=None, memory=None,
                       predicted_peak_bytes=predicted if mode == "fwd" else None)
            records[name] = rec
            estimate = self.rates.get(key, 0.0) * flops
            need = _peak_estimate(name, base, predicted)
            if name == "math" and backward and T > MATH_BACKWARD_MAX_T:
                rec["skipped"] = (f"math forward+backward is skipped beyond T="
                                  f"{MATH_BACKWARD_MAX_T} (O(T·S) time and memory)")
            elif need > MEMORY_FRACTION * free:
                rec["skipped"] = (f"predicted peak {need / 2**30:.1f} GiB > "
                                  f"{MEMORY_FRACTION:.0%} of free memory {free / 2**30:.1f} GiB")
            elif 2 * estimate > c.max_seconds:
                rec["skipped"] = (f"estimated {estimate:.0f} s per call (its rate at a shorter "
                                  f"length) x 2 calls > budget {c.max_seconds:.0f} s")
            if rec["skipped"]:
                self.progress(f"  skip {self._label(rec)}: {rec['skipped']}")
                continue
            fns[name] = self._call(name, dtype, causal, alibi, q, k, v, dout, slopes, backward)
            counts[name] = c.repeats if estimate == 0 else max(
                1, min(c.repeats, int(c.max_seconds / max(estimate, 1e-9)) - c.warmup))
        timed = time_interleaved(fns, warmup=c.warmup, repeats=counts,
                                 min_repeat_s=c.min_repeat_s)
        rows = _sample_rows(T)
        ref = None if backward else reference_rows(q, k, v, rows, causal, slopes)
        for name, (times, number) in timed.items():
            rec = records[name]
            rec["time"] = dict(summarise(times, flops), repeats=len(times), number=number,
                               times=times)
            self.rates[(kind, name, dtype, mode, causal, alibi)] = min(times) / flops
            if ref is not None:
                out = fns[name].last[:, :, rows].double()  # (B, H, R, D)
                rec["error_vs_fp64"] = float((out - ref).abs().max())
                rec["error_rows"] = len(rows)
            if c.memory and self._probe_memory_of(rec):
                rec["memory"] = self._memory(rec, min(times))
            self.progress(self._line(rec))
        return list(records.values())

    def _probe_memory_of(self, rec: dict) -> bool:
        if self.config.memory_scope == "all":
            return True
        return (rec["kind"], rec["dtype"], rec["mode"], rec["causal"], rec["T"]) == (
            "attention", "float32", "fwd", False, max(self.config.lengths))

    @staticmethod
    def _call(name, dtype, causal, alibi, q, k, v, dout, slopes, backward):
        # torch's kernel takes no ALiBi slopes: it gets qkv's dense bias (built per call).
        backend = {"qkv-torch": "torch", "torch": "torch" if alibi else "sdpa"}.get(name, name)
        fn = attention_fn(backend, causal=causal, need_weights=False, enable_gqa=False)

        def run():
            if backward:
                for t in (q, k, v):
                    t.grad = None
                fn(q, k, v, slopes).backward(dout)
            else:
                with torch.no_grad():
                    run.last = fn(q, k, v, slopes)

        run.last = None
        return run

    def _memory(self, rec: dict, seconds: float) -> dict | None:
        backend = rec["backend"]
        backend = {"qkv-torch": "torch", "torch": "torch" if rec["alibi"] else "sdpa"}.get(
            backend, backend)
        try:
            got = probe(backend, B=rec["B"], H=rec["H"], Hkv=rec["H"], T=rec["T"], S=rec["S"],
                        D=rec["D"], dtype=rec["dtype"], causal=rec["causal"],
                        backward=rec["mode"] == "fwd_bwd", alibi=rec["alibi"],
                        threads=self.config.threads, timeout=120 + 10 * seconds)
        except RuntimeError as err:
            self.progress(f"  memory probe failed for {self._label(rec)}: {err}")
            return None
        itemsize = torch.empty((), dtype=getattr(torch, rec["dtype"])).element_size()
        out = rec["B"] * rec["H"] * rec["T"] * rec["D"] * itemsize
        mem = {"peak_extra_bytes": got["peak_extra_bytes"], "output_bytes": out,
               "peak_rss_bytes": got["peak_rss_bytes"], "peak_reset": got["peak_reset"]}
        if rec["predicted_peak_bytes"]:
            mem["predicted_ratio"] = got["peak_extra_bytes"] / rec["predicted_peak_bytes"]
        return mem

    @staticmethod
    def _label(rec: dict) -> str:
        flags = "".join((" causal" if rec["causal"] else "", " alibi" if rec["alibi"] else ""))
        return (f"{rec['kind']} {rec['dtype']} {rec['mode']} T={rec['T']} S={rec['S']}{flags} "
                f"{rec['backend']}")

    def _line(self, rec: dict) -> str:
        t = rec["time"]
        line = f"  {self._label(rec)}: min {t['min_s'] * 1e3:.3g} ms, median " \
               f"{t['median_s'] * 1e3:.3g} ms ({t['repeats']}x{t['number']})"
        if rec["memory"]:
            line += f", peak +{rec['memory']['peak_extra_bytes'] / 2**20:.1f} MiB"
        return line

    def huge(self) -> dict:
        """Flash forward + backward at T = S = 65536 in a subprocess, if it should fit."""
        c = self.config
        base = dict(kind="huge", dtype="float32", mode="fwd_bwd", B=1, H=1, D=c.D, T=65536,
                    S=65536, causal=True, alibi=False, backend="flash", chosen="flash",
                    time=None, error_vs_fp64=None, memory=None, skipped=None)
        _, forward = _predict("flash", base, None)
        inputs = 4 * 65536 * c.D * 4
        need = _peak_estimate("flash", base, forward) + inputs
        base.update(flops=_flops(65536, 65536, c.D, 1, 1, True, "fwd_bwd"),
                    predicted_peak_bytes=None, predicted_total_bytes=need)
        free = available_memory_bytes()
        if need > MEMORY_FRACTION * free:
            base["skipped"] = (f"predicted {need / 2**30:.2f} GiB > {MEMORY_FRACTION:.0%} of "
                               f"free memory {free / 2**30:.1f} GiB")
            self.progress(f"  skip huge: {base['skipped']}")
            return base
        rate = self.rates.get(("attention", "flash", "float32", "fwd_bwd", True, False))
        eta = f", about {rate * base['flops']:.0f} s" if rate else ""
        self.progress(f"  huge: flash float32 fwd+bwd T=S=65536 B=1 H=1 causal; explain "
                      f"predicts {need / 2**20:.0f} MiB with the inputs{eta}")
        got = probe("flash", B=1, H=1, Hkv=1, T=65536, S=65536, D=c.D, dtype="float32",
                    causal=True, backward=True, threads=c.threads, timeout=7200)
        base["time"] = dict(summarise([got["seconds"]], base["flops"]), repeats=1, number=1,
                            times=[got["seconds"]])
        base["memory"] = {k: got[k] for k in ("peak_extra_bytes", "peak_rss_bytes",
                                              "peak_reset")}
        self.progress(f"  huge: {got['seconds']:.1f} s, process peak "
                      f"{got['peak_rss_bytes'] / 2**30:.2f} GiB")
        return base


def run_suite(config: BenchConfig, progress: Callable[[str], None] = print) -> list[dict]:
    """Every measurement of ``config``, one record per (configuration, backend).

    Sets torch's thread count to ``config.threads`` for the run and restores it after.
    ``progress`` receives one line per configuration as the run goes.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    runner = _Runner(config, progress)
    records: list[dict] = []
    try:
        for dtype in config.dtypes:
            for causal in (False, True):
                for mode in ("fwd", "fwd_bwd"):
                    progress(f"attention {dtype} {mode}{' causal' if causal else ''}")
                    for T in sorted(config.lengths):
                        records += runner.group("attention", dtype, mode, T, T, causal)
        for dtype in config.dtypes:
            progress(f"decode {dtype} (T=1)")
            for S in sorted(config.decode_lengths):
                records += runner.group("decode", dtype, "fwd", 1, S, False)
        if config.alibi_length:
            progress("alibi float32 fwd")
            T = config.alibi_length
            for causal in (False, True):
                records += runner.group("alibi", "float32", "fwd", T, T, causal, alibi=True)
        if config.huge:
            progress("huge (--huge)")
            records.append(runner.huge())
    finally:
        torch.set_num_threads(previous)
    return records


def config_dict(config: BenchConfig) -> dict:
    """The config as JSON-ready data."""
    return asdict(config)



# --quick: tiny sizes, a short budget, and memory probes only where they say something.
QUICK = BenchConfig(
    lengths=(64, 128), decode_lengths=(256, 1024), alibi_length=128, repeats=3,
    min_repeat_s=0.01, max_seconds=10.0, memory_scope="longest",
)
