"""Attention dropout: which weights a call drops, decided once for every backend.

A call's keep mask ``(B, H, T, S)`` comes from one of two sources, by the device of its
tensors (:func:`counter_based`, the one rule):

* **CPU tensors: torch's own draw** (:func:`dropout_keep` drops a tensor of ones as torch's
  math SDPA drops its weights), so one seed drops the same weights as
  ``torch.nn.functional.scaled_dot_product_attention`` and ``nn.MultiheadAttention``.
* **Other devices (CUDA): a counter-based mask.** Philox4x32-10 (Salmon et al., 2011; the
  generator of torch's and Triton's GPU kernels), keyed by a 62-bit seed drawn from the
  device's generator once a call (:func:`dropout_state`: one random op on the device, no host
  sync; ``torch.manual_seed`` reproduces it), gives four 32-bit words at counter
  ``(j // 8, i, b·H + h, 0)``: eight 16-bit numbers, one for each of the keys ``8·(j // 8)
  .. 8·(j // 8) + 7`` of query ``i`` (key ``j`` takes half ``j % 2`` of word ``(j // 2) % 4``,
  the low half first). Weight ``(b, h, i, j)`` is kept when its number is at least
  ``round(p · 2¹⁶)``: ``p`` is resolved to 2⁻¹⁶, and one Philox evaluation serves eight
  weights, as FlashAttention's dropout serves sixteen with 8-bit numbers. The ``triton``
  backend computes it inside its kernels, forward and backward, so no ``(B, H, T, S)`` tensor
  exists at any length; ``math`` and ``flash`` draw the same mask dense (:func:`philox_keep`,
  torch ops in chunks).

So on each device one seed drops the same weights on every qkv backend (on CUDA, torch's own
fused kernels draw theirs inside and differently, as they differ from torch's math kernel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from qkv.attention.errors import AttentionArgumentError
from qkv.checks import memory_bytes

if TYPE_CHECKING:
    from qkv.attention.call import AttentionCall

__all__ = ["counter_based", "draw_keep", "dropout_keep", "dropout_state", "philox4x32",
           "philox_keep"]

_WORD = 0xFFFFFFFF
_ROUND = (0xD2511F53, 0xCD9E8D57)  # Philox4x32's multipliers
_BUMP = (0x9E3779B9, 0xBB67AE85)  # its key schedule (the golden ratio, sqrt(3) - 1)
_CHUNK = 1 << 21  # entries a dense draw computes at once (about 10 int64 temporaries each)


def counter_based(device: torch.device) -> bool:
    """Whether calls on ``device`` take the counter-based (Philox) mask: all but the CPU."""
    return device.type != "cpu"


def dropout_state(p: float, device: torch.device) -> Tensor:
    """``(2,)`` int64 on ``device``: a fresh 62-bit Philox seed, drawn from the device's
    generator, and the threshold ``round(p · 2¹⁶)`` a weight's 16 random bits must reach to
    be kept. What the ``triton`` kernels read, and :func:`philox_keep` expands."""
    state = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)
    state[1] = round(p * 2**16)  # (ops a torch.compile graph holds: no random_(from, to))
    return state


def _mul_wide(a: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)`` 32-bit words of the 64-bit product ``a · x`` (``a``, ``x`` < 2³²; ``x``
    int64), computed in halves so no int64 overflows."""
    low, high = a * (x & 0xFFFF), a * (x >> 16)  # each < 2^48
    return (high + (low >> 16)) >> 16, (((high & 0xFFFF) << 16) + low) & _WORD


def philox4x32(key: tuple[Tensor, Tensor], counter: tuple[Tensor, ...],
               rounds: int = 10) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-``rounds`` of 32-bit words held in int64 tensors (broadcasting): ``key``
    ``(k0, k1)``, ``counter`` ``(c0, c1, c2, c3)``; the four output words. Random123's
    known-answer vectors hold it (``tests/attention/test_dropout.py``)."""
    k0, k1 = key
    c0, c1, c2, c3 = counter
    for _ in range(rounds):
        hi_b, lo_b = _mul_wide(_ROUND[1], c2)
        hi_a, lo_a = _mul_wide(_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _BUMP[0]) & _WORD, (k1 + _BUMP[1]) & _WORD
    return c0, c1, c2, c3


def philox_keep(state: Tensor, B: int, H: int, T: int, S: int) -> Tensor:
    """The counter-based keep mask ``(B, H, T, S)`` bool of ``state`` (:func:`dropout_state`),
    on its device, computed ``2²¹`` entries at a time (the triton kernels compute the same
    bits per tile)."""
    seed, below = state[0], state[1]
    key = (seed & _WORD, seed >> 32)
    keep = torch.empty(B * H * T, S, dtype=torch.bool, device=state.device)
    groups = -(-S // 8)  # counters along the keys, eight keys each
    c = torch.arange(groups, device=state.device)[None, :]  # (1, S/8)
    step = max(1, _CHUNK // (8 * groups))
    zero = torch.zeros((), dtype=torch.int64, device=state.device)
    for start in range(0, B * H * T, step):
        row = torch.arange(start, min(start + step, B * H * T), device=state.device)[:, None]
        words = philox4x32(key, (c, row % T, row // T, zero))  # 4 × (rows, S/8)
        halves = [h for w in words for h in (w & 0xFFFF, w >> 16)]  # key 8c + k: halves[k]
        bits = torch.stack(halves, -1).reshape(len(row), 8 * groups)[:, :S]  # (rows, S)
        keep[start:start + step] = bits >= below
    return keep.view(B, H, T, S)


def dropout_keep(call: AttentionCall) -> Tensor:
    """The keep mask ``(B, H, T, S)`` bool of ``call``: :func:`draw_keep` for its query."""
    q = call.query
    return draw_keep(*q.shape[:3], call.S, call.dropout_p, q)


def draw_keep(B: int, H: int, T: int, S: int, p: float, query: Tensor) -> Tensor:
    """The keep mask ``(B, H, T, S)`` bool of dropout ``p`` on the weights of ``query``'s
    attention (its device and dtype), from the source the module docstring names.

    On the CPU, torch's draw: torch's math SDPA applies ``at::dropout`` to the ``(B, H, T, S)``
    weights in the query dtype; dropping a tensor of ones of that shape and dtype consumes the
    generator the same way, so the same seed drops the same positions as torch, whatever
    dtype a backend computes the weights in. Elsewhere :func:`philox_keep` of a fresh
    :func:`dropout_state`.

    Raises:
        AttentionArgumentError: the mask would not fit in memory (before it is drawn).
    """
    _check_keep_fits(B, H, T, S, p, query)
    if counter_based(query.device):
        return philox_keep(dropout_state(p, query.device), B, H, T, S)
    ones = torch.ones(B, H, T, S, dtype=query.dtype, device=query.device)
    return torch.dropout(ones, p, True) != 0  # (B, H, T, S)


def _check_keep_fits(B: int, H: int, T: int, S: int, p: float, q: Tensor) -> None:
    """Refuse, before drawing it, a keep mask that would not fit. torch's draw holds the
    ones, their dropped copy and the bool result, ``B·H·T·S · (2·itemsize + 1)`` bytes, which
    at long sequences is more than the attention's own memory by far (T = S = 16384, B = 4,
    H = 16, bfloat16: 80 GiB); the counter-based draw holds the result and one chunk's
    temporaries. The limit is half the machine's memory on the CPU (as for a capture's
    weights), the device's free memory on a GPU."""
    count = B * H * T * S
    counter = counter_based(q.device)
    need = count + 12 * 8 * _CHUNK if counter else count * (2 * q.element_size() + 1)
    if need < 1 << 30:
        return
    if q.device.type == "cuda":
        limit, where = torch.cuda.mem_get_info(q.device)[0], "free on this GPU"
    else:
        limit, where = _memory_bytes() // 2, "half this machine's memory"
    if limit and need > limit:
        kind = "the counter-based keep mask" if counter else "torch's keep mask"
        other = ("backend='triton' (it draws the same mask inside its kernels) or 'torch', "
                 if counter else "")
        raise AttentionArgumentError(
            f"dropout_p={p} draws {kind} of (B, H, T, S) = "
            f"({B}, {H}, {T}, {S}), {need / 2**30:.1f} GiB while it is drawn, more than "
            f"the {limit / 2**30:.1f} GiB {where}: use {other}dropout_p=0, or shorter "
            "sequences or fewer rows a call")


_memory_bytes = memory_bytes  # (one name here, so a test can stand in a smaller machine)
