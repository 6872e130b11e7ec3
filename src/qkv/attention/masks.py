"""Attention masks: what a mask means, defined once, plus the builders users call.

Polarity, once and for all:

* **keep** (SDPA, ``qkv.scaled_dot_product_attention``): a boolean mask where True means the
  query *may attend* to the key. Every builder returns keep masks.
* **drop** (``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``): True
  means the key is *ignored*. Convert with :func:`from_mha` and :func:`to_mha`.
* **float** masks have no polarity: they are added to the scores, ``-inf`` hides a key.

This module has two halves. The builders and the linter (``causal``, ``sliding_window``,
``padding``, ``combine``, ``check``, ...; see :mod:`qkv.attention.mask_builders` and
:mod:`qkv.attention.mask_lint`) are for users. The rest defines the mask parts of a validated
:class:`~qkv.attention.call.AttentionCall` (a dense user mask, a causal diagonal, a sliding
window, ALiBi slopes) for every backend and for :mod:`qkv.attention.weights`:

* :func:`check_attn_mask` is the one validation of a user mask (run by ``make_call``);
* :func:`structure_keep`, :func:`alibi_bias` and :func:`mask_tile` give each part for any
  tile of queries × keys, :func:`apply_mask` applies them all to a score tile and
  :func:`dense_mask` materialises them as one ``(B|1, H|1, T, S)`` tensor;
* rows with no visible key ("dead rows") give zero weights and zero output on every backend:
  :func:`dead_rows`, :func:`safe_row_max`, :func:`safe_total` and :func:`safe_lse` are that
  rule, written once; a non-finite query row is NaN on every backend, dead or not
  (:func:`poison_rows`);
* float masks and ALiBi biases are added in the accumulation dtype (:func:`accumulation_dtype`:
  float32 for half-precision queries), and a float mask is kept in :func:`mask_dtype`.

Shapes: ``B`` batch, ``H`` query heads, ``T`` queries, ``S`` keys; ``H'``, ``T'``, ``S'`` a
selection of heads, a slice of queries, a slice of keys.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.mask_builders import (
    causal,
    combine,
    from_mha,
    padding,
    padding_from_ids,
    sliding_window,
    to_additive,
    to_mha,
)
from qkv.attention.mask_lint import MaskReport, check
from qkv.checks import values_unknown

try:  # torch >= 2.2: causal mask objects (a tensor subclass with no usable storage)
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:  # pragma: no cover - older torch
    CausalBias = CausalVariant = None

try:  # a tensor subclass whose values are only meaningful with its own mask
    from torch.masked import MaskedTensor
except ImportError:  # pragma: no cover - older torch
    MaskedTensor = None

if TYPE_CHECKING:
    from qkv.attention.call import AttentionCall

__all__ = [
    "MaskReport",
    "accumulation_dtype",
    "alibi_bias",
    "apply_mask",
    "causal",
    "causal_shift",
    "check",
    "check_attn_mask",
    "combine",
    "dead_rows",
    "dense_mask",
    "dropout_keep",
    "exp_shifted_",
    "from_mha",
    "mask_dtype",
    "mask_tile",
    "padding",
    "padding_from_ids",
    "poison_rows",
    "safe_lse",
    "safe_row_max",
    "safe_total",
    "sliding_window",
    "split_causal_bias",
    "structure_keep",
    "to_additive",
    "to_mha",
]

Rows = slice | None


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


# --- validation: once, at the public boundary ---------------------------------------------


def check_attn_mask(
    mask: object,
    full_shape: tuple[int, ...],
    *,
    name: str = "attn_mask",
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Validate a user mask for scores of shape ``full_shape = (*batch, H, T, S)``.

    Checks the type (a strided tensor; nested, sparse and masked tensors are refused), the dtype
    (bool keep mask or float additive mask), the device, that the shape broadcasts to
    ``full_shape`` without enlarging it, and that a float mask holds no NaN or ``+inf`` (a
    host sync: call this once per forward, not per layer of a kernel). A
    :class:`torch.nn.attention.bias.CausalBias` is materialised as its ``(T, S)`` keep mask.

    ``dtype`` is the query's dtype. Scores are accumulated in float32 for half-precision
    queries, so a float mask is cast to :func:`mask_dtype` of it: the query's dtype, except
    that a half-precision query keeps a float32 (or wider) mask in float32 rather than
    rounding it to 8 or 11 bits.

    Returns:
        The mask as 4-D ``(B|1, H|1, T|1, S|1)`` with ``B = prod(batch)`` (a view when the
        leading dimensions are all 1); float masks cast as above when ``dtype`` is given.

    Raises:
        AttentionTypeError: not a tensor, an unusual tensor, neither bool nor float.
        AttentionArgumentError: wrong device, shape that does not broadcast, NaN or +inf.
    """
    if not isinstance(mask, Tensor):
        raise AttentionTypeError(f"{name} must be a torch.Tensor or None, got {type(mask)}")
    if CausalBias is not None and isinstance(mask, CausalBias):
        mask = mask._materialize(mask.device)  # (T, S) bool: the object has no real storage
    if MaskedTensor is not None and isinstance(mask, MaskedTensor):
        raise AttentionTypeError(
            f"{name} is a torch.masked.MaskedTensor; pass a plain tensor: its keep mask "
            "(mask.get_mask()) or an additive float mask"
        )
    if mask.is_nested or mask.layout != torch.strided:
        kind = "a nested tensor" if mask.is_nested else f"a tensor with layout {mask.layout}"
        raise AttentionTypeError(
            f"{name} must be a dense (strided) tensor, got {kind}; convert it with "
            ".to_dense() or build one mask per sequence"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise AttentionTypeError(
            f"{name} must be boolean (True = may attend) or floating point (added to the "
            f"scores), got dtype {mask.dtype}"
        )
    if device is not None and mask.device != device:
        raise AttentionArgumentError(f"{name} is on {mask.device} but query is on {device}")
    mask = _broadcast(mask, tuple(full_shape), name)
    if mask.is_floating_point():
        if not values_unknown(mask):  # while tracing the values cannot be read
            _check_float_values(mask, name)
        if dtype is not None:
            mask = mask.to(mask_dtype(dtype, mask.dtype))
    return mask


def _check_float_values(mask: Tensor, name: str) -> None:
    if torch.isnan(mask).any():
        raise AttentionArgumentError(f"{name} contains NaN; use -inf to hide a key")
    if torch.isposinf(mask).any():
        raise AttentionArgumentError(
            f"{name} contains +inf, which makes the softmax NaN; use large finite "
            "values to favour a key"
        )


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, softmax and sums are computed in: float32 for float16/bfloat16
    inputs (whose 8 or 11 bits and, for float16, range up to 65504 cannot hold large logits
    or their exponentials), the input's own dtype otherwise. Every backend uses it."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def mask_dtype(query_dtype: torch.dtype, given: torch.dtype) -> torch.dtype:
    """Dtype a float mask of dtype ``given`` is kept in for a query of ``query_dtype``.

    The query's dtype, except for half-precision queries: a mask already in that dtype stays
    (nothing to gain), any other float mask becomes float32, the accumulation dtype.
    """
    acc = accumulation_dtype(query_dtype)
    return query_dtype if acc == query_dtype or given == query_dtype else acc


def _broadcast(mask: Tensor, full: tuple[int, ...], name: str) -> Tensor:
    """``mask`` viewed as 4-D ``(B|1, H|1, T|1, S|1)`` for scores of shape ``full``."""
    expected = "(" + ", ".join(str(s) for s in full) + ")"
    if mask.dim() > len(full):
        raise AttentionArgumentError(
            f"{name} has shape {_shape(mask)} with {mask.dim()} dimensions, more than the "
            f"attention scores {expected} it must broadcast to"
        )
    # Compared from the right, as broadcasting does (torch.broadcast_shapes costs ~70 µs).
    pairs = list(zip(reversed(mask.shape), reversed(full), strict=False))
    if any(m != f and m != 1 and f != 1 for m, f in pairs):
        raise AttentionArgumentError(
            f"{name} of shape {_shape(mask)} does not broadcast to the attention scores "
            f"(..., H, T, S) = {expected}"
        )
    if any(m != f and m != 1 for m, f in pairs):
        raise AttentionArgumentError(
            f"{name} of shape {_shape(mask)} would enlarge the attention scores {expected}"
        )
    m = mask.reshape((1,) * (len(full) - mask.dim()) + tuple(mask.shape))  # (*batch, H|1, T|1, S|1)
    lead, tail = m.shape[:-3], m.shape[-3:]
    if all(s == 1 for s in lead):
        return m.reshape(1, *tail)  # (1, H|1, T|1, S|1)
    m = m.expand(*full[:-3], *tail)
    return m.reshape(math.prod(full[:-3]), *tail)  # (B, H|1, T|1, S|1)


def causal_shift(is_causal: bool | str | None, T: int, S: int) -> int | None:
    """The causal diagonal shift ``c`` (query ``i`` sees keys ``j <= i + c``), or None.

    ``True``/``"top-left"`` give 0 (torch's ``is_causal``), ``"bottom-right"`` gives ``S - T``.
    """
    if is_causal is False or is_causal is None:
        return None
    if is_causal is True or is_causal == "top-left":
        return 0
    if is_causal == "bottom-right":
        return S - T
    raise AttentionArgumentError(
        f"is_causal must be a bool, 'top-left' or 'bottom-right', got {is_causal!r}"
    )


def split_causal_bias(
    attn_mask: object, is_causal: bool | str, T: int, S: int
) -> tuple[object, bool | str]:
    """Turn a :class:`torch.nn.attention.bias.CausalBias` ``attn_mask`` into ``is_causal``.

    ``causal_upper_left(T, S)`` becomes ``is_causal=True`` and ``causal_lower_right(T, S)``
    ``"bottom-right"``, so the backends see a structure (skipped tiles) rather than a tensor.
    Any other ``attn_mask`` is returned unchanged.

    Raises:
        AttentionArgumentError: combined with ``is_causal`` (torch refuses this too), or built
            for other lengths than the call's ``(T, S)``.
    """
    if CausalBias is None or not isinstance(attn_mask, CausalBias):
        return attn_mask, is_causal
    if is_causal is not False and is_causal is not None:
        raise AttentionArgumentError(
            "attn_mask is a torch.nn.attention.bias.CausalBias, already a causal mask; do "
            "not also pass is_causal (torch refuses this combination too)"
        )
    T_b, S_b = attn_mask.seq_len_q, attn_mask.seq_len_kv
    if (T_b, S_b) != (T, S):
        raise AttentionArgumentError(
            f"attn_mask is a CausalBias built for (T, S) = ({T_b}, {S_b}) but the call has "
            f"T={T} queries and S={S} keys"
        )
    lower_right = attn_mask.variant == CausalVariant.LOWER_RIGHT
    return None, ("bottom-right" if lower_right else True)


# --- the mask parts of a call, for any tile ------------------------------------------------


def _range(n: int, part: Rows) -> range:
    return range(n)[part or slice(None)]


def structure_keep(call: AttentionCall, rows: Rows = None, cols: Rows = None) -> Tensor | None:
    """Keep mask ``(T', S')`` of the causal diagonal and sliding window for a tile, or None.

    Query ``i`` sees key ``j`` iff ``j <= i + c`` and (with a window ``w``) ``j > i + c - w``,
    ``c`` the call's causal shift.
    """
    if call.causal is None:
        return None
    r, c = _range(call.T, rows), _range(call.S, cols)
    device = call.query.device
    i = torch.arange(r.start, r.stop, device=device)[:, None]  # (T', 1)
    j = torch.arange(c.start, c.stop, device=device)[None, :]  # (1, S')
    keep = j <= i + call.causal  # (T', S')
    if call.window is not None:
        keep &= j > i + call.causal - call.window
    return keep


def alibi_bias(
    call: AttentionCall,
    rows: Rows = None,
    cols: Rows = None,
    heads: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor | None:
    """ALiBi bias ``(H', T', S')`` in ``dtype`` for a tile, or None without ALiBi.

    ``bias[h, i, j] = -slope_h · |i + a - j|``, ``a`` the call's :attr:`alibi_shift`
    (Press et al., 2022). ``heads`` (a long tensor) selects query heads.
    """
    if call.alibi is None:
        return None
    r, c = _range(call.T, rows), _range(call.S, cols)
    device = call.query.device
    i = torch.arange(r.start, r.stop, device=device, dtype=dtype)[:, None]  # (T', 1)
    j = torch.arange(c.start, c.stop, device=device, dtype=dtype)[None, :]  # (1, S')
    slopes = call.alibi if heads is None else call.alibi[heads]
    distance = (i + call.alibi_shift - j).abs()  # (T', S')
    return -slopes.to(dtype)[:, None, None] * distance  # (H', T', S')


def mask_tile(
    call: AttentionCall, rows: Rows = None, cols: Rows = None, heads: Tensor | None = None
) -> Tensor | None:
    """The user mask sliced to a tile: ``(B|1, H'|1, T'|1, S'|1)``, or None.

    Broadcast (size-1) dimensions are left alone, so no copy is made.
    """
    m = call.mask
    if m is None:
        return None
    if heads is not None and m.shape[1] > 1:
        m = m[:, heads]
    if rows is not None and m.shape[2] > 1:
        m = m[:, :, rows]
    if cols is not None and m.shape[3] > 1:
        m = m[..., cols]
    return m


def apply_mask(
    scores: Tensor,
    call: AttentionCall,
    rows: Rows = None,
    cols: Rows = None,
    heads: Tensor | None = None,
    *,
    structure: bool = True,
    inplace: bool = False,
) -> Tensor:
    """Apply every mask part of ``call`` to a score tile ``(B, H', T', S')``.

    In order: the causal diagonal and window (hidden keys get ``-inf``; skipped when
    ``structure`` is False, for a tile a plan knows lies wholly inside them), ALiBi (added)
    and the user mask (a bool keep mask hides, a float mask is added). Additions happen in
    the scores' dtype. ``inplace`` overwrites ``scores`` (for tiles outside autograd).
    """
    s = scores
    keep = structure_keep(call, rows, cols) if structure else None
    if keep is not None:
        s = s.masked_fill_(~keep, float("-inf")) if inplace else s.masked_fill(~keep, float("-inf"))
    bias = alibi_bias(call, rows, cols, heads, dtype=s.dtype)
    if bias is not None:
        s = s.add_(bias) if inplace else s + bias
    m = mask_tile(call, rows, cols, heads)
    if m is not None:
        if m.dtype == torch.bool:
            s = s.masked_fill_(~m, float("-inf")) if inplace else s.masked_fill(~m, float("-inf"))
        else:
            s = s.add_(m.to(s.dtype)) if inplace else s + m.to(s.dtype)
    return s


def dense_mask(call: AttentionCall, dtype: torch.dtype | None = None) -> Tensor | None:
    """Every mask part of ``call`` as one ``(B|1, H|1, T, S)`` tensor (bool keep or float).

    Bool when only boolean parts exist, else float (``-inf`` hides) in ``dtype``: by default
    the accumulation dtype (float32 for half-precision queries, so ALiBi distances are not
    rounded to 8 bits). O(T·S) memory: the structure-aware backends apply the parts per tile
    instead.
    """
    dtype = dtype or accumulation_dtype(call.query.dtype)
    keep = structure_keep(call)
    bias = alibi_bias(call, dtype=dtype)
    mask = call.mask
    if mask is not None and mask.is_floating_point() and mask.dtype != dtype:
        mask = mask.to(dtype)
    if keep is not None:
        if mask is None:
            mask = keep[None, None]  # (1, 1, T, S)
        elif mask.dtype == torch.bool:
            mask = mask & keep  # (B|1, H|1, T, S)
        else:
            mask = torch.where(keep, mask, float("-inf"))  # (B|1, H|1, T, S)
    if bias is not None:
        bias = bias[None]  # (1, H, T, S)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = mask + bias
    return mask


# --- dead rows: no visible key gives zero weights, zero output, zero gradient ---------------


def dead_rows(mask: Tensor) -> Tensor:
    """Rows of a dense mask ``(..., T|1, S)`` with no visible key: ``(..., T|1, 1)`` bool."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def safe_row_max(row_max: Tensor) -> Tensor:
    """Row maxima with the dead rows' ``-inf`` replaced by 0: ``exp(s - max)`` is then an
    exact 0 on a dead row instead of ``exp(-inf + inf) = NaN``."""
    return row_max.masked_fill(torch.isneginf(row_max), 0.0)


# exp(x) for x below about -87 (float32) gives a subnormal result, which torch's vectorised
# CPU exp takes ~90x longer to make than a normal one, and exp(-inf) ~9x longer; a weight
# near the subnormal range makes the P·V matmul ~60x slower too (measured on AVX-512).
EXP_FLOOR = {torch.float32: -80.0, torch.float64: -700.0}


def exp_shifted_(scores: Tensor, row_max: Tensor) -> Tensor:
    """``exp(scores - row_max)`` in place over ``scores (..., S')``, ``row_max (..., 1)``,
    with weights below ``exp(EXP_FLOOR)`` (1.8e-35 in float32, 1e-304 in float64) set to
    exactly 0, as a flush-to-zero unit would.

    The differences are raised to the floor before the exp and the results at the floor
    zeroed after it, so every exp and every weight stays in the fast, normal range: ALiBi at
    T = 2048 went from 4.5 ms of exp and 5.5 ms of P·V a tile to 0.2 and 1.0. A masked key
    (``-inf``) gets weight 0 exactly, a row that sees no key (``row_max = -inf``) all zeros,
    and NaN stays NaN. Against the exact softmax a row loses at most ``S' · 1.8e-35`` of its
    weight (float32), far below the dtype's precision.
    """
    x = scores.sub_(safe_row_max(row_max))
    floor = EXP_FLOOR.get(scores.dtype)
    if floor is None:
        return x.exp_()
    p = x.clamp_min_(floor).exp_()
    return torch.nn.functional.threshold_(p, math.exp(floor) * 1.5, 0.0)


def safe_total(total: Tensor) -> Tensor:
    """Softmax denominators with a dead row's 0 replaced by 1 (its numerators are all 0)."""
    return total.masked_fill(total == 0, 1.0)


def dropout_keep(call: AttentionCall) -> Tensor:
    """torch's dropout keep mask ``(B, H, T, S)`` bool for ``call``, drawn as torch draws it.

    torch's math SDPA applies ``at::dropout`` to the ``(B, H, T, S)`` weights in the query
    dtype; dropping a tensor of ones of that shape and dtype consumes the generator the same
    way, so the same seed drops the same positions on the math and flash backends, whatever
    dtype they compute the weights in.
    """
    B, H, T = call.query.shape[:3]
    ones = torch.ones(B, H, T, call.S, dtype=call.query.dtype, device=call.query.device)
    return torch.dropout(ones, call.dropout_p, True) != 0  # (B, H, T, S)


# --- non-finite inputs: never hidden ------------------------------------------------------


def poison_rows(t: Tensor, query: Tensor) -> Tensor:
    """``t (B, H, T, X)`` with NaN in every row whose query row ``(B, H, T, D)`` holds NaN or
    ``±inf``; every other row unchanged (``+0`` is added to it).

    The rule for non-finite queries on every backend, even on a row that sees no key (a
    mask, or an infinite query whose scores are all ``-inf``, skips its scores: the softmax
    alone would give it zeros). It is ``t + 0 · max_d |q_d|``: two tensor ops over ``q`` and
    ``t``, no host sync, no gradient through the query (the gradient of ``t`` passes
    unchanged).
    """
    if _all_finite_on_cpu(query):
        return t  # the usual case, found with one summing pass over q
    # max |q_d| (NaN propagates through amax); abs().amax() is ~20x faster than
    # linalg.vector_norm(ord=inf) on a (B, H, T, D) view on the CPU.
    worst = query.detach().abs().amax(dim=-1, keepdim=True)  # (B, H, T, 1)
    return torch.add(t, worst.to(t.dtype), alpha=0)  # 0·(NaN or inf) is NaN, 0·x is 0


def _all_finite_on_cpu(query: Tensor) -> bool:
    """Whether every entry of a CPU ``query`` is finite, read with one sum (inf or NaN in q
    makes the sum non-finite; a finite q whose sum overflows only sends it the long way).

    On the CPU reading a value costs no device sync, and the sum is one pass over q, where
    the poisoning is three (measured: 5 ms of a 135 ms call at T = 4096, fp32). Never while
    tracing, on other devices or under ``torch.func`` transforms, where the value is not
    readable or would cost a sync.
    """
    if query.device.type != "cpu" or values_unknown(query):
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(query):
        return False
    return math.isfinite(query.detach().sum().item())


def safe_lse(lse: Tensor) -> Tensor:
    """Log-sum-exp with a dead row's ``-inf`` replaced by ``+inf``: ``exp(s - lse) = 0`` for
    every key of the row, so weights rebuilt from it (and their gradients) are zeros."""
    return lse.masked_fill(torch.isneginf(lse), float("inf"))
