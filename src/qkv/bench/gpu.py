"""GPU benchmark suite: qkv's ``triton`` backend against ``auto`` and torch's kernels.

Shapes ``q (B, H, T, D)``, ``k``/``v`` ``(B, Hkv, S, D)``, bfloat16. Groups: ``dense`` (B=4
H=16 D=128, T=S in {1024, 4096, 16384}, causal or not, fwd or fwd+bwd: triton, auto, torch
SDPA pinned to FLASH_ATTENTION / EFFICIENT_ATTENTION, ``torch.compile(flex_attention)``);
``decode`` (T=1, S in {4096, 32768}, H=32 Hkv=8); ``alibi`` (causal, T=S=4096) and ``window``
(1024, causal, T=S in {4096, 16384}) against torch SDPA given the mask materialised dense
(skipped over 40% of free memory); ``document`` (8 documents, B=2 T=S=16384:
``qkv.flex_attention``, the base, against compiled flex_attention and dense-masked triton);
``weights`` (2 heads, last 64 rows, T=S=16384: triton's lse + ``attention_weights`` against
torch flash + a softmax of the slice by hand). ``--quick``: tiny sizes for a CPU dry run.

Timing: CUDA events (device synchronised before each call), ``perf_counter`` on CPU; the
first call apart (``first_s``: JIT, compile), ``warmup`` calls, then median and min of
``repeats``. ``ratios[impl] = impl_ms / base_ms`` (> 1: the base, triton unless said, is
faster); fwd+bwd cases also time the backward alone (``bwd_*``); forward cases also time
20 calls back to back (``stream_ms``, ``stream_ratios``: a decoding loop's view, where the
host's work for one call overlaps the device's for the last). ``max_err``: max |impl -
float64 math| on forward cases where cheap (T <= 1024). Errors are recorded per case and
implementation; the suite goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
import warnings
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

import qkv
from qkv.bench.measure import available_memory_bytes, machine_info, machine_line

__all__ = ["cases", "main", "run_case", "time_ms"]

_SDPA = qkv.scaled_dot_product_attention


class _SkipError(Exception):
    """An implementation or case that is not run, with the reason."""


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


def _fits(nbytes: int, dev: torch.device) -> None:
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else available_memory_bytes()
    if nbytes > 0.4 * free:
        raise _SkipError(f"dense mask needs {nbytes / 2**30:.1f} GiB, over 40% of free memory")


def _qkv(dev, sh, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    return tuple(torch.randn(sh["B"], h, n, sh["D"], generator=g, device=dev,
                             dtype=torch.bfloat16)
                 for h, n in ((sh["H"], sh["T"]), (sh["Hkv"], sh["S"]), (sh["Hkv"], sh["S"])))


def _math(q, k, v, **kw):  # the float64 reference
    return _SDPA(q.double(), k.double(), v.double(), backend="math", **kw)


def _pinned(kind):
    """Maker of torch SDPA pinned to ``SDPBackend.<kind>`` (its refusal is recorded)."""
    def make(dev, sh, kw):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run(q, k, v):
            with sdpa_kernel(getattr(SDPBackend, kind)):
                return F.scaled_dot_product_attention(q, k, v, is_causal=kw["is_causal"])
        return run
    return make


def _compiled_flex(dev, mask_mod, T, S, score_mod=None):
    """``torch.compile(flex_attention)`` with torch's block mask of ``mask_mod`` (or None)
    and ``score_mod``."""
    if dev.type != "cuda":
        raise _SkipError("torch.compile(flex_attention) is only benchmarked on CUDA")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # each case compiles afresh: no recompile limit, no stale guards
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, T, S, device=dev)
    fn = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: fn(q, k, v, score_mod=score_mod, block_mask=bm)


def _torch_dense(dev, sh, kw):
    """torch SDPA given the mask of qkv keywords ``kw`` (causal, window, ALiBi) materialised:
    a ``(1, H, T, S)`` bfloat16 bias with ALiBi, else a ``(T, S)`` bool mask."""
    T, slopes = sh["T"], kw.get("alibi_slopes")
    _fits(T * T * (1 if slopes is None else 6 * sh["H"]), dev)  # ALiBi: built in float32
    i, j = torch.arange(T, device=dev)[:, None], torch.arange(T, device=dev)[None, :]
    keep = (j <= i) if kw.get("is_causal") else torch.ones(T, T, dtype=torch.bool, device=dev)
    if kw.get("window") is not None:
        keep &= i - j < kw["window"]
    if slopes is not None:
        bias = -slopes[:, None, None] * (i - j).abs().float()  # (H, T, S)
        keep = bias.masked_fill(~keep, float("-inf")).to(torch.bfloat16)[None]  # (1, H, T, S)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _guard(make, *args):
    try:
        return make(*args)
    except _SkipError as e:
        return str(e)


def _standard(kw, extra):
    """A case's ``build(dev, shapes)``: triton and auto with qkv keywords ``kw`` (or
    ``kw(dev, shapes)``), plus torch's implementations made by ``extra[name](dev, sh, kw)``."""
    def build(dev, sh):
        q, k, v = _qkv(dev, sh)
        kws = kw(dev, sh) if callable(kw) else kw
        impls = {b: (lambda q, k, v, b=b: _SDPA(q, k, v, backend=b, **kws))
                 for b in ("triton", "auto")}
        impls |= {name: _guard(make, dev, sh, kws) for name, make in extra.items()}
        return (q, k, v), impls, lambda: _math(q, k, v, **kws)
    return build


def _document(dev, sh, docs=8):
    (q, k, v), T = _qkv(dev, sh), sh["T"]
    doc = torch.arange(T, device=dev) // -(-T // docs)  # (T,) document of each position

    def mod(b, h, i, j):
        return doc[i] == doc[j]
    bm = qkv.create_block_mask(mod, None, None, T, T, device=dev)
    impls = {"qkv_flex": lambda q, k, v: qkv.flex_attention(q, k, v, block_mask=bm),
             "torch_flex_compiled": _guard(_compiled_flex, dev, mod, T, T),
             "triton": _guard(lambda: _fits(T * T, dev) or (  # mask (T, S) built after the check
                 lambda q, k, v, m=doc[:, None] == doc[None, :]: _SDPA(
                     q, k, v, attn_mask=m, backend="triton")))}
    return (q, k, v), impls, lambda: _math(q, k, v, attn_mask=doc[:, None] == doc[None, :])


def _relative(dev, sh):
    """Causal attention with T5's relative bias, its table learned (32 buckets, distances to
    128): qkv's flex on Triton (the gradient from its dQ kernel) and compiled flex."""
    from qkv.attention.score_mods import relative_bias

    (q, k, v), T = _qkv(dev, sh), sh["T"]
    table = (0.1 * torch.randn(32, sh["H"], device=dev)).requires_grad_()
    t5 = relative_bias(table, 32, 128, bidirectional=False)

    def causal(b, h, i, j):
        return j <= i
    bm = qkv.create_block_mask(causal, None, None, T, T, device=dev)
    impls = {"qkv_flex": lambda q, k, v: qkv.flex_attention(q, k, v, t5, bm),
             "torch_flex_compiled": _guard(_compiled_flex, dev, causal, T, T, t5)}
    return (q, k, v), impls, lambda: qkv.flex_attention(
        q.double(), k.double(), v.double(), relative_bias(table.double(), 32, 128, False), bm,
        kernel_options={"backend": "tiles"})


def _weights(dev, sh, heads, n_rows):
    from qkv.attention.weights import attention_weights

    (q, k, v), T = _qkv(dev, sh), sh["T"]
    rows, flash = slice(T - n_rows, T), _pinned("FLASH_ATTENTION")(dev, sh, {"is_causal": True})

    def triton(q, k, v):
        _, lse = _SDPA(q, k, v, is_causal=True, backend="triton", return_lse=True)
        return attention_weights(q, k, lse, is_causal=True, heads=heads, rows=rows)

    def by_hand(q, k, v, dtype=torch.float32):  # weights (B, 2, n_rows, S)
        s = q[:, heads, rows].to(dtype) @ k[:, heads].to(dtype).transpose(-2, -1)
        hide = torch.arange(T, device=dev) > torch.arange(T, device=dev)[rows, None]
        return (s / math.sqrt(sh["D"])).masked_fill(hide, float("-inf")).softmax(-1)
    impls = {"triton": triton, "torch_flash_by_hand": lambda q, k, v: (
        flash(q, k, v), by_hand(q, k, v).to(q.dtype))[1]}  # output, then the slice by hand
    return (q, k, v), impls, lambda: by_hand(q, k, v, torch.float64)


def cases(quick: bool) -> list[dict]:
    """The suite: ``{name, group, shapes, bwd, build, base}`` per case; ``build(dev, shapes)``
    gives ``(inputs, {impl: fn(q, k, v) or skip reason}, float64 reference thunk)``."""
    B, H, D = (1, 2, 32) if quick else (4, 16, 128)
    out = []

    def add(name, group, build, bwd=False, base="triton", **shapes):
        sh = dict(B=B, H=H, Hkv=H, D=D) | shapes
        out.append(dict(name=name, group=group, shapes=sh, bwd=bwd, build=build, base=base))
    dense = {"torch_flash": _pinned("FLASH_ATTENTION"),
             "torch_efficient": _pinned("EFFICIENT_ATTENTION"),
             "torch_flex_compiled": lambda dev, sh, kw: _compiled_flex(
                 dev, (lambda b, h, i, j: i >= j) if kw["is_causal"] else None, sh["T"], sh["S"])}
    def dense_cases(lengths):
        for T in lengths:
            for c in (False, True):
                for bwd in (False, True):
                    impls = dense if T == 4096 or quick else {  # compiled flex: T=4096 only
                        k: f for k, f in dense.items() if k != "torch_flex_compiled"}
                    add(f"dense{' causal' if c else ''} T={T} {'fwd+bwd' if bwd else 'fwd'}",
                        "dense", _standard({"is_causal": c}, impls), bwd, T=T, S=T)
    dense_cases([64] if quick else [4096])  # the rest after the other groups (a budget cut)
    gqa = {"torch_sdpa": lambda dev, sh, kw: lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, enable_gqa=True)}
    for S in [64, 128] if quick else [4096, 32768]:
        add(f"decode S={S}", "decode", _standard({"enable_gqa": True}, gqa),
            H=2 if quick else 32, Hkv=1 if quick else 8, T=1, S=S)
    T = 64 if quick else 4096
    alibi = _standard(lambda dev, sh: {"is_causal": True, "alibi_slopes": 2.0 ** (
        -8.0 * torch.arange(1, sh["H"] + 1, device=dev) / sh["H"])},  # (H,) Press et al.
        {"torch_dense_bias": _torch_dense})
    add(f"alibi causal T={T}", "alibi", alibi, T=T, S=T)
    w = 16 if quick else 1024
    for T in [64, 128] if quick else [4096, 16384]:
        add(f"window {w} causal T={T}", "window", _standard(
            {"is_causal": True, "window": w}, {"torch_dense_mask": _torch_dense}), T=T, S=T)
    T = 64 if quick else 16384
    for bwd in (False, True):
        add(f"document x8 T={T} {'fwd+bwd' if bwd else 'fwd'}", "document", _document, bwd,
            base="qkv_flex", B=1 if quick else 2, T=T, S=T)
    T = 64 if quick else 4096
    add(f"relative bias (T5, learned) causal T={T} fwd+bwd", "relative", _relative, True,
        base="qkv_flex", T=T, S=T)
    T, n, heads = (128, 16, [0, 1]) if quick else (16384, 64, [3, 11])
    add(f"weights 2 heads {n} rows T={T}", "weights",
        lambda dev, sh: _weights(dev, sh, heads, n), T=T, S=T)
    dense_cases([] if quick else [16384, 1024])
    return out


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
            except Exception as e:
                res[name] = {"error": _error(e, warned)}
    for key, out in (("median_ms", "ratios"), ("bwd_median_ms", "bwd_ratios"),
                     ("stream_ms", "stream_ratios")):
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


def _time_impl(fn, inputs, bwd, dev, warmup, repeats) -> dict:
    t0 = time.perf_counter()
    if not bwd:
        with torch.no_grad():
            fn(*inputs)
            _sync(dev)
            first = time.perf_counter() - t0
            return time_ms(lambda _: fn(*inputs), dev, warmup, repeats) | {
                "first_s": first, "stream_ms": stream_ms(lambda: fn(*inputs), dev)}
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
        if "stream_ms" in r:
            streams = rec.get("stream_ratios", {})
            x = f"{streams[n]:.3g}x" if n in streams else ""
            line += f"  stream {r['stream_ms']:9.3f} {x:>8}"
        print(line + (f"  err {errs[n]:.2e}" if isinstance(errs.get(n), float) else ""))


def main(argv=None, extra_cases=None) -> int:
    """The command line; ``extra_cases(quick)``: more cases (as :func:`cases` gives them) that
    need more of qkv than this package's layer sees (benchmarks/gpu.py adds paged decoding)."""
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
          f"stream: ms a call over 20 back-to-back calls (host work overlapping the device's)\n"
          f"  {'impl':22} {'median':>10} {'min':>10} {'ratio':>8} {'first':>8}")
    groups = set(a.groups.split(",")) if a.groups else None
    records, t0 = [], time.perf_counter()
    try:
        for case in cases(a.quick) + (extra_cases(a.quick) if extra_cases else []):
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
