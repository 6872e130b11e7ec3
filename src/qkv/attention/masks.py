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
  (:func:`poison_rows`); these live in :mod:`qkv.attention.rows` and are re-exported here;
* float masks and ALiBi biases are added in the accumulation dtype (:func:`accumulation_dtype`:
  float32 for half-precision queries), and a float mask is kept in :func:`mask_dtype`.

Shapes: ``B`` batch, ``H`` query heads, ``T`` queries, ``S`` keys; ``H'``, ``T'``, ``S'`` a
selection of heads, a slice of queries, a slice of keys.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from qkv.attention.dropout import dropout_keep
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
from qkv.attention.rows import (
    EXP_FLOOR,
    dead_rows,
    exp_floored_,
    exp_shifted_,
    poison_rows,
    safe_lse,
    safe_row_max,
    safe_total,
)
from qkv.checks import checked_before, remember_checked, values_unknown


def _causal_bias() -> tuple[type | None, Any]:
    """torch's ``(CausalBias, CausalVariant)`` (torch >= 2.2: causal mask objects, a tensor
    subclass with no usable storage), or Nones. Read from ``sys.modules``: a CausalBias can
    only exist once its module is imported, and importing it here would pull in torch's
    compiler stack (``torch._dynamo``, 1.8 s) on every ``import qkv``."""
    module = sys.modules.get("torch.nn.attention.bias")
    return (getattr(module, "CausalBias", None), getattr(module, "CausalVariant", None))

try:  # a tensor subclass whose values are only meaningful with its own mask
    from torch.masked import MaskedTensor
except ImportError:  # pragma: no cover - older torch
    MaskedTensor = None

if TYPE_CHECKING:
    from qkv.attention.call import AttentionCall

__all__ = [
    "EXP_FLOOR",
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
    "exp_floored_",
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
    CausalBias, _ = _causal_bias()
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
    given = mask
    mask = _broadcast(mask, tuple(full_shape), name)
    if mask.is_floating_point():
        # while tracing the values cannot be read; a mask already checked (a model hands the
        # same one to every layer) is not read again
        if not values_unknown(mask) and not checked_before(given, "float mask"):
            _check_float_values(mask, name)
            remember_checked(given, "float mask")
        if dtype is not None:
            mask = mask.to(mask_dtype(dtype, mask.dtype))
    return mask


def _check_float_values(mask: Tensor, name: str) -> None:
    """NaN or +inf in a float mask is refused (one read of the device; a second, to say
    which, only when one is there)."""
    if not bool((torch.isnan(mask) | torch.isposinf(mask)).any()):
        return
    if torch.isnan(mask).any():
        raise AttentionArgumentError(f"{name} contains NaN; use -inf to hide a key")
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
    CausalBias, CausalVariant = _causal_bias()
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
