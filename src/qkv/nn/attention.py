"""Multi-head attention as models use it: project, split heads, attend, merge, project.

    head_h = softmax(Q_h K_{g(h)}ᵀ / √D + bias + mask) V_{g(h)},   out = concat_h(head_h) W_o

(Vaswani et al., 2017), with ``g(h) = h // (H / Hkv)`` for grouped-query attention (Ainslie et
al., 2023; ``Hkv == H`` is ordinary multi-head, ``Hkv == 1`` multi-query). The module owns only
the four projections and its conventions (batch-first, bottom-right causal alignment with a
cache, ALiBi); what follows the projections (hook points, the kernel call, weights on request)
is the shared :class:`~qkv.nn.core.AttentionCore`.

Positions: an optional :class:`~qkv.nn.rope.RotaryEmbedding` rotates queries and keys (Su et
al., 2021) and ``alibi=True`` adds linear distance biases to the scores (Press et al., 2022);
both are for self-attention. With a :class:`~qkv.nn.cache.LayerKVCache` the new tokens are
placed after the cached ones: rotary positions start at the cached length, and the causal mask
and ALiBi are aligned bottom-right (the queries are the last ``T`` of the ``S`` keys).

Hook points (from :class:`~qkv.nn.core.AttentionCore`; read or replace intermediates, used by
:mod:`qkv.inspect`): ``hook_q (B, H, T, D)``, ``hook_k (B, Hkv, S, D)``, ``hook_v (B, Hkv, S,
Dv)`` after rotary positions and the cache (a replacement changes this call, not what the
cache holds); ``hook_inputs`` (the :class:`~qkv.nn.hooks.AttentionInputs` record);
``hook_scores`` and ``hook_weights`` ``(B, H, T, S)``, formed only while a hook listens (then
this layer runs the math backend); ``hook_out (B, H, T, Dv)``, the per-head outputs.

Options of today's models, each a constructor argument usable by any model: ``scale`` (the
factor on ``q·k``: T5 uses 1, Gemma 2 ``query_pre_attn_scalar**-0.5``), per-projection
biases (``qkv_bias``, ``k_bias``, ``out_bias`` over ``bias``: Qwen2 biases q/k/v only, Whisper
has no key bias), ``qk_norm`` (RMSNorm or LayerNorm over ``D`` of each query and key head,
before RoPE: Qwen3), ``window`` (a sliding causal window: Mistral, Gemma 2's local layers) and
``softcap`` (``cap·tanh(score/cap)`` on the scaled scores: Gemma 2). The window and the soft
cap travel in the :class:`~qkv.nn.hooks.AttentionInputs` record (``window``, and the cap as a
``score_mod``), so :mod:`qkv.inspect` rebuilds exact weights for them.

Programmable attention: ``forward(..., score_mod=, block_mask=)`` takes torch's FlexAttention
functions (:func:`qkv.flex_attention`, :func:`qkv.create_block_mask`, the ready ones in
:mod:`qkv.attention.mods`) and runs them on the blockwise kernel; ``mask``, ``is_causal``,
RoPE, ALiBi and the cache combine with them (see :mod:`qkv.nn.core`). They are call-time
arguments, not constructor ones: a function is not configuration.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkv.attention import masks
from qkv.attention.flex.blocks import BlockMask
from qkv.attention.score_mods import soft_cap
from qkv.checks import positive_int, values_unknown
from qkv.nn.alibi import alibi_bias, alibi_slopes
from qkv.nn.cache import LayerKVCache
from qkv.nn.core import AttentionCore
from qkv.nn.hooks import check_flex_args
from qkv.nn.linear import Linear
from qkv.nn.norms import make_norm
from qkv.nn.options import AttentionOptions
from qkv.nn.rope import RotaryEmbedding
from qkv.nn.static_cache import StaticLayerKVCache

__all__ = ["Attention"]


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _then(first: Callable, second: Callable) -> Callable:
    """One ``score_mod``: ``first``, then ``second``."""

    def both(score, b, h, q_idx, kv_idx):
        return second(first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    return both


class Attention(AttentionCore):
    """Batch-first multi-head attention with grouped-query heads, RoPE, ALiBi and a KV cache.

    Args:
        d_model: model width ``E`` (of the queries' input and of the output).
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` (default ``H``); ``H`` must be a multiple.
        d_head: head width ``D`` (default ``E / H``).
        d_context: width ``Ec`` of the cross-attention context (default ``E``).
        bias: biases in the four projections.
        dropout: dropout on the attention weights, applied in training mode only.
        rope: rotary embedding applied to queries and keys (self-attention only).
        qkv_bias: biases in ``q_proj``, ``k_proj`` and ``v_proj`` (None: follow ``bias``).
        k_bias: bias in ``k_proj`` alone (None: follow ``qkv_bias``, then ``bias``).
        out_bias: bias in ``out_proj`` (None: follow ``bias``).
        options: an :class:`~qkv.nn.options.AttentionOptions` (default: none set).
        **option_fields: its fields as keywords, replacing those of ``options``: ``alibi``
            and ``alibi_symmetric`` (ALiBi distance biases, causal or ``-|i - j|``;
            self-attention only), ``scale`` (the factor on ``q·k``, default ``1/sqrt(D)``),
            ``qk_norm`` (None, ``"rmsnorm"`` or ``"layernorm"``: each query and key head
            normalised over ``D`` by submodules ``q_norm``/``k_norm`` before RoPE: Qwen3) with
            ``norm_eps``, ``window`` (a sliding causal window ``w``, self-attention with
            ``is_causal``: query ``i`` sees ``i - w < j <= i``, bottom-right with a cache:
            Mistral) and ``softcap`` (``cap·tanh(score / cap)`` on the scaled scores before
            masking: Gemma 2; a ``score_mod`` on the flex path).

    Submodules ``q_proj (E -> H·D)``, ``k_proj (Ec -> Hkv·D)``, ``v_proj (Ec -> Hkv·D)`` and
    ``out_proj (H·D -> E)`` are ``nn.Linear`` (:class:`qkv.nn.linear.Linear`); head ``h``
    owns rows ``h·D .. (h+1)·D - 1`` of ``q_proj`` and columns ``h·D .. (h+1)·D - 1`` of
    ``out_proj``.

    Raises:
        ValueError: non-positive sizes, ``d_model % num_heads != 0`` without ``d_head``,
            ``num_heads % num_kv_heads != 0``, ``dropout`` outside ``[0, 1)``, a rope whose
            ``d_head`` differs, an invalid option (see ``AttentionOptions``).
        TypeError: ``rope`` that is not a ``RotaryEmbedding``, a bias override that is not a
            bool or None, an unknown option name.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        d_head: int | None = None,
        d_context: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rope: RotaryEmbedding | None = None,
        qkv_bias: bool | None = None,
        k_bias: bool | None = None,
        out_bias: bool | None = None,
        options: AttentionOptions | None = None,
        **option_fields,
    ) -> None:
        super().__init__()
        self.d_model = positive_int("d_model", d_model)
        self.num_heads = positive_int("num_heads", num_heads)
        self.num_kv_heads = positive_int(
            "num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads
        )
        if num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if d_head is None and d_model % num_heads:
            raise ValueError(
                f"d_model ({d_model}) must be divisible by num_heads ({num_heads}), or give "
                "d_head explicitly"
            )
        self.d_head = positive_int("d_head", d_model // num_heads if d_head is None else d_head)
        self.d_context = positive_int("d_context", d_model if d_context is None else d_context)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (
            0.0 <= dropout < 1.0
        ):
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        if rope is not None and not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be a RotaryEmbedding or None, got {type(rope).__name__}")
        if rope is not None and rope.d_head != self.d_head:
            raise ValueError(f"rope.d_head ({rope.d_head}) must equal d_head ({self.d_head})")
        self.rope = rope
        self.options = AttentionOptions.build(options, **option_fields)
        cap = self.options.softcap
        self._cap_mod = None if cap is None else soft_cap(cap)
        for name, flag in (("qkv_bias", qkv_bias), ("k_bias", k_bias), ("out_bias", out_bias)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool or None, got {flag!r}")
        in_bias = bias if qkv_bias is None else qkv_bias
        key_bias = in_bias if k_bias is None else k_bias

        H, Hkv, D = self.num_heads, self.num_kv_heads, self.d_head
        self.q_proj = Linear(d_model, H * D, bias=in_bias)
        self.k_proj = Linear(self.d_context, Hkv * D, bias=key_bias)
        self.v_proj = Linear(self.d_context, Hkv * D, bias=in_bias)
        self.out_proj = Linear(H * D, d_model, bias=bias if out_bias is None else out_bias)
        qk_norm, eps = self.options.qk_norm, self.options.norm_eps
        self.q_norm = None if qk_norm is None else make_norm(qk_norm, D, eps=eps)
        self.k_norm = None if qk_norm is None else make_norm(qk_norm, D, eps=eps)

    # The options, read where they act (AttentionOptions is the one record of them).
    alibi = property(lambda self: self.options.alibi)
    alibi_symmetric = property(lambda self: self.options.alibi_symmetric)
    scale = property(lambda self: self.options.scale)
    window = property(lambda self: self.options.window)
    softcap = property(lambda self: self.options.softcap)
    qk_norm = property(lambda self: self.options.qk_norm)

    def extra_repr(self) -> str:
        parts = [f"d_model={self.d_model}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        parts.append(f"d_head={self.d_head}")
        if self.d_context != self.d_model:
            parts.append(f"d_context={self.d_context}")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        return ", ".join(parts + self.options.described())

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        cache: LayerKVCache | StaticLayerKVCache | None = None,
        positions: Tensor | None = None,
        need_weights: bool = False,
        score_mod: Callable | None = None,
        block_mask: BlockMask | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` to itself (self-attention) or to ``context`` (cross-attention).

        Args:
            x: ``(B, T, E)`` queries' input.
            context: ``(B, S, Ec)`` keys' and values' input (cross-attention), or None for
                self-attention. Once ``cache`` holds static keys/values the context is not
                projected again; passing it still selects cross-attention.
            mask: boolean keep mask (True = may attend) or float mask added to the scores,
                broadcastable to ``(B, H, T, S)``; ``S`` counts the cached keys too.
            is_causal: hide keys after each query, aligned bottom-right (query ``i`` sees keys
                ``j <= i + S - T``), which is top-left when ``T == S``.
            cache: keys/values of earlier steps; self-attention appends to it, cross-attention
                stores the projected context once (``set_static``) and reuses it.
            positions: integer positions ``(T,)`` or ``(B, T)`` of the new tokens for RoPE
                (default: ``cache.length + arange(T)``); only rotary embeddings read them.
            need_weights: also return the attention weights.
            score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` on the scaled scores
                (:func:`qkv.flex_attention`), or None. ALiBi and ``mask`` apply after it.
            block_mask: a :class:`~qkv.attention.flex.blocks.BlockMask` for ``(T, S)``
                (:func:`qkv.create_block_mask` with ``B`` and ``H`` None, 1 or this call's),
                or None; ``is_causal`` is AND-ed into it. With ``score_mod`` or
                ``block_mask`` the call runs :func:`qkv.flex_attention` (dense when attention
                dropout is on in training, or a hook reads the scores or weights). With a
                ``softcap`` the cap comes first, then ``score_mod``.

        Returns:
            ``(out (B, T, E), weights (B, H, T, S))``, weights None unless ``need_weights``.
            Query rows with no visible key give zero weights and a zero attention output
            (``out`` is then ``out_proj``'s bias).

        Raises:
            TypeError: non-tensor inputs or masks, a cache that is not a ``LayerKVCache``.
            ValueError: wrong ranks or widths, a context batch different from ``x``'s, no
                context when ``d_context != d_model``, RoPE, ALiBi or a window with a context,
                a window without ``is_causal``, masks
                that do not broadcast, cache mismatches, a ``block_mask`` made for other
                lengths (``S`` counts cached keys), batch or heads.
        """
        self._check_inputs(x, context, cache)
        if self.window is not None and not is_causal:
            raise ValueError(
                f"this attention has a sliding window ({self.window}), which is causal: call it "
                "with is_causal=True (also for one new token after a cache)"
            )
        q = self._split(self.q_proj(x), self.num_heads)  # (B, H, T, D)
        if self.q_norm is not None:
            q = self.q_norm(q)  # (B, H, T, D)
        if context is None:
            q, k, v = self._self_keys(x, q, cache, positions)
            if getattr(cache, "paged", False):  # attention over the cache's pages
                return self.out_proj(self._merge(cache.attend(q, k, v, self.scale))), None
        else:
            k, v = self._cross_keys(context, cache, x.shape[0])
        B, H, T, S = q.shape[0], self.num_heads, q.shape[2], k.shape[2]
        if mask is not None and cache is not None and context is None:
            mask = cache.visible(mask, S)  # a rolling cache holds only the last S positions
        if self._cap_mod is not None:
            score_mod = self._cap_mod if score_mod is None else _then(self._cap_mod, score_mod)
        if mask is not None:
            # The one check of the user's mask (this is the public boundary).
            mask = masks.check_attn_mask(mask, (B, H, T, S), name="mask", dtype=x.dtype)
        check_flex_args(score_mod, block_mask, B, H, T, S)
        mask, causal_flag, slopes = self._mask(mask, is_causal, T, S, x)
        out, weights = self.attend(
            q, k, v, mask=mask, is_causal=causal_flag, alibi_slopes=slopes,
            dropout_p=self.dropout if self.training else 0.0, need_weights=need_weights,
            cross=context is not None, score_mod=score_mod, block_mask=block_mask,
            options=self.options,
        )  # (B, H, T, Dv)
        return self.out_proj(self._merge(out)), weights

    # --- helpers -----------------------------------------------------------------------------

    def _split(self, y: Tensor, heads: int) -> Tensor:
        """``(B, T, heads·D) -> (B, heads, T, D)``."""
        B, T, _ = y.shape
        return y.view(B, T, heads, self.d_head).transpose(1, 2)  # (B, heads, T, D)

    def _merge(self, out: Tensor) -> Tensor:
        """``(B, H, T, D) -> (B, T, H·D)``."""
        B, H, T, D = out.shape
        out = out.transpose(1, 2)  # (B, T, H, D)
        if values_unknown(out):
            # Traced: ONNX export's decompositions can lay the kernel's output out differently
            # from what the trace recorded, so the copy is made explicit.
            out = out.clone(memory_format=torch.contiguous_format)
        return out.reshape(B, T, H * D)  # (B, T, H·D)

    def _self_keys(
        self, x: Tensor, q: Tensor, cache: LayerKVCache | None, positions: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Project ``x`` to keys/values, rotate q and k, append to the cache."""
        k = self._split(self.k_proj(x), self.num_kv_heads)  # (B, Hkv, T, D)
        v = self._split(self.v_proj(x), self.num_kv_heads)  # (B, Hkv, T, D)
        if self.k_norm is not None:
            k = self.k_norm(k)  # (B, Hkv, T, D)
        if getattr(cache, "rebased", False):
            return self._rebased_keys(q, k, v, cache, positions)
        if getattr(cache, "paged", False):  # new keys only: the paged cache attends itself
            if self.rope is not None:
                q = self.rope(q, positions=positions)  # (B, H, T, D)
                k = self.rope(k, positions=positions)  # (B, Hkv, T, D)
            return q, k, v
        if self.rope is not None:
            offset = 0 if cache is None or positions is not None else cache.length
            q = self.rope(q, offset=offset, positions=positions)  # (B, H, T, D)
            k = self.rope(k, offset=offset, positions=positions)  # (B, Hkv, T, D)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, Hkv, S, D) with S = cached + T
        return q, k, v

    def _rebased_keys(self, q: Tensor, k: Tensor, v: Tensor, cache, positions: Tensor | None
                      ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """A cache that re-bases positions (:mod:`qkv.nn.sink_cache`): it holds unrotated
        keys; the held ones are rotated at their places ``0 .. S-1``, the new queries after
        the held ones."""
        if positions is not None:
            raise ValueError("a sink cache numbers positions itself (0 .. held); rows must "
                             "not be padded and positions= must be None")  # fmt: skip
        held = cache.held
        k, v = cache.update(k, v)  # (B, Hkv, S, D), unrotated
        if self.rope is not None:
            q = self.rope(q, offset=held)  # (B, H, T, D) at held .. held + T - 1
            k = self.rope(k, offset=0)  # (B, Hkv, S, D) at 0 .. S - 1
        return q, k, v

    def _cross_keys(
        self, context: Tensor, cache: LayerKVCache | None, batch: int
    ) -> tuple[Tensor, Tensor]:
        """Keys/values of the context, projected once per cache."""
        if cache is not None and cache.static is not None:
            k, v = cache.static  # (B, Hkv, S, D) each, projected at an earlier step
            if k.shape[0] != batch:
                raise ValueError(
                    f"the cache's static keys have batch size {k.shape[0]} but x has {batch}; "
                    "reorder() the cache or reset() it for a new batch"
                )
            return k, v
        k = self._split(self.k_proj(context), self.num_kv_heads)  # (B, Hkv, S, D)
        v = self._split(self.v_proj(context), self.num_kv_heads)  # (B, Hkv, S, D)
        if self.k_norm is not None:
            k = self.k_norm(k)  # (B, Hkv, S, D)
        if cache is not None:
            cache.set_static(k, v)
        return k, v

    def _mask(
        self, mask: Tensor | None, is_causal: bool, T: int, S: int, x: Tensor
    ) -> tuple[Tensor | None, bool | str, Tensor | None]:
        """Causality and ALiBi as SDPA arguments: ``(mask, is_causal, alibi_slopes)``.

        Causality goes to SDPA as ``"bottom-right"`` (equal to ``True`` when ``T == S``, the
        fused kernel's causal path) and ALiBi as slopes, so neither is materialised as a
        ``(T, S)`` mask: the flash backend computes them per tile. The one exception is causal
        ALiBi distances without causal masking (future keys get a *positive* bias), which
        SDPA's symmetric ALiBi does not express: that bias is built densely.
        """
        flag: bool | str = False
        if is_causal:
            flag = True if T == S else "bottom-right"
        if not self.alibi:
            return mask, flag, None
        if self.alibi_symmetric or is_causal:
            slopes = alibi_slopes(self.num_heads, device=x.device)  # (H,)
            return mask, flag, slopes
        # At least float32: half-precision distances round badly and overflow at long T (the
        # kernels accumulate half inputs in float32 and take a float32 mask as it is).
        dtype = torch.promote_types(x.dtype, torch.float32)
        bias = alibi_bias(self.num_heads, T, S, device=x.device, dtype=dtype)  # (H, T, S)
        # The bias goes first so the combined float mask keeps its dtype.
        return masks.combine(bias[None], mask), flag, None  # (B|1, H, T, S)

    def _check_inputs(self, x: object, context: object, cache: object) -> None:
        """Fail early, naming the argument, instead of deep inside a Linear or SDPA."""
        self._check_tensor("x", x, self.d_model, "E")
        assert isinstance(x, Tensor)
        if context is None and self.d_context != self.d_model:
            raise ValueError(
                f"self-attention (context=None) projects x to keys, but d_context "
                f"({self.d_context}) != d_model ({self.d_model}); pass a context of width "
                f"{self.d_context}"
            )
        if context is not None:
            self._check_tensor("context", context, self.d_context, "Ec")
            assert isinstance(context, Tensor)
            fresh = cache is None or getattr(cache, "static", None) is None
            if fresh and context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"context batch size {context.shape[0]} (shape {_shape(context)}) must "
                    f"equal x's {x.shape[0]} (shape {_shape(x)})"
                )
            if self.rope is not None or self.alibi or self.window is not None:
                raise ValueError(
                    "rope, alibi and a sliding window work on positions within one sequence; "
                    "this module has one, so it cannot be called with a context "
                    "(cross-attention)"
                )
        if cache is not None and not isinstance(cache, LayerKVCache | StaticLayerKVCache):
            raise TypeError(
                f"cache must be a LayerKVCache (e.g. kv_cache[layer]) or None, got "
                f"{type(cache).__name__}"
            )

    def _check_tensor(self, name: str, t: object, width: int, symbol: str) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or t.shape[-1] != width:
            raise ValueError(
                f"{name} must have shape (B, {'T' if name == 'x' else 'S'}, {symbol}={width}), "
                f"got {_shape(t)}"
            )
        # A weight-only quantised projection (qkv.nn.quantized) computes in weight_dtype.
        dtype = getattr(self.q_proj, "weight_dtype", None) or self.q_proj.weight.dtype
        if t.dtype != dtype and not torch.is_autocast_enabled(t.device.type):
            raise TypeError(
                f"{name} has dtype {t.dtype} but the module's parameters are {dtype}; "
                f"cast one of them (module.to({t.dtype}) or {name}.to({dtype}))"
            )
