"""The targets of the issue "Fast and lean", checked against one run's records.

Speed is a ratio to torch's kernel *in the same run* (``t_torch / t_qkv``: above 1 is
faster), from the minimum times. Each check takes every record its condition covers and
reports the worst value, with the configuration it came from. A full run measures the
lengths the targets name; a ``--quick`` run has only tiny lengths, so its checks use the
longest length measured instead and are marked indicative (``*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

__all__ = ["Target", "check_targets"]

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class Target:
    """One line of the checklist."""

    name: str
    value: float | None  # the worst measured value; None when nothing was measured
    threshold: str  # e.g. ">= 0.8x"
    status: str  # "met", "not met" or "no data"
    detail: str  # where the worst value came from, or why there is no data
    indicative: bool = False  # measured away from the target's lengths (--quick)

    def as_dict(self) -> dict:
        return asdict(self)


def _timed(records: Iterable[dict], **match) -> dict[tuple, dict]:
    """Timed records matching ``match``, keyed by (dtype, mode, T, S, causal, alibi, backend)."""
    out = {}
    for r in records:
        if r.get("time") and all(r.get(k) == v for k, v in match.items()):
            out[(r["dtype"], r["mode"], r["T"], r["S"], r["causal"], r["alibi"], r["backend"])] = r
    return out


def _where(key: tuple) -> str:
    dtype, mode, T, S, causal, alibi, _ = key
    flags = "".join((" causal" if causal else "", " alibi" if alibi else ""))
    return f"{dtype} {mode} T={T} S={S}{flags}"


def _ratios(records, *, num: str, den: str, keep: Callable[[tuple], bool], **match):
    """``t[num] / t[den]`` (min times) for every configuration where both were timed."""
    timed = _timed(records, **match)
    out = []
    for key, r in timed.items():
        if key[-1] != den or not keep(key):
            continue
        other = timed.get((*key[:-1], num))
        if other:
            out.append((other["time"]["min_s"] / r["time"]["min_s"], _where(key)))
    return out


def _check(name, values, threshold: float, higher: bool, unit: str, indicative: bool,
           missing: str) -> Target:
    sign = ">=" if higher else "<="
    text = f"{sign} {threshold:g}{unit}"
    if not values:
        return Target(name, None, text, "no data", missing, indicative)
    worst = min(values) if higher else max(values)
    ok = all(v >= threshold if higher else v <= threshold for v, _ in values)
    rest = f"; {len(values)} configurations" if len(values) > 1 else ""
    return Target(name, worst[0], text, "met" if ok else "not met",
                  f"worst at {worst[1]}{rest}", indicative)


def _at_least(lengths: list[int], minimum: int, quick: bool) -> Callable[[int], bool]:
    """Length condition: ``>= minimum``, or in a quick run the longest length measured."""
    if quick:
        longest = max(lengths, default=0)
        return lambda n: n == longest
    return lambda n: n >= minimum


def check_targets(records: list[dict], quick: bool = False) -> list[Target]:
    """Every target of the issue, checked on ``records`` (see the module docstring)."""
    att = [r for r in records if r["kind"] == "attention"]
    lengths = sorted({r["T"] for r in att})
    long = _at_least(lengths, 1024, quick)
    at4k = _at_least(lengths, 4096, quick) if quick else (lambda n: n == 4096)
    at16k = _at_least(lengths, 16384, quick) if quick else (lambda n: n == 16384)
    dec = [r for r in records if r["kind"] == "decode"]
    dec_long = _at_least(sorted({r["S"] for r in dec}), 4096, quick)
    none = "no configuration measured (lengths or dtypes not in this run, or skipped)"
    out = []

    def speed(name, dtype, mode, minimum):
        vals = _ratios(att, num="torch", den="flash", keep=lambda k: long(k[3]),
                       dtype=dtype, mode=mode)
        out.append(_check(name, vals, minimum, True, "x", quick, none))

    speed("float32 forward: flash vs torch at T >= 1024", "float32", "fwd", 0.8)
    speed("float32 forward+backward: flash vs torch at T >= 1024", "float32", "fwd_bwd", 0.7)
    speed("bfloat16 forward: flash vs torch at T >= 1024", "bfloat16", "fwd", 1.1)

    errs = []
    timed = _timed(att, dtype="bfloat16", mode="fwd")
    for key, r in timed.items():
        ref = timed.get((*key[:-1], "torch"))
        if key[-1] == "flash" and long(key[2]) and ref and ref["error_vs_fp64"]:
            errs.append((r["error_vs_fp64"] / ref["error_vs_fp64"], _where(key)))
    out.append(_check("bfloat16 forward error vs float64: flash / torch at T >= 1024", errs,
                      2.0, False, "x", quick, none))

    causal = []
    for dtype in sorted({r["dtype"] for r in att}):
        t = _timed(att, dtype=dtype, mode="fwd", backend="flash")
        for key, r in t.items():
            full = t.get((key[0], key[1], key[2], key[3], False, False, "flash"))
            if key[4] and at4k(key[2]) and full:
                causal.append((full["time"]["min_s"] / r["time"]["min_s"], _where(key)))
    out.append(_check("causal flash vs non-causal flash, forward at T = 4096", causal, 1.7,
                      True, "x", quick, none))

    mem = []
    for r in att:
        m = r.get("memory")
        if r["backend"] in ("flash", "auto") and r["mode"] == "fwd" and at16k(r["T"]) and m:
            extra = (m["peak_extra_bytes"] - m["output_bytes"]) / MiB
            mem.append((extra, f"{r['backend']} " + _where(_key(r))))
    out.append(_check("forward peak extra memory beyond the output at T = 16384 (MiB)", mem,
                      64, False, " MiB", quick, none))

    huge = [((r["memory"]["peak_rss_bytes"]) / GiB, "flash fwd_bwd T=65536 (whole process)")
            for r in records if r["kind"] == "huge" and r.get("memory")]
    skipped = [r["skipped"] for r in records if r["kind"] == "huge" and r.get("skipped")]
    out.append(_check("forward+backward at T = 65536 fits (GiB)", huge, 24, False, " GiB",
                      False, skipped[0] if skipped else "run with --huge"))

    alibi = _ratios([r for r in records if r["kind"] == "alibi"], num="math", den="flash",
                    keep=lambda k: True, mode="fwd")
    out.append(_check("ALiBi forward: flash vs math at T = 4096", alibi, 3.0, True, "x",
                      quick or any(r["T"] != 4096 for r in records if r["kind"] == "alibi"),
                      none))

    for dtype, minimum in (("float32", 1.0), ("bfloat16", 3.0)):
        vals = _ratios(dec, num="torch", den="flash", keep=lambda k: dec_long(k[3]),
                       dtype=dtype)
        out.append(_check(f"decode (T = 1) {dtype}: flash vs torch at S >= 4096", vals,
                          minimum, True, "x", quick, none))

    slow, choice, overhead = [], [], []
    groups: dict[tuple, dict[str, float]] = {}
    chosen: dict[tuple, str] = {}
    for r in records:
        if r.get("time") and r["kind"] != "huge":
            key = (*_key(r)[:-1], r["kind"])
            groups.setdefault(key, {})[r["backend"]] = r["time"]["min_s"]
            if r["backend"] == "auto":
                chosen[key] = r["chosen"]
    for key, times in groups.items():
        # qkv's backends, each called through qkv.scaled_dot_product_attention ("torch" is
        # F.scaled_dot_product_attention itself, except with ALiBi, where it is qkv's).
        alibi = key[5]
        ours = {b: t for b, t in times.items() if b not in ("auto", "torch")}
        if alibi:
            ours = {b: t for b, t in times.items() if b != "auto"}
        where = f"{key[-1]} " + _where((*key[:-1], ""))
        if "auto" in times and ours:
            slow.append((times["auto"] / min(ours.values()), where))
            # The backend auto chose, as timed under its own name: two timings of one call
            # differ by the machine's noise, not by the choice.
            name = "torch" if alibi else "qkv-torch"
            name = {"torch": name}.get(chosen.get(key, ""), chosen.get(key, ""))
            if name in ours:
                choice.append((ours[name] / min(ours.values()), where))
        if "qkv-torch" in times and "torch" in times:
            overhead.append((times["qkv-torch"] / times["torch"], where))
    out.append(_check("auto's choice: its backend vs the best of qkv's backends (time ratio)",
                      choice, 1.05, False, "x", quick, none))
    out.append(_check("auto vs the best of qkv's backends (time ratio)", slow, 1.05, False,
                      "x", quick, none))
    out.append(_check("qkv's call overhead: qkv's torch backend vs torch called directly",
                      overhead, 1.05, False, "x", quick, none))
    return out


def _key(r: dict) -> tuple:
    return (r["dtype"], r["mode"], r["T"], r["S"], r["causal"], r["alibi"], r["backend"])
