"""Validate the arguments of scaled dot-product attention and normalise them into one record.

Every backend receives an :class:`AttentionCall`, never raw user arguments, so the checks and
the broadcasting rules live here once. Shapes follow the package glossary: ``B`` batch (all
leading dimensions flattened into one), ``H`` query heads, ``Hkv`` key/value heads, ``T``
queries, ``S`` keys, ``D`` head width of queries and keys, ``Dv`` head width of values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AttentionCall", "make_call"]


@dataclass(frozen=True)
class AttentionCall:
    """One attention call after validation; what every backend consumes.

    The mask is kept in parts so a backend can exploit their structure (skip blocks above the
    causal diagonal, compute ALiBi per block) or materialise them with :func:`dense_mask`.

    Attributes:
        query: ``(B, H, T, D)``.
        key: ``(B, Hkv, S, D)``.
        value: ``(B, Hkv, S, Dv)``.
        mask: ``None``, a boolean *keep* mask (True = may attend) or a float mask added to the
            scores; always 4-D, broadcastable to ``(B, H, T, S)``.
        causal: ``None`` or the causal diagonal shift ``c``: query ``i`` sees keys
            ``j <= i + c`` (0 is torch's top-left alignment, ``S - T`` bottom-right).
        window: ``None`` or a sliding window ``w`` (with ``causal``): query ``i`` also hides
            keys ``j <= i + c - w``.
        alibi: ``None`` or per-head ALiBi slopes ``(H,)`` (float32): the scores get
            ``-slope_h · |i + a - j|`` added, ``a`` the causal shift, else ``S - T``.
        scale: the factor applied to ``q·k`` (``1/sqrt(D)`` unless given).
        dropout_p: dropout on the attention weights (0 in evaluation).
        need_weights: whether the caller wants ``(B, H, T, S)`` weights back.
        batch_shape: the original leading dimensions, restored on the way out.
        squeeze_heads: the inputs had no head dimension (2-D ``(T, D)`` tensors).
    """

    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    causal: int | None
    window: int | None
    alibi: Tensor | None
    scale: float
    dropout_p: float
    need_weights: bool
    batch_shape: tuple[int, ...]
    squeeze_heads: bool = False

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def T(self) -> int:
        return self.query.shape[2]

    @property
    def S(self) -> int:
        return self.key.shape[2]

    @property
    def alibi_shift(self) -> int:
        """Key position of query 0 for ALiBi distances."""
        return self.causal if self.causal is not None else self.S - self.T

    @property
    def plain(self) -> bool:
        """No mask of any kind: every query sees every key."""
        return self.mask is None and self.causal is None and self.alibi is None


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
            f"got dtype {t.dtype}"
        )
    if t.dim() < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., T, D), got shape {_shape(t)}"
        )
    return t


def _check_inputs(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t)
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(
            "query, key and value must have the same number of dimensions, got "
            f"query {_shape(query)}, key {_shape(key)}, value {_shape(value)}"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "query, key and value must share one dtype, got "
            f"query {query.dtype}, key {key.dtype}, value {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            "query, key and value must be on one device, got "
            f"query on {query.device}, key on {key.device}, value on {value.device}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same head width D (last dimension), got query "
            f"{_shape(query)} with D={query.shape[-1]} and key {_shape(key)} with "
            f"D={key.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length S (dimension -2), got key {_shape(key)} "
            f"with S={key.shape[-2]} and value {_shape(value)} with S={value.shape[-2]}"
        )
    if query.dim() >= 3:
        h, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
        if hk != hv:
            raise ValueError(
                f"key and value must have the same number of heads Hkv (dimension -3), got "
                f"key {_shape(key)} with {hk} and value {_shape(value)} with {hv}"
            )
        if h != hk:
            if not enable_gqa:
                raise ValueError(
                    f"query has H={h} heads but key/value have Hkv={hk} (dimension -3); pass "
                    "enable_gqa=True for grouped-query attention, or give them equal heads"
                )
            if hk == 0 or h % hk != 0:
                raise ValueError(
                    f"grouped-query attention needs H (query heads, {h}) to be a multiple of "
                    f"Hkv (key/value heads, {hk}); got query {_shape(query)}, key {_shape(key)}"
                )
        lead = (query.shape[:-3], key.shape[:-3], value.shape[:-3])
        if not (lead[0] == lead[1] == lead[2]):
            raise ValueError(
                "query, key and value must have the same leading (batch) dimensions, got "
                f"query {_shape(query)}, key {_shape(key)}, value {_shape(value)}"
            )
    elif query.shape[:-2] != key.shape[:-2]:  # pragma: no cover - 2-D inputs have no lead
        raise ValueError("query and key leading dimensions differ")


def _broadcast_mask(mask: Tensor, full: tuple[int, ...], name: str) -> Tensor:
    """Return ``mask`` viewed as 4-D ``(B|1, H|1, T, S)`` for a call of shape ``full``.

    ``full`` is ``(*batch, H, T, S)``. Leading dimensions of the mask that are all 1 stay 1
    (no copy); otherwise they are expanded and flattened into the single batch dimension.
    """
    expected = "(" + ", ".join(str(s) for s in full) + ")"
    if mask.dim() > len(full):
        raise ValueError(
            f"{name} has shape {_shape(mask)} with {mask.dim()} dimensions, more than the "
            f"attention scores {expected} it must broadcast to"
        )
    # Compared from the right, as broadcasting does (torch.broadcast_shapes costs ~70 µs).
    pairs = list(zip(reversed(mask.shape), reversed(full), strict=False))
    if any(m != f and m != 1 and f != 1 for m, f in pairs):
        raise ValueError(
            f"{name} of shape {_shape(mask)} does not broadcast to the attention scores "
            f"(..., H, T, S) = {expected}"
        )
    if any(m != f and m != 1 for m, f in pairs):
        raise ValueError(
            f"{name} of shape {_shape(mask)} would enlarge the attention scores {expected}"
        )
    m = mask.reshape((1,) * (len(full) - mask.dim()) + tuple(mask.shape))  # (*batch, H|1, T|1, S|1)
    lead, tail = m.shape[:-3], m.shape[-3:]
    if all(s == 1 for s in lead):
        return m.reshape(1, *tail)  # (1, H|1, T|1, S|1)
    m = m.expand(*full[:-3], *tail)
    return m.reshape(math.prod(full[:-3]), *tail)  # (B, H|1, T|1, S|1)


def dead_rows(mask: Tensor) -> Tensor:
    """Rows of a 4-D mask with no visible key: ``(B|1, H|1, T|1, 1)`` bool."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def structure_keep(
    call: AttentionCall, rows: slice | None = None, cols: slice | None = None
) -> Tensor | None:
    """Keep mask ``(T', S')`` of the causal diagonal and window for a block, or None."""
    if call.causal is None:
        return None
    r = range(call.T)[rows or slice(None)]
    c = range(call.S)[cols or slice(None)]
    device = call.query.device
    i = torch.arange(r.start, r.stop, device=device)[:, None]  # (T', 1)
    j = torch.arange(c.start, c.stop, device=device)[None, :]  # (1, S')
    keep = j <= i + call.causal  # (T', S')
    if call.window is not None:
        keep &= j > i + call.causal - call.window
    return keep


def alibi_block(
    call: AttentionCall, rows: slice | None = None, cols: slice | None = None
) -> Tensor | None:
    """ALiBi bias ``(H, T', S')`` in float32 for a block of queries and keys, or None."""
    if call.alibi is None:
        return None
    r = range(call.T)[rows or slice(None)]
    c = range(call.S)[cols or slice(None)]
    device = call.query.device
    i = torch.arange(r.start, r.stop, device=device, dtype=torch.float32)[:, None]  # (T', 1)
    j = torch.arange(c.start, c.stop, device=device, dtype=torch.float32)[None, :]  # (1, S')
    distance = (i + call.alibi_shift - j).abs()  # (T', S')
    return -call.alibi[:, None, None] * distance  # (H, T', S')


def dense_mask(call: AttentionCall) -> Tensor | None:
    """Every mask part of ``call`` as one ``(B|1, H|1, T, S)`` tensor (bool keep or float).

    Bool when only boolean parts exist, else float in the query's dtype. O(T·S) memory: the
    structure-aware backends avoid calling it.
    """
    keep = structure_keep(call)
    bias = alibi_block(call)
    mask = call.mask
    if keep is not None:
        mask = keep[None, None] if mask is None else _and(mask, keep)
    if bias is not None:
        bias = bias.to(call.query.dtype)[None]  # (1, H, T, S)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = mask + bias
    return mask


def _and(mask: Tensor, keep: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return mask & keep  # (B|1, H|1, T, S)
    return torch.where(keep, mask, float("-inf"))  # (B|1, H|1, T, S)


def _causal_shift(is_causal: bool | str, T: int, S: int) -> int | None:
    if is_causal is False or is_causal is None:
        return None
    if is_causal is True or is_causal == "top-left":
        return 0
    if is_causal == "bottom-right":
        return S - T
    raise ValueError(
        f"is_causal must be a bool, 'top-left' or 'bottom-right', got {is_causal!r}"
    )


def _check_alibi(alibi_slopes: object, H: int, query: Tensor) -> Tensor | None:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, Tensor) or not alibi_slopes.is_floating_point():
        raise TypeError(f"alibi_slopes must be a float tensor of shape (H,) = ({H},)")
    if tuple(alibi_slopes.shape) != (H,):
        raise ValueError(
            f"alibi_slopes must have shape (H,) = ({H},), got {_shape(alibi_slopes)}"
        )
    return alibi_slopes.detach().to(device=query.device, dtype=torch.float32)


def make_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool | str,
    scale: float | None,
    enable_gqa: bool,
    need_weights: bool,
    window: int | None = None,
    alibi_slopes: Tensor | None = None,
) -> AttentionCall:
    """Check every argument and build the :class:`AttentionCall` (see ``sdpa`` for rules).

    Raises:
        TypeError: non-tensor or non-float inputs, mixed dtypes, integer masks.
        ValueError: wrong ranks or widths, length or head mismatches, masks that do not
            broadcast or contain NaN or +inf, bad ``dropout_p``, ``scale``, ``is_causal``,
            ``window`` or ``alibi_slopes``.
    """
    _check_inputs(query, key, value, enable_gqa)
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if scale is not None and (
        not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")

    # 1) Bring every input to (B, H, T, D): one head dimension, one flattened batch dimension.
    squeeze_heads = query.dim() == 2
    if squeeze_heads:
        query, key, value = query[None], key[None], value[None]  # (1, T, D)
    batch_shape = tuple(query.shape[:-3])
    H, T, D = query.shape[-3:]
    Hkv, S = key.shape[-3], key.shape[-2]
    B = math.prod(batch_shape)
    q = query.reshape(B, H, T, D)  # (B, H, T, D)
    k = key.reshape(B, Hkv, S, D)  # (B, Hkv, S, D)
    v = value.reshape(B, Hkv, S, value.shape[-1])  # (B, Hkv, S, Dv)

    # 2) The mask parts: a dense user mask (4-D keep-bool or additive float), the causal
    #    diagonal, a sliding window and ALiBi slopes, kept apart for the backends.
    mask = None
    if attn_mask is not None:
        mask = _normalise_mask(attn_mask, query, (*batch_shape, H, T, S), squeeze_heads)
    causal = _causal_shift(is_causal, T, S)
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if causal is None:
            raise ValueError("window (a sliding causal window) needs is_causal")

    return AttentionCall(
        query=q,
        key=k,
        value=v,
        mask=mask,
        causal=causal,
        window=window,
        alibi=_check_alibi(alibi_slopes, H, query),
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(D) if D > 0 else 1.0,
        dropout_p=float(dropout_p),
        need_weights=bool(need_weights),
        batch_shape=batch_shape,
        squeeze_heads=squeeze_heads,
    )


def _normalise_mask(
    attn_mask: object, query: Tensor, full: tuple[int, ...], squeeze_heads: bool
) -> Tensor:
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask)}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(
            "attn_mask must be boolean (True = may attend) or floating point (added to the "
            f"scores), got dtype {attn_mask.dtype}"
        )
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    if squeeze_heads and attn_mask.dim() == 3:
        T, S = full[-2:]
        raise ValueError(
            f"attn_mask of shape {_shape(attn_mask)} has a head dimension but the inputs "
            f"are 2-D (T, D); expected a mask broadcastable to ({T}, {S})"
        )
    mask = _broadcast_mask(attn_mask, full, "attn_mask")
    if mask.is_floating_point():
        if torch.isnan(mask).any():
            raise ValueError("attn_mask contains NaN; use -inf to hide a key")
        if torch.isposinf(mask).any():
            raise ValueError(
                "attn_mask contains +inf, which makes the softmax NaN; use large finite "
                "values to favour a key"
            )
        mask = mask.to(query.dtype)
    return mask
