"""Llama-family checkpoints in Hugging Face format -> :class:`qkv.models.DecoderLM` (Llama style).

Llama (Touvron et al., 2023) is a pre-norm decoder with RMSNorm, rotary positions in the
rotate-half layout (qkv's :mod:`~qkv.nn.rope` uses the same one), a SwiGLU feed-forward,
grouped-query attention and no biases: :meth:`DecoderLMConfig.llama_style`. Names:

    model.embed_tokens / model.norm / lm_head          -> embed / norm_f / lm_head
    model.layers.{i}.self_attn.q/k/v/o_proj            -> blocks.{i}.self_attn.q/k/v/out_proj
    model.layers.{i}.mlp.gate/up/down_proj             -> blocks.{i}.ffn.gate/up/down_proj
    model.layers.{i}.input_layernorm                   -> blocks.{i}.attn_norm
    model.layers.{i}.post_attention_layernorm          -> blocks.{i}.ffn_norm

:func:`llama_entries` is shared with the GGUF loader, which passes llama.cpp's names and the
transform that undoes its permutation of the query/key rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from qkv.models import DecoderLM, DecoderLMConfig
from qkv.pretrained.hf_common import token_id
from qkv.pretrained.weights import Entry, Transform, load_entries

__all__ = [
    "HF_LLAMA_NAMES",
    "llama_config",
    "llama_entries",
    "llama_ignored",
    "load_llama_weights",
]

# Role -> source name ({i} = layer). The GGUF loader has its own table with the same roles.
HF_LLAMA_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm_f": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
}


def _rope_theta(hf: Mapping[str, Any], where: str) -> float:
    """RoPE base from ``rope_theta`` or (transformers >= 5) ``rope_parameters``; only plain
    RoPE is supported (no scaling)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for kind in (params.get("rope_type"), scaling.get("rope_type", scaling.get("type"))):
        if kind not in (None, "default"):
            raise ValueError(f"{where}: RoPE scaling {kind!r} is not supported (plain RoPE only)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def llama_config(hf: Mapping[str, Any], *, where: str) -> DecoderLMConfig:
    """A Llama-style :class:`DecoderLMConfig` from a Llama ``config.json``.

    Raises:
        ValueError: biases in attention or MLP, an activation other than SiLU, RoPE scaling,
            or a missing size.
    """
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{where}: Llama with attention_bias/mlp_bias is not supported")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{where}: hidden_act={hf.get('hidden_act')!r}; Llama SwiGLU needs 'silu'")
    try:
        H = hf["num_attention_heads"]
        return DecoderLMConfig.llama_style(
            hf["vocab_size"],
            d_model=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=H,
            num_kv_heads=hf.get("num_key_value_heads") or H,
            d_head=hf.get("head_dim"),
            d_ff=hf["intermediate_size"],
            max_len=hf.get("max_position_embeddings", 2048),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_base=_rope_theta(hf, where),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_id=token_id(hf, "bos_token_id"),
            eos_id=token_id(hf, "eos_token_id"),
            pad_id=token_id(hf, "pad_token_id"),
            dropout=0.0,
        )
    except KeyError as err:
        raise ValueError(f"{where}: config.json has no {err.args[0]!r}") from err


def llama_entries(
    c: DecoderLMConfig,
    names: Mapping[str, str],
    *,
    q_transform: Transform | None = None,
    k_transform: Transform | None = None,
) -> list[Entry]:
    """The tensors a Llama-style ``DecoderLM`` with config ``c`` needs, under ``names``."""
    E, F, V = c.d_model, c.ffn_dim, c.vocab_size
    H, Hkv, D = c.num_heads, c.num_kv_heads or c.num_heads, c.head_dim

    def entry(role: str, dst: str, shape: tuple[int, ...], i: int = 0,
              fn: Transform | None = None) -> Entry:
        return Entry(names[role].format(i=i), shape, ((dst, fn),))

    embed = ("embed.weight", None), *((("lm_head.weight", None),) if c.tie_embeddings else ())
    entries = [
        Entry(names["embed"], (V, E), tuple(embed)),
        entry("norm_f", "norm_f.weight", (E,)),
    ]
    if not c.tie_embeddings:
        entries.append(entry("lm_head", "lm_head.weight", (V, E)))
    for i in range(c.num_layers):
        b = f"blocks.{i}"
        entries += [
            entry("q", f"{b}.self_attn.q_proj.weight", (H * D, E), i, q_transform),
            entry("k", f"{b}.self_attn.k_proj.weight", (Hkv * D, E), i, k_transform),
            entry("v", f"{b}.self_attn.v_proj.weight", (Hkv * D, E), i),
            entry("o", f"{b}.self_attn.out_proj.weight", (E, H * D), i),
            entry("gate", f"{b}.ffn.gate_proj.weight", (F, E), i),
            entry("up", f"{b}.ffn.up_proj.weight", (F, E), i),
            entry("down", f"{b}.ffn.down_proj.weight", (E, F), i),
            entry("attn_norm", f"{b}.attn_norm.weight", (E,), i),
            entry("ffn_norm", f"{b}.ffn_norm.weight", (E,), i),
        ]
    return entries


def llama_ignored(c: DecoderLMConfig) -> Callable[[str], bool]:
    """Source names a Llama checkpoint may hold that the model does not use: cached
    ``rotary_emb.inv_freq`` buffers and, with tied embeddings, the ``lm_head.weight`` copy."""

    def ignored(name: str) -> bool:
        tied_copy = c.tie_embeddings and name == HF_LLAMA_NAMES["lm_head"]
        return tied_copy or name.endswith("rotary_emb.inv_freq")

    return ignored


def load_llama_weights(model: DecoderLM, state: Mapping[str, Tensor], *, where: str) -> None:
    """Fill ``model`` from a Llama state dict (strict; see :func:`load_entries`).

    Raises:
        ValueError: missing, unexpected or misshaped tensors, named.
    """
    c = model.config
    load_entries(model, state, llama_entries(c, HF_LLAMA_NAMES), where=where,
                 ignore=llama_ignored(c))  # fmt: skip
