"""Peak extra memory of one attention call, measured in a fresh subprocess.

    from qkv.bench.memprobe import peak_extra_bytes
    peak_extra_bytes("flash", B=1, H=8, Hkv=8, T=4096, S=4096, D=64, dtype="float32")

The subprocess (this file run as a script) builds ``q (B, H, T, D)``, ``k, v (B, Hkv, S, D)``,
``dout`` and, with ``alibi``, the ``(H,)`` slopes; runs the same call once on tiny inputs (lazy
imports, thread pools); resets the peak-RSS mark; runs the call once; and prints the peak RSS
growth as JSON (method: ``benchmarks/common.py``). The inputs are built before the mark is
reset and are not counted; the output, the log-sum-exp, every temporary and, with
``backward``, the saved tensors and the three input gradients are.

Backends: ``"auto"``, ``"flash"``, ``"math"``, ``"torch"`` (qkv's wrapper of torch's kernel,
the names ``qkv.explain`` uses) and ``"sdpa"`` (``torch.nn.functional.
scaled_dot_product_attention`` called directly).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

import qkv
from qkv.bench.measure import peak_rss_bytes, reset_peak_rss, run_probe

__all__ = ["BACKENDS", "attention_fn", "peak_extra_bytes", "probe"]

BACKENDS = ("auto", "flash", "math", "torch", "sdpa")


def attention_fn(backend: str, *, causal: bool, need_weights: bool, enable_gqa: bool):
    """``fn(q, k, v, alibi) -> out``: one attention call on ``backend``, weights dropped.

    Raises:
        ValueError: an unknown backend, or weights asked of torch's kernel.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "sdpa":
        if need_weights:
            raise ValueError("backend='sdpa' (torch's kernel) cannot return weights")
        return lambda q, k, v, alibi: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=enable_gqa
        )

    def fn(q, k, v, alibi):
        res = qkv.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=enable_gqa, need_weights=need_weights,
            alibi_slopes=alibi, backend=backend,
        )
        return res[0] if need_weights else res

    return fn


def make_inputs(B, H, Hkv, T, S, D, dtype, *, alibi: bool, requires_grad: bool, seed: int = 0):
    """``q (B, H, T, D)``, ``k, v (B, Hkv, S, D)``, ``dout (B, H, T, D)``, slopes ``(H,)``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen).to(dtype)  # (B, H, T, D)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)  # (B, Hkv, S, D)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)  # (B, Hkv, S, D)
    dout = torch.randn(B, H, T, D, generator=gen).to(dtype)  # (B, H, T, D)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    # ALiBi's geometric slopes 2^(-8h/H), h = 1..H (Press et al., 2022).
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H) if alibi else None  # (H,)
    return q, k, v, dout, slopes


def _run(spec: dict) -> dict:
    """Inside the subprocess: measure one call as ``spec`` describes."""
    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    fn = attention_fn(
        spec["backend"], causal=spec["causal"], need_weights=spec["need_weights"],
        enable_gqa=spec["H"] != spec["Hkv"],
    )
    backward = spec["backward"]
    dims = {k: spec[k] for k in ("B", "H", "Hkv", "T", "S", "D")}

    def call(q, k, v, dout, slopes):
        if not backward:
            with torch.no_grad():
                fn(q, k, v, slopes)
            return
        fn(q, k, v, slopes).backward(dout)

    # Tiny, but on the same code path: the flash backend decodes T <= 16 queries separately.
    tiny = {**dims, "B": 1, "T": min(dims["T"], 32), "S": min(dims["S"], 32)}
    call(*make_inputs(**tiny, dtype=dtype, alibi=spec["alibi"], requires_grad=backward))
    inputs = make_inputs(**dims, dtype=dtype, alibi=spec["alibi"], requires_grad=backward)
    reset = reset_peak_rss()
    before = peak_rss_bytes()
    start = time.perf_counter()
    call(*inputs)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    return {
        "peak_extra_bytes": peak - before, "peak_rss_bytes": peak, "baseline_rss_bytes": before,
        "peak_reset": reset, "seconds": seconds,
    }


def probe(
    backend: str,
    *,
    B: int,
    H: int,
    Hkv: int,
    T: int,
    S: int,
    D: int,
    dtype: torch.dtype | str,
    causal: bool = False,
    need_weights: bool = False,
    backward: bool = False,
    alibi: bool = False,
    threads: int = 1,
    timeout: float = 600,
) -> dict:
    """Run one call in a fresh subprocess; returns its measurements.

    Returns:
        ``peak_extra_bytes`` (peak RSS growth over the call), ``peak_rss_bytes`` (the whole
        process's peak, inputs and interpreter included), ``baseline_rss_bytes``,
        ``peak_reset`` (whether the peak mark could be reset) and ``seconds`` (the call's
        wall time, cold: it is the first full-size call).

    Raises:
        ValueError: an unknown backend or dtype, a size below 1, weights asked of ``"sdpa"``.
        RuntimeError: the subprocess failed or timed out.
    """
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"dtype must be a torch dtype or its name, got {dtype!r}")
    attention_fn(backend, causal=causal, need_weights=need_weights, enable_gqa=H != Hkv)
    dims = {"B": B, "H": H, "Hkv": Hkv, "T": T, "S": S, "D": D}
    for key, n in dims.items():
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{key} must be an int >= 1, got {n!r}")
    spec = {
        "backend": backend, **dims, "dtype": name, "causal": causal,
        "need_weights": need_weights, "backward": backward, "alibi": alibi, "threads": threads,
    }
    # ``-m``: the probe runs from the installed package, wherever the caller was started
    cmd = [sys.executable, "-m", "qkv.bench.memprobe", "--spec", json.dumps(spec)]
    return run_probe(cmd, threads, timeout=timeout)


def peak_extra_bytes(
    backend: str,
    *,
    B: int,
    H: int,
    Hkv: int,
    T: int,
    S: int,
    D: int,
    dtype: torch.dtype | str,
    causal: bool = False,
    need_weights: bool = False,
    backward: bool = False,
    threads: int = 1,
    alibi: bool = False,
) -> int:
    """Peak extra resident bytes of one attention call, measured in a fresh subprocess.

    Args:
        backend: ``"auto"``, ``"flash"``, ``"math"``, ``"torch"`` (through qkv) or ``"sdpa"``
            (torch's function called directly).
        B, H, Hkv, T, S, D: the call's shapes: ``q (B, H, T, D)``, ``k, v (B, Hkv, S, D)``.
        dtype: the inputs' dtype (or its name).
        causal: ``is_causal=True`` (top-left, as torch).
        need_weights: also ask for the ``(B, H, T, S)`` weights (qkv backends only).
        backward: forward + ``out.backward(dout)``; else one forward under ``no_grad``.
        threads: torch threads in the subprocess.
        alibi: add ALiBi slopes ``2^(-8h/H)``.

    Returns:
        Bytes of peak RSS growth over the call; inputs are not counted.

    Raises:
        ValueError, RuntimeError: as :func:`probe`.
    """
    return probe(
        backend, B=B, H=H, Hkv=Hkv, T=T, S=S, D=D, dtype=dtype, causal=causal,
        need_weights=need_weights, backward=backward, alibi=alibi, threads=threads,
    )["peak_extra_bytes"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one memory probe (internal)")
    parser.add_argument("--spec", required=True, help="the call, as JSON")
    print(json.dumps(_run(json.loads(parser.parse_args().spec))))
