"""A memory and FLOP model of each backend, for ``qkv.explain``.

Predictions are for one forward call and count what the call allocates beyond its inputs:
the output, the log-sum-exp, and the backend's working tensors at their peak. They follow the
code of each backend step by step (the comments say which tensors are alive together) and are
checked against measured peaks by ``tests/attention/test_costs.py`` and ``qkv bench``. Only
qkv's own backends (``math``, ``flash``, ``torch``) have a model: :func:`predict` gives
``None`` for any other registered backend.

FLOPs count multiply-adds as two: ``2·T·S·D`` for ``Q·Kᵀ`` and ``2·T·S·Dv`` for ``P·V`` per
head, over the (query, key) pairs the backend actually computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.attention.call import AttentionCall
from qkv.attention.flash_blocks import DECODE_ROWS, block_sizes, visited_pairs
from qkv.attention.flash_decode import MAX_SPLITS

__all__ = ["Cost", "predict"]


@dataclass(frozen=True)
class Cost:
    """Predicted cost of one forward call: FLOPs and peak extra bytes (beyond the inputs)."""

    flops: int
    peak_bytes: int

    def __str__(self) -> str:
        return f"{self.flops / 1e9:.3g} GFLOP, peak {_human(self.peak_bytes)}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def _size(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor allocated: ``auto`` predicts costs on every call


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _visible_pairs(call: AttentionCall, bq: int, bk: int) -> int:
    """Query-key pairs inside the tiles a blockwise backend visits (closed form: no tile is
    listed, so ``explain`` at ``T = S = 10⁹`` is as quick as at 10)."""
    return visited_pairs(call.T, call.S, bq, bk, call.causal, call.window)


def _dense_mask_bytes(call: AttentionCall, itemsize: int) -> int:
    """Bytes of the (B|1, H|1, T, S) mask ``dense_mask`` materialises from the parts.

    Causal and window parts alone give a ``(T, S)`` bool; ALiBi gives an ``(H, T, S)`` bias
    of ``itemsize`` bytes an entry (the float mask dtype: float32 for half precision on CPU).
    """
    if call.causal is None and call.alibi is None and call.window is None:
        return 0
    H, T, S = call.num_heads, call.T, call.S
    # Combined with a user mask, the result takes that mask's batch and head dimensions.
    batch, heads = call.mask.shape[:2] if call.mask is not None else (1, 1)
    heads = H if call.alibi is not None else heads
    itemsize = itemsize if call.alibi is not None else 1
    return batch * heads * T * S * itemsize


def _alibi_build_bytes(call: AttentionCall, itemsize: int) -> int:
    """While ``dense_mask`` builds an ALiBi bias: the ``(H, T, S)`` bias beside the ``(T, S)``
    distances it is made from, both of ``itemsize`` bytes an entry."""
    if call.alibi is None:
        return 0
    H, T, S = call.num_heads, call.T, call.S
    return H * T * S * itemsize + T * S * itemsize


def _torch_mask_itemsize(call: AttentionCall) -> int:
    """Bytes per entry of a float mask handed to torch (``torch_kernel._mask_dtype``)."""
    dtype = call.query.dtype
    return _size(_acc(dtype)) if call.query.device.type == "cpu" else _size(dtype)


def _rebuild_bytes(call: AttentionCall) -> int:
    """Peak working set of ``weights.rebuild`` (flash with ``need_weights``), output excluded.

    It indexes copies of ``q (B, H, T, D)`` and ``k (B, H, S, D)`` (one key head per query
    head), then holds the scores, the scores minus the lse and their exponential together,
    each ``(B, H, T, S)`` in the accumulation dtype; the causal keep mask ``(T, S)`` bool and
    the float32 ALiBi bias ``(H, T, S)`` stay alive beside them.
    """
    q = call.query
    B, H, T, D = q.shape
    S = call.S
    pairs = B * H * T * S
    copies = B * H * (T + S) * D * _size(q.dtype)
    structure = T * S if call.causal is not None else 0
    bias = H * T * S * 4 if call.alibi is not None else 0
    return 3 * pairs * _size(_acc(q.dtype)) + copies + structure + bias


def _torch_split(T: int) -> int:
    """Query rows per block of torch's CPU flash kernel (keys go by 512)."""
    return 256 if T >= 768 else 64 if T >= 192 else 32


def _torch_dense(call: AttentionCall) -> bool:
    """Whether qkv's torch backend materialises a dense mask (``torch_kernel.run``)."""
    if call.plain and call.groups > 1:
        return False  # query heads folded into the length, no mask at all
    top_left_only = call.mask is None and call.alibi is None and call.window is None
    return not (call.causal in (None, 0) and top_left_only)


def _causal_pairs(T: int, S: int, shift: int) -> int:
    """(query, key) pairs with ``j <= i + shift`` in a ``T×S`` grid, in closed form."""
    a = shift + 1  # query i sees min(S, max(0, i + a)) keys
    i0 = min(T, max(0, -a))  # first query that sees a key
    i1 = max(i0, min(T, S - a))  # first query that sees every key
    n = i1 - i0
    return n * (2 * a + i0 + i1 - 1) // 2 + (T - i1) * S


def predict(call: AttentionCall, backend: str) -> Cost | None:
    """Predicted FLOPs and peak extra memory of ``backend`` on ``call`` (forward only), or
    ``None`` for a backend with no cost model here (one registered from outside qkv:
    ``qkv.explain`` then says "no cost model" for it instead of failing).

    The peak counts what the call allocates beyond its inputs: the output, the log-sum-exp,
    the weights when asked for, and every working tensor alive at the worst moment.
    Calibrated against measured peak RSS (``python -m qkv.bench.memprobe``) within a few percent
    for tens of MiB and more; below a few MiB the allocator's own noise dominates.
    """
    q, v = call.query, call.value
    B, H, T, D = q.shape
    S, Dv = call.S, v.shape[-1]
    BH = B * H
    dtype = q.dtype
    acc = _size(_acc(dtype))
    out = BH * T * Dv * _size(dtype)
    if backend == "math":
        pairs = BH * T * S
        # The softmax's peak: the scores (kept by the caller), the scores minus the row
        # maximum and their exponential, all (B, H, T, S) in the accumulation dtype, beside
        # the dense mask. The weights are the softmax's result, so need_weights adds nothing.
        work = 3 * pairs * acc + _dense_mask_bytes(call, acc)
        if _acc(dtype) != dtype:  # half precision: float32 copies of q, k and v
            work += (BH * T * D + B * call.num_kv_heads * S * (D + Dv)) * acc
        return Cost(pairs * 2 * (D + Dv), out + work)
    if backend == "flash":
        bq, bk = block_sizes(T, S, D, dtype)
        pairs = B * H * _visible_pairs(call, bq, bk)
        bk = min(bk, S)
        # Decoding (flash_decode.py) holds one block's tiles at a time and a small partial
        # result per block. The tile loop frees each score tile (B, H, bq, bk) before making
        # the next, yet its measured peak RSS is two tiles' worth: the allocator does not
        # hand the freed tile's pages straight back (T = 4096: 26.4 MiB measured, 25.3
        # predicted).
        decode = T <= DECODE_ROWS and call.dropout_p == 0.0
        steps = 1 if decode else 2
        tiles = steps * BH * bq * bk * acc
        # ALiBi's bias for one tile is made for every head, (H, bq, bk), before it is added.
        alibi = H * bq * bk * acc if call.alibi is not None else 0
        acc_rows = BH * bq * (Dv + 2) * acc * 2  # running output, max, sum and P·V of a block
        if decode:  # every block's partial (split ones too), then their weighted copies
            acc_rows *= -(-S // max(1, bk)) * MAX_SPLITS + 1
        # Grouped heads: the query tile (B, Hkv, G·bq, D) is a copy, not a view.
        group_q = BH * bq * D * acc if call.groups > 1 else 0
        scaled_q = BH * T * D * acc  # q · scale (upcast for half precision), made once
        # Half precision: the K and V tiles of the step are converted to float32 (in the tile
        # loop, two steps' worth alive while the next tile is made).
        upcast = 0 if _acc(dtype) == dtype else steps * B * call.num_kv_heads * bk * (D + Dv) * acc
        # float64 for float32 inputs, float32 for half precision (see backends/flash.py).
        lse = BH * T * (4 if _acc(dtype) != dtype else 8)
        work = tiles + alibi + acc_rows + group_q + scaled_q + upcast
        if call.need_weights:
            # The weights are rebuilt after the blockwise pass, whose tiles are freed by then.
            work = max(work, _rebuild_bytes(call))
        return Cost(pairs * 2 * (D + Dv), out + lse + work)
    if backend == "torch":
        pairs = BH * T * S
        if call.causal == 0 and not _torch_dense(call):
            # is_causal: the kernel skips the blocks above the diagonal (a dense mask does not).
            pairs = BH * _causal_pairs(T, S, 0)
        # torch's CPU flash kernel: per thread, a (qs, 512) score block, its row max and sum
        # and a (qs, Dv) output block in the accumulation dtype (plus a copy of the score
        # block in half precision); then its output and the float32 log-sum-exp.
        threads = torch.get_num_threads()
        qs, ks = min(_torch_split(T), T), min(512, S)
        block = (qs * ks + 2 * qs + qs * Dv) * acc + (0 if acc == _size(dtype) else qs * ks * 2)
        lse = BH * T * 4
        kernel = out + lse + threads * block
        if not _torch_dense(call):
            return Cost(pairs * 2 * (D + Dv), kernel)
        # A dense mask is made first: its peak is the mask beside a bool of its size (the
        # search for rows with no visible key, freed before the kernel runs), or the ALiBi
        # bias while it is built; then the kernel runs beside the mask.
        itemsize = _torch_mask_itemsize(call)
        dense = _dense_mask_bytes(call, itemsize)
        if call.alibi is not None:
            numel = dense // itemsize
        elif dense == 0 and call.mask is not None:
            numel = call.mask.numel()
        else:
            numel = dense
        peak = max(dense + numel, _alibi_build_bytes(call, itemsize), dense + kernel)
        return Cost(pairs * 2 * (D + Dv), peak)
    return None  # no model of this backend's memory: explain must still work
