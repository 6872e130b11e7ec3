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

from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.masks import causal_shift, check_attn_mask, split_causal_bias
from qkv.checks import values_unknown

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
        alibi_offset: None, or the key position of query 0 for ALiBi distances when it is
            neither the causal shift nor ``S - T`` (a block of a longer sequence, as in
            context-parallel attention, where query and key blocks start at other offsets).
        need_lse: whether the caller wants the log-sum-exp ``(B, H, T)`` back (``return_lse``
            of :func:`qkv.scaled_dot_product_attention`; backends that cannot give it say so
            in ``why_not``).
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
    alibi_offset: int | None = None
    need_lse: bool = False

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
        if self.alibi_offset is not None:
            return self.alibi_offset
        return self.causal if self.causal is not None else self.S - self.T

    @property
    def plain(self) -> bool:
        """No mask of any kind: every query sees every key."""
        return self.mask is None and self.causal is None and self.alibi is None


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise AttentionTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise AttentionTypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
            f"got dtype {t.dtype}"
        )
    if t.dim() < 2:
        raise AttentionArgumentError(
            f"{name} must have at least 2 dimensions (..., T, D), got shape {_shape(t)}"
        )
    return t


def _check_inputs(query: Tensor, key: Tensor, value: Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t)
    if not (query.dtype == key.dtype == value.dtype):
        raise AttentionTypeError(
            "query, key and value must share one dtype, got "
            f"query {query.dtype}, key {key.dtype}, value {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise AttentionArgumentError(
            "query, key and value must be on one device, got "
            f"query on {query.device}, key on {key.device}, value on {value.device}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise AttentionArgumentError(
            f"query and key must have the same head width D (last dimension), got query "
            f"{_shape(query)} with D={query.shape[-1]} and key {_shape(key)} with "
            f"D={key.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise AttentionArgumentError(
            f"key and value must have the same length S (dimension -2), got key {_shape(key)} "
            f"with S={key.shape[-2]} and value {_shape(value)} with S={value.shape[-2]}"
        )


def _broadcast_dims(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """Broadcast two shapes of equal length, or None when they do not broadcast."""
    out = []
    for x, y in zip(a, b, strict=True):
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def _heads(H: int, Hk: int, Hv: int, enable_gqa: bool, shapes: str) -> tuple[int, int]:
    """Query heads and key/value heads ``(H, Hkv)`` of the call, ``H`` a multiple of ``Hkv``.

    Without ``enable_gqa`` head counts broadcast as torch broadcasts them (a key/value head
    count of 1 is shared by every query head: ``Hkv = 1``, no copy). With it, torch repeats
    key head ``h`` for query heads ``h·G .. h·G + G - 1``: the same grouping.
    """
    if enable_gqa and H != 1 and (Hk != H or Hv != H):
        if Hk == 0 or Hv == 0 or H % Hk != 0 or H % Hv != 0:
            raise AttentionArgumentError(
                f"grouped-query attention needs H (query heads, {H}) to be a multiple of "
                f"Hkv (key/value heads, {Hk}); got {shapes}"
            )
        # Equal key and value heads group as they are; a single one is shared; otherwise
        # (torch repeats each by its own factor) both are repeated to H heads.
        return H, (Hk if Hk == Hv else max(Hk, Hv) if 1 in (Hk, Hv) else H)
    kv = _broadcast_dims((Hk,), (Hv,))
    if kv is None:
        raise AttentionArgumentError(
            f"key and value must have the same number of heads Hkv (dimension -3), got "
            f"{shapes}"
        )
    both = _broadcast_dims((H,), kv)
    if both is None:
        raise AttentionArgumentError(
            f"query has H={H} heads but key/value have Hkv={Hk} (dimension -3); pass "
            "enable_gqa=True for grouped-query attention, or give them equal heads; got "
            f"{shapes}"
        )
    return both[0], kv[0]  # kv[0] is 1 (shared by every query head) or equal to H


def _to_call_layout(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool):
    """Broadcast the inputs as torch does and flatten them to ``(B, H|Hkv, T|S, D)``.

    Leading dimensions broadcast like ``torch.matmul``'s (inputs of lower rank gain leading
    1s), so ``query (4, 3, 8)`` with ``key (4, 4, 6, 8)`` is four batches of four heads.
    Returns ``(q, k, v, batch_shape, squeeze_heads)``.
    """
    if query.dim() == key.dim() == value.dim() == 4:
        # The common case, already (B, H, T, D) with (B, Hkv, S, D) keys: nothing to
        # broadcast or flatten (a decoding step spends ~10 µs less here).
        (B, H), (Bk, Hk), (Bv, Hv) = query.shape[:2], key.shape[:2], value.shape[:2]
        grouped = H == Hk or (enable_gqa and Hk > 0 and H % Hk == 0)
        if B == Bk == Bv and Hk == Hv and grouped:
            return query, key, value, (B,), False
    shapes = f"query {_shape(query)}, key {_shape(key)}, value {_shape(value)}"
    rank = max(query.dim(), key.dim(), value.dim(), 3)
    squeeze_heads = max(query.dim(), key.dim(), value.dim()) == 2
    q, k, v = (t[(None,) * (rank - t.dim())] for t in (query, key, value))  # (*lead, H, L, D)
    lead = _broadcast_dims(tuple(q.shape[:-3]), tuple(k.shape[:-3]))
    lead = None if lead is None else _broadcast_dims(lead, tuple(v.shape[:-3]))
    if lead is None:
        raise AttentionArgumentError(
            f"query, key and value must have the same leading (batch) dimensions or "
            f"broadcast together, got {shapes}"
        )
    H, Hkv = _heads(q.shape[-3], k.shape[-3], v.shape[-3], enable_gqa, shapes)
    B, T, D, S, Dv = math.prod(lead), q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]

    def heads_to(t: Tensor, n: int) -> Tensor:
        if t.shape[-3] in (1, n):
            return t.expand(*lead, n, *t.shape[-2:])  # (*lead, n, L, D): a view
        return t.repeat_interleave(n // t.shape[-3], dim=-3)  # GQA with Hk != Hv: a copy

    q = heads_to(q, H).reshape(B, H, T, D)  # (B, H, T, D)
    k = heads_to(k, Hkv).reshape(B, Hkv, S, D)  # (B, Hkv, S, D)
    v = heads_to(v, Hkv).reshape(B, Hkv, S, Dv)  # (B, Hkv, S, Dv)
    return q, k, v, tuple(lead), squeeze_heads


def _check_alibi(
    alibi_slopes: object, H: int, query: Tensor, T: int, S: int, shift: int
) -> Tensor | None:
    """The slopes as float32 ``(H,)`` on the query's device, or None.

    Checked on the device they come on (slopes made on the CPU cost no device sync): every
    slope finite after conversion to float32, and small enough that the bias
    ``-slope · |i + shift - j|`` stays finite in float32 over the whole ``T×S`` grid (an
    infinite bias would hide keys, or make NaN, without a word).
    """
    if alibi_slopes is None:
        return None
    expected = f"a float tensor of shape (H,) = ({H},) or None"
    if not isinstance(alibi_slopes, Tensor):
        got = type(alibi_slopes).__name__
        raise AttentionTypeError(f"alibi_slopes must be {expected}, got {got}")
    if not alibi_slopes.is_floating_point():
        raise AttentionTypeError(f"alibi_slopes must be {expected}, got dtype {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) != (H,):
        raise AttentionArgumentError(
            f"alibi_slopes must have shape (H,) = ({H},), got {_shape(alibi_slopes)}"
        )
    slopes = alibi_slopes.detach().to(torch.float32)  # (H,)
    distance = max(abs(shift + T - 1), abs(shift - S + 1)) if T and S else 0
    bound = torch.finfo(torch.float32).max / max(1, distance)
    finite = torch.isfinite(slopes)
    bad = ~finite | (slopes.abs() > bound)  # (H,)
    if not values_unknown(slopes) and bool(bad.any()):
        heads = bad.nonzero().flatten().tolist()
        values = slopes[bad].tolist()
        if not bool(finite.all()):
            raise AttentionArgumentError(
                f"alibi_slopes must be finite (after conversion to float32), got {values} at "
                f"head(s) {heads}"
            )
        raise AttentionArgumentError(
            f"alibi_slopes must be at most {bound:.3g} in magnitude for T={T}, S={S}: the "
            f"bias -slope · |i + {shift} - j| reaches distance {distance} and would overflow "
            f"float32; got {values} at head(s) {heads}"
        )
    return slopes.to(device=query.device)


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
    need_lse: bool = False,
) -> AttentionCall:
    """Check every argument and build the :class:`AttentionCall` (see ``sdpa`` for rules).

    This is the only validation: backends and :func:`qkv.attention.sdpa.run_call` trust the
    record. Inputs of different ranks or with size-1 leading dimensions broadcast as in
    torch; a :class:`torch.nn.attention.bias.CausalBias` mask becomes ``is_causal``.

    Raises:
        AttentionTypeError: non-tensor or non-float inputs, mixed dtypes, integer masks.
        AttentionArgumentError: wrong ranks or widths, length or head mismatches, masks that
            do not broadcast or contain NaN or +inf, bad ``dropout_p``, ``scale``,
            ``is_causal``, ``window`` or ``alibi_slopes`` (wrong shape, NaN or inf, or so
            large that the bias overflows float32).
    """
    _check_inputs(query, key, value)
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise AttentionArgumentError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if scale is not None and (
        not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise AttentionArgumentError(f"scale must be a finite number or None, got {scale!r}")

    # 1) Bring every input to (B, H, T, D): one head dimension, one flattened batch dimension.
    q, k, v, batch_shape, squeeze_heads = _to_call_layout(query, key, value, enable_gqa)
    _, H, T, D = q.shape
    S = k.shape[2]

    # 2) The mask parts: a dense user mask (4-D keep-bool or additive float), the causal
    #    diagonal, a sliding window and ALiBi slopes, kept apart for the backends.
    attn_mask, is_causal = split_causal_bias(attn_mask, is_causal, T, S)
    mask = None
    if attn_mask is not None:
        if squeeze_heads and isinstance(attn_mask, Tensor) and attn_mask.dim() == 3:
            raise AttentionArgumentError(
                f"attn_mask of shape {_shape(attn_mask)} has a head dimension but the inputs "
                f"are 2-D (T, D); expected a mask broadcastable to ({T}, {S})"
            )
        mask = check_attn_mask(
            attn_mask, (*batch_shape, H, T, S), device=q.device, dtype=q.dtype
        )
    causal = causal_shift(is_causal, T, S)
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise AttentionArgumentError(f"window must be a positive int or None, got {window!r}")
        if causal is None:
            raise AttentionArgumentError("window (a sliding causal window) needs is_causal")
    alibi_shift = causal if causal is not None else S - T
    alibi_offset = None
    if causal is not None and window is None and causal >= S - 1:
        # Every query sees every key (one new token after a cache, is_causal="bottom-right"):
        # no causal mask, so backends take their unmasked paths; ALiBi keeps its distances.
        causal = None
        if alibi_slopes is not None and alibi_shift != S - T:
            alibi_offset = alibi_shift

    return AttentionCall(
        query=q,
        key=k,
        value=v,
        mask=mask,
        causal=causal,
        window=window,
        alibi=_check_alibi(alibi_slopes, H, q, T, S, alibi_shift),
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(D) if D > 0 else 1.0,
        dropout_p=float(dropout_p),
        need_weights=bool(need_weights),
        batch_shape=batch_shape,
        squeeze_heads=squeeze_heads,
        need_lse=bool(need_lse),
        alibi_offset=alibi_offset,
    )
