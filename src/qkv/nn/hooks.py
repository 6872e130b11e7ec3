"""Hook points: named identity modules where an intermediate can be read or replaced.

A :class:`HookPoint` returns its input unchanged. Its value is that it is a *module* with a
name in ``model.named_modules()`` (``blocks.0.self_attn.hook_q``), so a forward hook on it sees
the intermediate and may return a replacement, which then flows on (TransformerLens names its
hook points the same way). Nothing is computed for a hook point nobody listens to, except
``hook_scores`` and ``hook_weights`` of an attention module (:class:`~qkv.nn.core.AttentionCore`):
the fused kernels never form the ``(B, H, T, S)`` scores, so those two exist only when a hook
asks for them, and then that one layer runs the math backend instead of the kernel.

:class:`AttentionInputs` is what an attention module hands to
:func:`qkv.scaled_dot_product_attention`: queries and keys after rotary positions and the KV
cache, and the mask parts (keep/float mask, causal alignment, ALiBi slopes), and, for
programmable attention, the ``score_mod`` and ``block_mask`` of :func:`qkv.flex_attention`.
Its hook point (``hook_inputs``) lets :mod:`qkv.inspect` rebuild exact weights for chosen heads
and rows without touching the model's own call.

A record with a ``score_mod`` or a ``block_mask`` is a *flex* record: :meth:`AttentionInputs.
flex_parts` folds its other mask parts into the pair :func:`qkv.flex_attention` takes, so
whoever runs or rebuilds it (the core, :mod:`qkv.inspect`) sees one definition:

1. ``score_mod`` runs first, on the scaled scores ``q·k·scale`` exactly as in
   :func:`qkv.flex_attention`;
2. then the ALiBi bias ``-slope_h·|i + a - j|`` and a float ``attn_mask`` are added and a
   boolean ``attn_mask`` hides keys (``-inf``), all read per tile by index (so a ``score_mod``
   such as a soft cap never turns a hidden key back into a visible one);
3. ``is_causal`` (with its sliding ``window``, when the record has one) is AND-ed into the
   block mask: its tile states come in closed form (``min`` of the two states: empty if either
   is, full if both are) and its ``mask_mod`` gains the causal term; the user's ``mask_mod`` is
   not evaluated again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

from qkv.attention.call import AttentionCall, causal_shift, make_call
from qkv.attention.flex.blocks import (
    DEFAULT_BLOCK,
    EMPTY,
    FULL,
    PARTIAL,
    BlockMask,
    and_masks,
)

__all__ = ["AttentionInputs", "HookPoint", "listening"]


class HookPoint(nn.Module):
    """Identity module marking a named intermediate (no parameters, no state).

    ``forward(x)`` returns ``x``. A forward hook registered on it (directly, with
    :meth:`add_hook`, or through :func:`qkv.inspect.hooks`) receives the value and may return a
    replacement.
    """

    def forward(self, x: Any) -> Any:
        return x

    def __call__(self, x: Any) -> Any:
        # Nothing attached (the usual case, hundreds of times per decoding step): skip
        # nn.Module's call machinery. Module-global hooks still see every call.
        if module_hooks_attached(self):
            return super().__call__(x)
        return x

    @property
    def listening(self) -> bool:
        """Whether any hook is attached (then optional intermediates are computed)."""
        return bool(self._forward_hooks) or bool(self._forward_pre_hooks)

    def add_hook(self, fn: Callable[[Any, HookPoint], Any]) -> RemovableHandle:
        """Attach ``fn(value, hook_point) -> replacement | None``; returns a removable handle.

        Returning None keeps the value (reading); returning a value of the same kind and shape
        replaces it (ablation, patching).
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        return self.register_forward_hook(lambda module, args, out: fn(out, module))


def module_hooks_attached(module: nn.Module) -> bool:
    """Whether a forward hook would see a call of ``module``: its own, or a module-global one
    (``torch.nn.modules.module.register_module_forward_hook``)."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or _module._global_forward_hooks or _module._global_forward_pre_hooks)


def listening(*points: HookPoint) -> bool:
    """True when any of ``points`` has a hook attached."""
    return any(p.listening for p in points)


@dataclass(frozen=True)
class AttentionInputs:
    """The arguments an attention module passes to ``scaled_dot_product_attention``.

    Attributes:
        query: ``(B, H, T, D)`` after rotary positions.
        key: ``(B, Hkv, S, D)``: every key attended to (cached ones included), rotated.
        value: ``(B, Hkv, S, Dv)``.
        attn_mask: None, a boolean keep mask or a float mask broadcastable to ``(B, H, T, S)``.
        is_causal: False, True (top-left) or ``"bottom-right"``.
        alibi_slopes: ``(H,)`` ALiBi slopes or None.
        enable_gqa: ``H != Hkv``.
        dropout_p: dropout on the weights (0 in evaluation).
        cross: keys come from a context (cross-attention), not from the queries' sequence.
        scale: factor on ``q·k`` (None: ``1/sqrt(D)``).
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` of :func:`qkv.flex_attention`,
            or None.
        block_mask: a :class:`~qkv.attention.flex.blocks.BlockMask` for ``(T, S)``, or None.
        window: None or a sliding causal window ``w`` (with ``is_causal``): query ``i`` sees
            keys ``j`` with ``i + c - w < j <= i + c``, ``c`` the causal shift (``S - T``
            bottom-right), i.e. itself and the ``w - 1`` keys before it.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None = None
    is_causal: bool | str = False
    alibi_slopes: Tensor | None = None
    enable_gqa: bool = False
    dropout_p: float = 0.0
    cross: bool = False
    scale: float | None = None
    score_mod: Callable | None = None
    block_mask: BlockMask | None = None
    window: int | None = None

    @property
    def is_flex(self) -> bool:
        """Whether this call runs :func:`qkv.flex_attention` (a ``score_mod`` or block mask)."""
        return self.score_mod is not None or self.block_mask is not None

    def flex_parts(self) -> tuple[Callable | None, BlockMask | None]:
        """``(score_mod, block_mask)`` for :func:`qkv.flex_attention`, with this record's
        ``attn_mask``, ALiBi slopes and ``is_causal`` folded in (see the module docstring)."""
        q, k = self.query, self.key
        B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        shift = causal_shift(self.is_causal, T, S)
        after = []  # what follows the user's score_mod, in order
        if self.alibi_slopes is not None:
            after.append(_alibi_mod(self.alibi_slopes, S - T if shift is None else shift))
        if self.attn_mask is not None:
            after.append(_tensor_mod(self.attn_mask, B, H, T, S))
        score_mod = _chain(self.score_mod, after)
        block_mask = self.block_mask
        if shift is not None:
            block_mask = _and_causal(block_mask, shift, T, S, self.window)
        return score_mod, block_mask

    def to_call(self, need_weights: bool = False) -> AttentionCall:
        """This record as the :class:`~qkv.attention.call.AttentionCall` the backends run.

        No validation: the record was built by an attention module from checked arguments
        (``attn_mask`` 4-D, ``alibi_slopes`` float32), or passed :meth:`checked`.

        Raises:
            ValueError: a flex record (its ``score_mod``/``block_mask`` have no
                ``AttentionCall`` form: use :meth:`flex_parts`).
        """
        if self.is_flex:
            raise ValueError(
                "this AttentionInputs record has a score_mod or block_mask: run it with "
                "qkv.flex_attention(..., *record.flex_parts()), not as an AttentionCall"
            )
        q, k = self.query, self.key
        T, S, D = q.shape[2], k.shape[2], q.shape[3]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(D) if D else 1.0
        return AttentionCall(
            query=q, key=k, value=self.value, mask=self.attn_mask,
            causal=causal_shift(self.is_causal, T, S), window=self.window,
            alibi=self.alibi_slopes,
            scale=float(scale), dropout_p=float(self.dropout_p), need_weights=need_weights,
            batch_shape=(q.shape[0],),
        )

    def checked(self) -> AttentionInputs:
        """The record validated as :func:`qkv.scaled_dot_product_attention` validates a call
        (for records built or replaced by user code); the mask comes back in its 4-D form.

        Raises:
            TypeError, ValueError: as :func:`qkv.scaled_dot_product_attention`.
        """
        for name in ("query", "key", "value"):
            t = getattr(self, name)
            if not isinstance(t, Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"AttentionInputs.{name} must be a 4-D tensor, got {shape}")
        call = make_call(
            self.query, self.key, self.value, self.attn_mask, self.dropout_p, self.is_causal,
            self.scale, self.enable_gqa, False, self.window, self.alibi_slopes,
        )
        check_flex_args(self.score_mod, self.block_mask, call.query.shape[0], call.num_heads,
                        call.T, call.S, "AttentionInputs.")  # fmt: skip
        return dataclasses.replace(self, attn_mask=call.mask, alibi_slopes=call.alibi)


def check_flex_args(score_mod: object, block_mask: object, B: int, H: int, T: int, S: int,
                    prefix: str = "") -> None:  # fmt: skip
    """Check a ``score_mod`` and ``block_mask`` for a ``(B, H, T, S)`` attention.

    Raises:
        TypeError: ``score_mod`` not callable, ``block_mask`` not a ``BlockMask``.
        ValueError: a block mask made for other lengths, batch or heads.
    """
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            f"{prefix}score_mod must be a function (score, b, h, q_idx, kv_idx) -> score or "
            f"None, got {type(score_mod).__name__}"
        )
    if block_mask is None:
        return
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"{prefix}block_mask must be a BlockMask (qkv.create_block_mask) or None, got "
            f"{type(block_mask).__name__}"
        )
    if (block_mask.q_len, block_mask.kv_len) != (T, S):
        raise ValueError(
            f"{prefix}block_mask was made for Q_LEN={block_mask.q_len}, KV_LEN="
            f"{block_mask.kv_len}, but this attention has T={T} queries and S={S} keys "
            "(S counts cached keys too)"
        )
    b, h = block_mask.state.shape[:2]
    if b not in (1, B) or h not in (1, H):
        raise ValueError(
            f"{prefix}block_mask was made for B={b}, H={h}; this attention has B={B}, H={H} "
            "(make it with B and H equal to those, or None for 'the same for all')"
        )


def _alibi_mod(slopes: Tensor, shift: int) -> Callable:
    """``score - slope_h·|q + shift - kv|`` (the bias of :func:`qkv.attention.masks.alibi_bias`)."""

    def alibi(score, b, h, q_idx, kv_idx):
        distance = (q_idx + shift - kv_idx).abs().to(score.dtype)  # (1, 1, bq, bk)
        return score - slopes.to(score.dtype)[h] * distance  # (B|1, H, bq, bk)

    return alibi


def _tensor_mod(mask: Tensor, B: int, H: int, T: int, S: int) -> Callable:
    """A 4-D keep or float mask read per tile by index: hides (``-inf``) or adds."""
    m = mask.expand(B, H, T, S)  # (B, H, T, S), a view: nothing is copied

    if m.dtype == torch.bool:
        def hide(score, b, h, q_idx, kv_idx):
            return score.masked_fill(~m[b, h, q_idx, kv_idx], float("-inf"))

        return hide

    def add(score, b, h, q_idx, kv_idx):
        return score + m[b, h, q_idx, kv_idx].to(score.dtype)

    return add


def _chain(first: Callable | None, after: list[Callable]) -> Callable | None:
    """One ``score_mod``: ``first`` (the user's), then each of ``after`` in order."""
    if not after:
        return first
    mods = ([first] if first is not None else []) + after

    def chained(score, b, h, q_idx, kv_idx):
        for mod in mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    return chained


# Tile states are ordered EMPTY < PARTIAL < FULL, so the state of an AND is the minimum.
assert EMPTY < PARTIAL < FULL


def _and_causal(block_mask: BlockMask | None, shift: int, T: int, S: int,
                window: int | None = None) -> BlockMask:  # fmt: skip
    """``block_mask`` AND "key ``j <= i + shift``" (AND ``j > i + shift - window`` with a
    sliding window), its tile states in closed form."""
    bq, bk = (DEFAULT_BLOCK, DEFAULT_BLOCK) if block_mask is None else block_mask.block_size
    nq, nk = -(-T // bq), -(-S // bk)
    first_row = torch.arange(nq) * bq  # (nQ,)
    last_row = torch.clamp(first_row + bq, max=T) - 1
    first_col = torch.arange(nk) * bk  # (nK,)
    last_col = torch.clamp(first_col + bk, max=S) - 1
    empty = first_col[None, :] > last_row[:, None] + shift  # (nQ, nK)
    full = last_col[None, :] <= first_row[:, None] + shift  # (nQ, nK)
    if window is not None:
        # The window's edge: every key of the tile too old for the tile's last row (empty),
        # or every key recent enough for its first row (full only then).
        empty |= last_col[None, :] <= first_row[:, None] + shift - window
        full &= first_col[None, :] > last_row[:, None] + shift - window
    state = torch.full((nq, nk), PARTIAL, dtype=torch.uint8)
    state[empty], state[full] = EMPTY, FULL

    def causal(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx + shift
        return keep if window is None else keep & (kv_idx > q_idx + shift - window)

    if block_mask is None:
        return BlockMask(state[None, None], causal, T, S, (bq, bk))  # (1, 1, nQ, nK)
    combined = torch.minimum(block_mask.state, state.to(block_mask.state.device))
    return BlockMask(combined, and_masks(block_mask.mask_mod, causal), T, S, (bq, bk))
