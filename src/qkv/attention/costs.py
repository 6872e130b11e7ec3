"""A memory and FLOP model of each backend, for ``qkv.explain``.

Predictions are for one forward call and count what the call allocates beyond its inputs:
the output, the log-sum-exp, and the backend's working tensors at their peak. They follow the
code of each backend step by step (the comments say which tensors are alive together) and are
checked against measured peaks by ``tests/attention/test_costs.py`` and ``qkv bench``.

FLOPs count multiply-adds as two: ``2·T·S·D`` for ``Q·Kᵀ`` and ``2·T·S·Dv`` for ``P·V`` per
head, over the (query, key) pairs the backend actually computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.attention.call import AttentionCall
from qkv.attention.flash_blocks import block_sizes, plan_blocks

__all__ = ["Cost", "predict"]


@dataclass(frozen=True)
class Cost:
    """Predicted cost of one forward call: FLOPs and peak extra bytes (beyond the inputs)."""

    flops: int
    peak_bytes: int

    def __str__(self) -> str:
        return f"{self.flops / 1e9:.3g} GFLOP, peak {_human(self.peak_bytes)}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _visible_pairs(call: AttentionCall, bq: int, bk: int) -> int:
    """Query-key pairs inside the tiles a blockwise backend visits."""
    plans = plan_blocks(call.T, call.S, bq, bk, call.causal, call.window)
    return sum((t.i1 - t.i0) * (t.j1 - t.j0) for row in plans for t in row.tiles)


def _dense_mask_bytes(call: AttentionCall) -> int:
    """Bytes of the (B|1, H|1, T, S) mask a dense backend materialises from the parts."""
    if call.causal is None and call.alibi is None and call.window is None:
        return 0
    B, H, T, S = call.query.shape[0], call.num_heads, call.T, call.S
    heads = H if call.alibi is not None else 1
    batch = call.mask.shape[0] if call.mask is not None else 1
    itemsize = _size(call.query.dtype) if call.alibi is not None else 1
    return batch * heads * T * S * itemsize


def predict(call: AttentionCall, backend: str) -> Cost:
    """Predicted FLOPs and peak extra memory of ``backend`` on ``call`` (forward only)."""
    q, v = call.query, call.value
    B, H, T, D = q.shape
    S, Dv = call.S, v.shape[-1]
    BH = B * H
    dtype = q.dtype
    out = BH * T * Dv * _size(dtype)
    if backend == "math":
        pairs = BH * T * S
        # scores, the shifted scores and their exponentials are alive together in the softmax.
        work = 3 * pairs * _size(_acc(dtype)) + _dense_mask_bytes(call)
        return Cost(pairs * 2 * (D + Dv), out + work)
    if backend == "flash":
        bq, bk = block_sizes(T, S, D, dtype)
        acc = _size(_acc(dtype))
        pairs = B * H * _visible_pairs(call, bq, bk)
        tile = BH * bq * min(bk, S) * acc  # one score tile; exp is taken in place
        acc_rows = BH * bq * (Dv + 2) * acc * 2  # running output, max, sum and P·V of a block
        scaled_q = BH * T * D * acc  # q · scale, made once
        upcast = 0 if _acc(dtype) == dtype else (B * call.num_kv_heads * S * (D + Dv) * acc)
        lse = BH * T * acc
        return Cost(pairs * 2 * (D + Dv), out + lse + tile + acc_rows + scaled_q + upcast)
    if backend == "torch":
        pairs = BH * T * S
        if call.causal == 0 and call.mask is None and call.alibi is None:
            pairs = BH * (T * S - (T * (T - 1)) // 2 if T <= S else S * (S + 1) // 2 + (T - S) * S)
        # torch's CPU flash kernel: the output, its log-sum-exp and small per-thread tiles.
        threads = torch.get_num_threads()
        tiles = threads * 128 * 512 * 4 * 2
        lse = BH * T * 4
        return Cost(pairs * 2 * (D + Dv), out + lse + tiles + _dense_mask_bytes(call))
    raise ValueError(f"no cost model for backend {backend!r}")
