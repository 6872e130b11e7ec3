"""Ready score functions for :func:`qkv.flex_attention`: ALiBi, tanh soft-capping and T5's
bucketed relative position bias.

A ``score_mod(score, b, h, q_idx, kv_idx) -> score`` acts on the *scaled* scores
``q·k · scale`` (torch's FlexAttention signature). Every function here is elementwise torch
operations on its arguments, so it runs in qkv's kernel (broadcast index tensors ``b (B,1,1,1)``,
``h (1,H,1,1)``, ``q_idx (1,1,T',1)``, ``kv_idx (1,1,1,S')``) and in torch's
``flex_attention`` (0-d index tensors under ``vmap``) alike. Tensors a mod captures (ALiBi
slopes, a T5 bias table) get gradients through :func:`qkv.flex_attention`'s backward when they
require them.

``alibi``, ``soft_cap`` and ``relative_bias`` carry ``kernel_params`` (their kind and
constants), so the block-sparse Triton kernels of :mod:`qkv.attention.flex.triton_path` run them
inside the kernel; a ``score_mod`` without it runs on the tile loop.

Shapes: ``B`` batch, ``H`` query heads, ``T`` queries, ``S`` keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.checks import is_int, is_number

__all__ = ["alibi", "relative_bias", "relative_position_bucket", "soft_cap"]


def check_heads(h: Tensor, n: int, what: str) -> None:
    """Refuse a head grid ``(1, H, 1, 1)`` (qkv's call) with ``H != n``; no-op under vmap."""
    if h.dim() == 4:
        check_head_count(n, h.shape[1], what)


def check_head_count(n: int, H: int, what: str) -> None:
    """Refuse ``what`` with ``n`` per-head entries for an attention of ``H`` query heads."""
    if n != H:
        raise AttentionArgumentError(
            f"{what} has {n} heads but the attention has H={H} query heads "
            "(one entry per query head is needed)"
        )


def _float_tensor(name: str, t: object, dims: int, shape: str) -> Tensor:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise AttentionTypeError(f"{name} must be a floating-point tensor {shape}, got {got}")
    if t.dim() != dims or t.numel() == 0:
        raise AttentionArgumentError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not bool(torch.isfinite(t.detach()).all()):
        raise AttentionArgumentError(f"{name} must be finite, got {t.detach()!r:.80}")
    return t


def alibi(slopes: Tensor, *, offset: int = 0) -> Callable:
    """ALiBi (Press et al., 2022): ``score - slopes[h] · |q_idx + offset - kv_idx|``.

    Equal to qkv's ``alibi_slopes=`` path: ``qkv.scaled_dot_product_attention(q, k, v,
    is_causal=True, alibi_slopes=slopes)`` is ``qkv.flex_attention(q, k, v, alibi(slopes),
    create_block_mask(causal_mask, ...))``. That path places query ``i`` at key position
    ``i + shift``, ``shift`` its causal diagonal: ``offset=0`` for ``is_causal=True``,
    ``offset=S - T`` for ``is_causal="bottom-right"`` and for no ``is_causal`` at all. It
    also rounds the slopes to float32; this mod uses them as given, in the scores' dtype.

    Args:
        slopes: ``(H,)`` finite floats, one per query head (``qkv.nn.alibi_slopes(H)`` gives
            the paper's). A tensor that requires grad gets its gradient (learned slopes).
        offset: key position of query 0 (an int).

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx)``.

    Raises:
        AttentionTypeError / AttentionArgumentError: ``slopes`` is not a finite float ``(H,)``
            tensor, ``offset`` not an int, or (at call time) the attention has another ``H``.
    """
    slopes = _float_tensor("alibi slopes", slopes, 1, "(H,)")
    if not is_int(offset):
        raise AttentionTypeError(f"alibi offset must be an int, got {offset!r}")
    H = slopes.shape[0]

    def alibi_bias(score, b, h, q_idx, kv_idx):
        check_heads(h, H, "alibi slopes")
        distance = (q_idx + offset - kv_idx).abs().to(score.dtype)
        return score - slopes.to(score.device, score.dtype)[h] * distance

    alibi_bias.kernel_params = ("alibi", slopes, int(offset))  # what a GPU kernel reads
    return alibi_bias


def soft_cap(cap: float) -> Callable:
    """Gemma-2's logit soft-capping: ``cap · tanh(score / cap)``, scores squashed into
    ``(-cap, cap)`` smoothly (Gemma Team, 2024; Gemma-2 uses ``cap = 50`` on attention).

    Args:
        cap: a finite number > 0.

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx)``.

    Raises:
        AttentionArgumentError: ``cap`` is not a finite positive number.
    """
    if not is_number(cap) or cap <= 0:
        raise AttentionArgumentError(f"soft_cap cap must be a finite number > 0, got {cap!r}")
    cap = float(cap)

    def tanh_soft_cap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    tanh_soft_cap.kernel_params = ("softcap", cap)  # what a GPU kernel reads
    return tanh_soft_cap


def _check_buckets(num_buckets: object, max_distance: object, bidirectional: object) -> None:
    if not isinstance(bidirectional, bool):
        raise AttentionTypeError(f"bidirectional must be a bool, got {bidirectional!r}")
    least = 4 if bidirectional else 2  # at least one exact bucket per direction
    if not is_int(num_buckets) or num_buckets < least:
        raise AttentionArgumentError(
            f"num_buckets must be an int >= {least} (bidirectional={bidirectional}), got "
            f"{num_buckets!r}"
        )
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if not is_int(max_distance) or max_distance <= exact:
        raise AttentionArgumentError(
            f"max_distance must be an int > {exact} (the exact buckets of num_buckets="
            f"{num_buckets}), got {max_distance!r}"
        )


def relative_position_bucket(
    relative_position: Tensor, num_buckets: int = 32, max_distance: int = 128,
    bidirectional: bool = True,
) -> Tensor:
    """T5's bucket of each relative position ``kv_idx - q_idx`` (Raffel et al., 2020).

    With ``bidirectional``, keys after the query (``relative_position > 0``) use the upper
    half of the buckets, and ``n = |relative_position|``; otherwise only keys at or before the
    query count, ``n = max(-relative_position, 0)`` (later keys share bucket 0). Of the
    ``N`` buckets per direction, the first ``N/2`` hold ``n = 0, 1, ..., N/2 - 1`` exactly;
    the rest cover ``N/2 <= n < max_distance`` logarithmically, ``N/2 + floor(log(n / (N/2)) /
    log(max_distance / (N/2)) · (N - N/2))`` computed in float32 as T5 does, capped at
    ``N - 1`` (every ``n >= max_distance`` shares the last bucket).

    Args:
        relative_position: integer tensor of any shape, ``kv_idx - q_idx``.
        num_buckets: buckets in all (both directions together when ``bidirectional``).
        max_distance: distance from which every position shares one bucket.
        bidirectional: False for causal (decoder) attention.

    Returns:
        int64 buckets in ``[0, num_buckets)``, the shape of ``relative_position``.
    """
    _check_buckets(num_buckets, max_distance, bidirectional)
    rel = relative_position.long()
    n_buckets = num_buckets
    if bidirectional:
        n_buckets //= 2
        base = (rel > 0).long() * n_buckets
        n = rel.abs()
    else:
        base = torch.zeros_like(rel)
        n = (-rel).clamp(min=0)
    exact = n_buckets // 2
    # clamp: log() sees n >= exact only, so no log(0); those rows take the exact branch anyway.
    ratio = n.clamp(min=exact).to(torch.float32) / exact
    large = exact + (torch.log(ratio) / math.log(max_distance / exact)
                     * (n_buckets - exact)).long()
    large = large.clamp(max=n_buckets - 1)
    return base + torch.where(n < exact, n, large)


def relative_bias(
    table: Tensor, num_buckets: int, max_distance: int, bidirectional: bool = True
) -> Callable:
    """T5's learned relative position bias: ``score + table[bucket(kv_idx - q_idx), h]``.

    ``bucket`` is :func:`relative_position_bucket`. ``table`` has Hugging Face's layout, the
    ``(num_buckets, H)`` weight of T5's ``relative_attention_bias`` embedding, so a
    checkpoint's table is used as it is. It is captured, not copied: a table that requires
    grad gets its gradient through :func:`qkv.flex_attention`'s backward. T5 does not scale
    its scores: pass ``scale=1.0`` to reproduce it.

    Args:
        table: ``(num_buckets, H)`` finite floats.
        num_buckets: buckets in all (both directions when ``bidirectional``).
        max_distance: distance from which every position shares the last bucket.
        bidirectional: True for the encoder, False for causal decoder self-attention.

    Returns:
        ``score_mod(score, b, h, q_idx, kv_idx)``.

    Raises:
        AttentionTypeError / AttentionArgumentError: a table that is not a finite float
            ``(num_buckets, H)`` tensor, bad bucket arguments, or (at call time) an attention
            with another ``H``.
    """
    _check_buckets(num_buckets, max_distance, bidirectional)
    table = _float_tensor("relative_bias table", table, 2, "(num_buckets, H)")
    if table.shape[0] != num_buckets:
        raise AttentionArgumentError(
            f"relative_bias table must have shape (num_buckets, H) = ({num_buckets}, H), got "
            f"{tuple(table.shape)} (transpose an (H, num_buckets) table)"
        )
    H = table.shape[1]

    def t5_bias(score, b, h, q_idx, kv_idx):
        check_heads(h, H, "relative_bias table")
        bucket = relative_position_bucket(kv_idx - q_idx, num_buckets, max_distance,
                                          bidirectional)
        return score + table.to(score.device, score.dtype)[bucket, h]

    # what a GPU kernel reads: the bias of each head and distance, from these
    t5_bias.kernel_params = ("relative", table, num_buckets, max_distance, bidirectional)
    return t5_bias
