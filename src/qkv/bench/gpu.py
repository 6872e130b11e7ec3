"""GPU benchmark suite: qkv's ``triton`` backend against ``auto`` and torch's kernels.

Shapes ``q (B, H, T, D)``, ``k``/``v`` ``(B, Hkv, S, D)``, bfloat16. Groups: ``dense`` (B=4
H=16 D=128, T=S in {1024, 4096, 16384}, causal or not, fwd or fwd+bwd: triton, auto, torch
SDPA pinned to FLASH_ATTENTION / EFFICIENT_ATTENTION, ``torch.compile(flex_attention)``);
``decode`` (T=1, S in {4096, 32768}, H=32 Hkv=8); ``paged`` (a decoding step of 8 sequences
of 4096 positions in pages of 16, H=32 Hkv=8: ``qkv.nn.PagedKVCache``'s Triton kernel, its
chunked gather, torch SDPA on the cache unpaged); ``alibi`` (causal, T=S=4096) and ``window``
(1024, causal, T=S in {4096, 16384}) against torch SDPA given the mask materialised dense
(skipped over 40% of free memory); ``document`` (8 documents, B=2 T=S=16384:
``qkv.flex_attention``, the base, against compiled flex_attention and dense-masked triton);
``relative`` (causal with T5's relative bias, its table learned, T=S=4096, fwd+bwd: qkv's
flex on Triton against compiled flex); ``weights`` (2 heads, last 64 rows, T=S=16384: triton's
lse + ``attention_weights`` against torch flash + a softmax of the slice by hand). The cases
are built in :mod:`qkv.bench.gpu_cases`. ``--quick``: tiny sizes for a CPU dry run.

Timing: CUDA events (device synchronised before each call), ``perf_counter`` on CPU; the
first call apart (``first_s``: JIT, compile), ``warmup`` calls, then median and min of
``repeats``. ``ratios[impl] = impl_ms / base_ms`` (> 1: the base, triton unless said, is
faster); fwd+bwd cases also time the backward alone (``bwd_*``); forward cases also time
20 calls back to back (``stream_ms``, ``stream_ratios``: a decoding loop's view, where the
host's work for one call overlaps the device's for the last); decoding cases (groups
``decode`` and ``paged``) also the device time of the kernels a call launches, from torch's
profiler (``kernel_ms``, ``kernel_ratios``: the call less the host's time to launch it).
``max_err``: max |impl -
float64 math| on forward cases where cheap (T <= 1024). Errors are recorded per case and
implementation; the suite goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import warnings
from datetime import datetime, timezone

import torch

import qkv
from qkv.bench.gpu_cases import cases
from qkv.bench.measure import machine_info, machine_line

__all__ = ["cases", "main", "run_case", "time_ms"]

def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, dev: torch.device, warmup: int, repeats: int, setup=None) -> dict:
    """``{median_ms, min_ms}`` of ``fn(setup())`` over ``repeats`` after ``warmup`` calls;
    ``setup`` (None: ``fn(None)``) is untimed and the device idle as each call starts."""
    cuda, times = dev.type == "cuda", []
    for r in range(warmup + repeats):
        arg = setup() if setup else None
        _sync(dev)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn(arg)
        if cuda:
            end.record()
            end.synchronize()
        if r >= warmup:
            times.append(start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3)
        del arg
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def stream_ms(fn, dev: torch.device, calls: int = 20) -> float:
    """Milliseconds a call of ``fn()`` over ``calls`` calls made back to back, the device
    synchronised only before and after, as a decoding loop calls attention: the host's
    work for a call overlaps the device's for the one before, where :func:`time_ms` starts
    each call on an idle device (host overhead counted in full)."""
    fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) * 1e3 / calls


def kernel_ms(fn, dev: torch.device, calls: int = 10) -> float | None:
    """Milliseconds of device time the kernels of one ``fn()`` call take (and its copies and
    fills), summed from torch's profiler (CUPTI) over ``calls`` calls: the call's cost to the
    GPU alone, which :func:`time_ms` adds the host's launch time to. None off CUDA."""
    if dev.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    # CUPTI left attached after profiling slows later kernel launches (pytorch#144455):
    # have Kineto tear it down, so the cases timed after this one are timed as before.
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    fn()
    _sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync(dev)
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def _error(e: Exception, warned=()) -> str:
    why = "; ".join(str(w.message)[:200] for w in warned[:2])
    return f"{type(e).__name__}: {e}"[:400] + (f" [warned: {why}]" if why else "")


def run_case(case: dict, dev: torch.device, warmup: int, repeats: int) -> dict:
    """One case's record: per implementation ``median_ms``, ``min_ms``, ``first_s`` (and
    ``bwd_median_ms``, ``bwd_min_ms``), or ``error``/``skipped``; ``ratios``; ``max_err``."""
    sh, res = case["shapes"], {}
    rec = {k: case[k] for k in ("name", "group", "shapes", "base")} | {
        "dtype": "bfloat16", "pass": "fwd+bwd" if case["bwd"] else "fwd", "impls": res}
    try:
        inputs, impls, ref = case["build"](dev, sh)
    except Exception as e:
        return rec | {"error": _error(e)}
    for name, fn in impls.items():
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                res[name] = {"skipped": fn} if isinstance(fn, str) else _time_impl(
                    fn, inputs, case["bwd"], dev, warmup, repeats)
                if case["group"] in ("decode", "paged") and "median_ms" in res[name]:
                    res[name] |= _kernel_time(fn, inputs, dev)
            except Exception as e:
                res[name] = {"error": _error(e, warned)}
    for key, out in (("median_ms", "ratios"), ("bwd_median_ms", "bwd_ratios"),
                     ("stream_ms", "stream_ratios"), ("kernel_ms", "kernel_ratios")):
        if key in res.get(case["base"], {}):
            rec[out] = {n: r[key] / res[case["base"]][key] for n, r in res.items()
                        if key in r and n != case["base"]}
    cheap = sh["T"] <= 1024 and sh["B"] * sh["H"] * sh["T"] * sh["S"] <= 1 << 26
    if not case["bwd"] and (cheap or case["group"] == "weights"):
        try:
            with torch.no_grad():
                exact = ref()
                rec["max_err"] = {n: (impls[n](*inputs).double() - exact).abs().max().item()
                                  for n, r in res.items() if "median_ms" in r}
        except Exception as e:
            rec["max_err"] = {"error": _error(e)}
    return rec


def _kernel_time(fn, inputs, dev) -> dict:
    """``{kernel_ms}``, ``{}`` off CUDA, or ``{kernel_error}`` where the profiler failed."""
    try:
        with torch.no_grad():
            ms = kernel_ms(lambda: fn(*inputs), dev)
    except Exception as e:
        return {"kernel_error": _error(e)}
    return {} if ms is None else {"kernel_ms": ms}


def _time_impl(fn, inputs, bwd, dev, warmup, repeats) -> dict:
    t0 = time.perf_counter()
    if not bwd:
        with torch.no_grad():
            fn(*inputs)
            _sync(dev)
            first = time.perf_counter() - t0
            return time_ms(lambda _: fn(*inputs), dev, warmup, repeats) | {
                "first_s": first, "stream_ms": stream_ms(
                    lambda: fn(*inputs), dev, 20 if dev.type == "cuda" else 2)}  # CPU: dry run
    x = [t.detach().requires_grad_() for t in inputs]
    out = fn(*x)
    dout = torch.randn_like(out)
    torch.autograd.grad(out, x, dout)
    _sync(dev)
    first = time.perf_counter() - t0
    del out
    res = time_ms(lambda _: torch.autograd.grad(fn(*x), x, dout), dev, warmup, repeats)
    b = time_ms(lambda out: torch.autograd.grad(out, x, dout), dev, warmup, repeats,
                setup=lambda: fn(*x))
    return res | {"first_s": first, "bwd_median_ms": b["median_ms"], "bwd_min_ms": b["min_ms"]}


def _print(rec: dict) -> None:
    print(f"\n{rec['name']}  {rec['shapes']}  {rec['dtype']}  base={rec['base']}"
          + (f"  ERROR {rec['error']}" if "error" in rec else ""))
    errs, ratios, bwd_ratios = (rec.get(k, {}) for k in ("max_err", "ratios", "bwd_ratios"))
    for n, r in rec["impls"].items():
        if "median_ms" not in r:
            print(f"  {n:22} {r.get('error') or r.get('skipped')}")
            continue
        x = f"{ratios[n]:.3g}x" if n in ratios else ""
        line = f"  {n:22} {r['median_ms']:10.3f} {r['min_ms']:10.3f} {x:>8} {r['first_s']:8.2f}"
        if "bwd_median_ms" in r:
            x = f"{bwd_ratios[n]:.3g}x" if n in bwd_ratios else ""
            line += f"  bwd {r['bwd_median_ms']:9.3f} {x:>8}"
        for key, label in (("stream_ms", "stream"), ("kernel_ms", "kernels")):
            if key in r:
                shares = rec.get(key.replace("_ms", "_ratios"), {})
                x = f"{shares[n]:.3g}x" if n in shares else ""
                line += f"  {label} {r[key]:9.3f} {x:>8}"
        print(line + (f"  err {errs[n]:.2e}" if isinstance(errs.get(n), float) else ""))


def main(argv=None) -> int:
    """The command line (``python benchmarks/gpu.py``, ``qkv bench --device cuda``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU dry run)")
    p.add_argument("--out", help="JSON file for the header and the records")
    p.add_argument("--max-seconds", type=float, help="start no case after this many seconds")
    p.add_argument("--groups", help="comma-separated groups to run (default: all)")
    p.add_argument("--warmup", type=int)
    p.add_argument("--repeats", type=int)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (for a dry run: TRITON_INTERPRET=1 ... --device cpu --quick)")
    dev, small = torch.device(a.device), a.quick or a.device == "cpu"
    warmup = a.warmup if a.warmup is not None else (1 if small else 5)
    repeats = a.repeats if a.repeats is not None else (3 if small else 20)
    try:
        from triton import __version__ as triton_version
    except ImportError:
        triton_version = None
    info = machine_info()
    header = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else info["cpu"],
              "torch": torch.__version__, "triton": triton_version, "qkv": qkv.__version__,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": info,
              "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
              "warmup": warmup, "repeats": repeats, "quick": a.quick}
    print(f"{header['device']}; triton {triton_version}; {machine_line(info)}")
    print(f"ms: median and min of {repeats} after {warmup} warm-up; ratio = impl / base "
          f"(> 1: base faster); first: first call, s (JIT, compile); err: vs float64 math;\n"
          f"stream: ms a call over 20 back-to-back calls (host work overlapping the device's);\n"
          f"kernels (decoding): ms of device time a call's kernels take (torch's profiler)\n"
          f"  {'impl':22} {'median':>10} {'min':>10} {'ratio':>8} {'first':>8}")
    groups = set(a.groups.split(",")) if a.groups else None
    records, t0 = [], time.perf_counter()
    try:
        for case in cases(a.quick):
            if groups and case["group"] not in groups:
                continue
            if a.max_seconds is not None and time.perf_counter() - t0 > a.max_seconds:
                records.append({"name": case["name"], "group": case["group"],
                                "skipped": "not run: --max-seconds budget spent"})
                print(f"\n{case['name']}: not run (--max-seconds budget spent)")
                continue
            records.append(run_case(case, dev, warmup, repeats))
            _print(records[-1])
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:  # a time limit outside (SIGINT): keep what was measured
        header["interrupted"] = True
        print("\ninterrupted: writing what was measured")
    header["elapsed_s"] = time.perf_counter() - t0
    if a.out:
        tmp = f"{a.out}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"header": header, "records": records}, f, indent=1, default=str)
        os.replace(tmp, a.out)
        print(f"\nwrote {a.out}")
    return 0
