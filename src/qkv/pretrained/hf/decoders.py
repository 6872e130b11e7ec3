"""Today's Llama-like decoders in Hugging Face format -> :class:`qkv.models.DecoderLM`.

Each family is Llama (:mod:`qkv.pretrained.hf.llama`) plus a few quirks, and every quirk is a
generic :class:`~qkv.models.DecoderLMConfig` option; this module only maps names and
``config.json`` keys:

=========  ==============================================================================
family     quirks, as qkv options
=========  ==============================================================================
mistral    ``sliding_window`` -> ``window`` (a rolling KV cache in generation)
qwen2      q/k/v biases, none on o -> ``qkv_bias=True, out_bias=False``;
           ``layer_types`` windows when ``use_sliding_window``
qwen3      per-head RMSNorm of queries and keys -> ``qk_norm="rmsnorm"``
           (``q_norm`` / ``k_norm``)
gemma2     ``attn_logit_softcapping`` / ``final_logit_softcapping`` -> ``attn_softcap`` /
           ``logit_softcap``; alternating local/global layers (``layer_types``) ->
           ``layer_windows``; norms around each sublayer -> ``sandwich_norm``;
           ``query_pre_attn_scalar`` -> ``attn_scale``; embeddings times ``sqrt(E)`` ->
           ``embed_scale``; GELU-tanh gated MLP -> ``"geglu"``; RMSNorm ``x·(1 + w)`` ->
           ``1 + w`` added to each norm weight at load time (exact)
phi3       fused ``qkv_proj`` and ``gate_up_proj`` split by rows at load time;
           ``partial_rotary_factor`` -> ``rope_dim``; ``sliding_window`` -> ``window``
=========  ==============================================================================

Every family also gets what :func:`~qkv.pretrained.hf.llama.llama_config` reads: RoPE scaling
(``llama3``, ``linear``, ``dynamic``, ``yarn``), ``attention_bias``, ``head_dim``, GQA.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qkv.models import DecoderLMConfig
from qkv.pretrained.hf.common import hf_flag
from qkv.pretrained.hf.llama import HF_LLAMA_NAMES, llama_config, llama_entries
from qkv.pretrained.weights import Entry, Transform

__all__ = ["HF_DECODERS", "DecoderFamily"]


def _layer(name: str) -> str:
    return "model.layers.{i}." + name


_QWEN3_NAMES = {
    **HF_LLAMA_NAMES,
    "q_norm": _layer("self_attn.q_norm.weight"),
    "k_norm": _layer("self_attn.k_norm.weight"),
}
_GEMMA2_NAMES = {
    **HF_LLAMA_NAMES,
    "attn_out_norm": _layer("post_attention_layernorm.weight"),
    "ffn_norm": _layer("pre_feedforward_layernorm.weight"),
    "ffn_out_norm": _layer("post_feedforward_layernorm.weight"),
}
_PHI3_NAMES = {
    **{k: v for k, v in HF_LLAMA_NAMES.items() if k not in ("q", "k", "v", "gate", "up")},
    "qkv": _layer("self_attn.qkv_proj.weight"),
    "gate_up": _layer("mlp.gate_up_proj.weight"),
}


def _one_plus(t):  # Gemma's RMSNorm multiplies by (1 + w): qkv's weight is 1 + w
    return t + 1.0


@dataclass(frozen=True)
class DecoderFamily:
    """One ``model_type``: its tensor names, its options, its norm weights' convention.

    Attributes:
        names: role -> tensor name (``{i}`` = layer), the roles of
            :func:`~qkv.pretrained.hf.llama.llama_entries`.
        options: ``(config.json, where) -> DecoderLMConfig fields`` over Llama's reading.
        norm_transform: stored norm weight -> qkv's, or None.
    """

    names: Mapping[str, str]
    options: Callable[[Mapping[str, Any], str], dict[str, Any]] = field(
        default=lambda hf, where: {}
    )
    norm_transform: Transform | None = None

    def config(self, hf: Mapping[str, Any], *, where: str) -> DecoderLMConfig:
        """The :class:`DecoderLMConfig` of ``config.json``.

        Raises:
            ValueError: an option qkv does not have, or a missing size (named with ``where``).
        """
        return llama_config(hf, where=where, **self.options(hf, where))

    def entries(self, c: DecoderLMConfig) -> list[Entry]:
        """The tensors a model with config ``c`` reads, under this family's names."""
        return llama_entries(c, self.names, norm_transform=self.norm_transform)

    def ignored(self, c: DecoderLMConfig) -> Callable[[str], bool]:
        """Names a folder may hold that the model does not use: cached RoPE frequencies and,
        with tied embeddings, the ``lm_head.weight`` copy."""

        def ignored(name: str) -> bool:
            tied_copy = c.tie_embeddings and name == self.names["lm_head"]
            return tied_copy or name.endswith("rotary_emb.inv_freq")

        return ignored


def _gated(hf: Mapping[str, Any], where: str, key: str, default: str) -> str:
    """The gated feed-forward kind of ``hf[key]``: SiLU -> swiglu, GELU-tanh -> geglu."""
    name = hf.get(key) or default
    kinds = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu",
             "gelu_new": "geglu"}  # fmt: skip
    if name not in kinds:
        raise ValueError(f"{where}: {key}={name!r} is not supported for a gated feed-forward; "
                         f"known: {sorted(kinds)}")  # fmt: skip
    return kinds[name]


def _old_layer_windows(hf: Mapping[str, Any], sliding: Callable[[int], bool]) -> dict[str, Any]:
    """Per-layer windows for a ``config.json`` written before ``layer_types`` existed
    (transformers < 4.53), where the family's code chose the sliding layers."""
    window, L = hf.get("sliding_window"), hf.get("num_hidden_layers")
    if "layer_types" in hf or window is None or not isinstance(L, int):
        return {}
    return {"layer_windows": tuple(window if sliding(i) else None for i in range(L)),
            "window": None}  # fmt: skip


def _qwen_windows(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Older Qwen files: layers from ``max_window_layers`` on slide, when
    ``use_sliding_window``."""
    first = hf.get("max_window_layers", 0)
    old = _old_layer_windows(hf, lambda i: bool(hf.get("use_sliding_window")) and i >= first)
    return {"window": None} if old and not any(old["layer_windows"]) else old


def _qwen2(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {"qkv_bias": True, "out_bias": False, **_qwen_windows(hf)}


def _qwen3(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {"qk_norm": "rmsnorm", **_qwen_windows(hf)}


def _gemma2(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    E = hf.get("hidden_size")
    scalar = hf.get("query_pre_attn_scalar")
    if not isinstance(E, int) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"{where}: Gemma 2 needs hidden_size and a positive "
                         f"query_pre_attn_scalar, got {E!r} and {scalar!r}")  # fmt: skip
    fallback = hf.get("hidden_act") or "gelu_pytorch_tanh"
    return {
        "activation": _gated(hf, where, "hidden_activation", fallback),
        "sandwich_norm": True,
        "attn_scale": float(scalar) ** -0.5,
        "attn_softcap": hf.get("attn_logit_softcapping"),
        "logit_softcap": hf.get("final_logit_softcapping"),
        "embed_scale": math.sqrt(E),
        "tie_embeddings": hf_flag(hf, "tie_word_embeddings", where, True),
        # Older files: even layers are local (sliding), odd ones global.
        **_old_layer_windows(hf, lambda i: i % 2 == 0),
    }


def _phi3(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {"activation": _gated(hf, where, "hidden_act", "silu")}


HF_DECODERS: dict[str, DecoderFamily] = {
    "mistral": DecoderFamily(HF_LLAMA_NAMES),
    "qwen2": DecoderFamily(HF_LLAMA_NAMES, _qwen2),
    "qwen3": DecoderFamily(_QWEN3_NAMES, _qwen3),
    "gemma2": DecoderFamily(_GEMMA2_NAMES, _gemma2, _one_plus),
    "phi3": DecoderFamily(_PHI3_NAMES, _phi3),
}
