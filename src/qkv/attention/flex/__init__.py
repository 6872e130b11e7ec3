"""Programmable attention: a ``score_mod`` and a block mask, and which path runs them.

:func:`flex_attention` has the semantics of torch's ``torch.nn.attention.flex_attention``:
the scaled scores ``s = q·k · scale`` of each query/key pair go through
``score_mod(s, b, h, q_idx, kv_idx)``, the block mask's ``mask_mod`` hides pairs, and a
softmax over keys weights the values, blockwise with the online softmax (no ``T×S`` tensor),
tiles the block mask marks empty skipped. Three paths compute it (:func:`flex_path` says
which, and why):

* ``"triton"``: qkv's block-sparse Triton kernels (:mod:`qkv.attention.flex.triton_path`), on a
  GPU, with no ``score_mod`` or a ready one (ALiBi, soft-cap, relative bias);
* ``"compiled"``: a Python ``score_mod`` on a GPU, through ``torch.compile(flex_attention)``
  (:mod:`qkv.attention.flex.compiled`);
* ``"tiles"``: the tile loop of PyTorch ops (:mod:`qkv.attention.flex.loop`), the CPU's fast
  path and every call the others do not serve.

Also here: :mod:`~qkv.attention.flex.blocks` (block masks: which tiles a ``mask_mod`` leaves
empty, full or partial), :mod:`~qkv.attention.flex.fused` (inference without a ``score_mod``:
spans on torch's fused kernel), :mod:`~qkv.attention.flex.sdpa` (a ``score_mod`` / ``mask_mod``
given to :func:`qkv.scaled_dot_product_attention`).

Rows that see no key give zeros and ``lse = -inf``, as torch's do; a non-finite query row gives
a NaN row; a ``score_mod`` that makes a score ``+inf`` or NaN is named in an error.

Shapes: ``query (B, H, T, D)``, ``key (B, Hkv, S, D)``, ``value (B, Hkv, S, Dv)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.flex import compiled as flex_compiled
from qkv.attention.flex import triton_path as flex_triton
from qkv.attention.flex.blocks import BlockMask
from qkv.attention.flex.loop import Plan, check_finite_scores, results, tile_loop
from qkv.attention.threads import fitted_threads

__all__ = ["flex_attention", "flex_path"]


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    need_weights: bool = False,
):
    """Attention with a user score function and block mask (torch's FlexAttention semantics).

    Args:
        query: ``(B, H, T, D)``.
        key: ``(B, Hkv, S, D)``; ``Hkv == H`` unless ``enable_gqa``.
        value: ``(B, Hkv, S, Dv)``.
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` on the scaled scores, or None.
        block_mask: from :func:`qkv.create_block_mask` for ``(T, S)``, or None (all visible).
        scale: factor on ``q·k``; ``1/sqrt(D)`` when None.
        enable_gqa: query head ``h`` reads key/value head ``h // (H / Hkv)``.
        return_lse: also return the log-sum-exp ``(B, H, T)`` (float32 for half inputs).
        kernel_options: ``None`` or ``{"backend": name}``: ``"auto"`` (the default: the
            Triton kernels of :mod:`qkv.attention.flex.triton_path` on a GPU when they serve the
            call; for a Python ``score_mod`` on a GPU, torch's compiled FlexAttention; else
            the tile loop), ``"triton"`` (qkv's kernels must serve it; on CPU tensors under
            ``TRITON_INTERPRET=1``), ``"compiled"`` (``torch.compile(flex_attention)``,
            :mod:`qkv.attention.flex.compiled`; on CPU tensors inference only) or
            ``"tiles"`` (the tile loop). :func:`flex_path` says which one runs and why.
        need_weights: also return the exact weights ``(B, H, T, S)`` (rebuilt from the
            log-sum-exp tile by tile; not differentiable).

    Returns:
        ``out (B, H, T, Dv)``; with ``return_lse`` and/or ``need_weights``, a tuple
        ``(out, lse?, weights?)`` in that order.
    """
    _check(query, key, value, score_mod, block_mask, enable_gqa)
    path, why = flex_path(query, value, score_mod, block_mask, kernel_options, key=key,
                          return_lse=return_lse, need_weights=need_weights)
    if path == "triton":
        return _on_triton(query, key, value, score_mod, block_mask, scale, return_lse,
                          need_weights)
    if path == "compiled":
        return _on_compiled(query, key, value, score_mod, block_mask, scale, enable_gqa,
                            return_lse, need_weights)
    if _backend(kernel_options) in ("triton", "compiled"):
        raise AttentionArgumentError(f"kernel_options backend={_backend(kernel_options)!r} "
                                     f"cannot serve this call: {why}")
    with fitted_threads(query, key, value):
        return tile_loop(query, key, value, score_mod, block_mask, scale, return_lse,
                         need_weights)


_BACKENDS = ("auto", "triton", "compiled", "tiles")


def _backend(kernel_options: dict | None) -> str:
    if kernel_options is None:
        return "auto"
    if not isinstance(kernel_options, dict) or set(kernel_options) - {"backend"}:
        raise AttentionArgumentError(
            f"kernel_options must be None or {{'backend': one of {_BACKENDS}}}, got "
            f"{kernel_options!r}"
        )
    backend = kernel_options.get("backend", "auto")
    if backend not in _BACKENDS:
        raise AttentionArgumentError(f"kernel_options backend must be one of {_BACKENDS}, got "
                                     f"{backend!r}")
    return backend


def flex_path(query: Tensor, value: Tensor, score_mod=None, block_mask=None,
              kernel_options: dict | None = None, *, key: Tensor | None = None,
              return_lse: bool = False, need_weights: bool = False) -> tuple[str, str]:
    """Which path :func:`flex_attention` takes for these arguments, and why:
    ``("triton", reason)``, ``("compiled", reason)`` or ``("tiles", reason)``.

    ``auto`` takes qkv's block-sparse Triton kernels where they serve the call (a GPU, a
    block mask, no ``score_mod`` or a ready one); else, for a Python ``score_mod`` on a GPU,
    torch's compiled FlexAttention (:mod:`qkv.attention.flex.compiled`); else the tile loop.
    ``key``, ``return_lse`` and ``need_weights`` matter to the compiled path on the CPU
    (inference only, no lse)."""
    backend = _backend(kernel_options)
    if backend == "tiles":
        return "tiles", "kernel_options asked for the tile loop"
    why = None
    if backend in ("auto", "triton"):
        why = flex_triton.why_not(query, value, score_mod, block_mask,
                                  named=backend == "triton")
        if why is None:
            return "triton", ("block-sparse Triton kernels (empty tiles skipped, mask_mod on "
                              "partial)")
        if backend == "triton" or score_mod is None:
            return "tiles", why
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value))
    why_compiled = flex_compiled.why_not(query, value, block_mask, grad,
                                         return_lse or need_weights, named=backend != "auto")
    if why_compiled is None:
        return "compiled", ("torch.compile(flex_attention): the Python score_mod traced into "
                            "generated kernels")
    return "tiles", why_compiled if why is None else f"{why}; {why_compiled}"


def _on_compiled(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                 need_weights):
    """Torch's compiled FlexAttention; weights (when asked) rebuilt from its lse."""
    out, lse = flex_compiled.attend(query, key, value, score_mod, block_mask, scale,
                                    enable_gqa, flex_compiled.gives_lse(query.device))
    if lse is not None and score_mod is not None:
        check_finite_scores(lse, query, score_mod)
    plan = Plan.of(query, key, score_mod, block_mask, scale)
    return results(query, key, out, lse, plan, return_lse, need_weights)


def _on_triton(query, key, value, score_mod, block_mask, scale, return_lse, need_weights):
    """The Triton path; weights (when asked) rebuilt from its lse on the visited tiles."""
    plan = Plan.of(query, key, score_mod, block_mask, scale)
    out, lse = flex_triton.attend(query, key, value, block_mask, plan.scale, score_mod)
    return results(query, key, out, lse, plan, return_lse, need_weights)


def _check(query, key, value, score_mod, block_mask, enable_gqa) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise AttentionTypeError(
                f"{name} must be a floating-point torch.Tensor, got "
                f"{type(t).__name__ if not isinstance(t, Tensor) else t.dtype}"
            )
        if t.dim() != 4:
            raise AttentionArgumentError(
                f"flex_attention takes 4-D (B, H, L, D) tensors, got {name} of shape "
                f"{tuple(t.shape)}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise AttentionTypeError(
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    B, H, T, D = query.shape
    if key.shape[0] != B or value.shape[0] != B or key.shape[-1] != D:
        raise AttentionArgumentError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)}: batch and head width D must "
            "match"
        )
    if key.shape[1:3] != value.shape[1:3]:
        raise AttentionArgumentError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same heads "
            "and length"
        )
    Hkv = key.shape[1]
    if Hkv != H and not (enable_gqa and H % Hkv == 0):
        raise AttentionArgumentError(
            f"query has H={H} heads and key/value Hkv={Hkv}: pass enable_gqa=True with H a "
            "multiple of Hkv, or give them equal heads"
        )
    if score_mod is not None and not callable(score_mod):
        raise AttentionTypeError(f"score_mod must be callable, got {type(score_mod).__name__}")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise AttentionTypeError(
                "block_mask must be a qkv BlockMask (qkv.create_block_mask), got "
                f"{type(block_mask).__name__}"
            )
        if (block_mask.q_len, block_mask.kv_len) != (T, key.shape[2]):
            raise AttentionArgumentError(
                f"block_mask was made for Q_LEN={block_mask.q_len}, KV_LEN={block_mask.kv_len} "
                f"but the call has T={T}, S={key.shape[2]}"
            )
        b, h = block_mask.state.shape[:2]
        if b not in (1, B) or h not in (1, H):
            raise AttentionArgumentError(
                f"block_mask has B={b}, H={h}; the call has B={B}, H={H} (use 1 or the same)"
            )
