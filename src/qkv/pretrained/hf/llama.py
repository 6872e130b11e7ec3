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
transform that undoes its permutation of the query/key rows, and with the other Llama-like
families (:mod:`qkv.pretrained.hf.decoders`): a config with attention biases, query/key norms
or sandwich norms reads those tensors too (roles ``q_bias`` .. ``o_bias``, ``q_norm``,
``k_norm``, ``attn_out_norm``, ``ffn_out_norm``), and a name table with a fused ``qkv`` or
``gate_up`` role splits it (Phi-3).

:func:`llama_config` reads Llama 3's ``rope_scaling`` (and linear, dynamic NTK, YaRN; the old
``rope_scaling`` key and transformers 5's ``rope_parameters`` alike), ``attention_bias`` (q, k,
v and o biases), ``partial_rotary_factor`` and sliding windows (:func:`hf_windows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from qkv.models import DecoderLM, DecoderLMConfig
from qkv.pretrained.hf.common import hf_flag, token_id
from qkv.pretrained.weights import Entry, Transform, load_entries

__all__ = [
    "HF_LLAMA_NAMES",
    "hf_windows",
    "llama_config",
    "llama_entries",
    "llama_ignored",
    "load_llama_weights",
    "rope_settings",
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
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o_bias": "model.layers.{i}.self_attn.o_proj.bias",
}

# transformers' rope_type -> qkv's RopeScaling kind, and its parameter names -> qkv's.
_ROPE_KINDS = {"linear": "linear", "dynamic": "dynamic", "llama3": "llama3", "yarn": "yarn"}
_ROPE_PARAMS = {
    "factor": "factor", "original_max_position_embeddings": "original_max_len",
    "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor": "attention_factor",
    "truncate": "truncate",
}
_ROPE_IGNORED = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mscale",
                 "mscale_all_dim"}  # fmt: skip


def rope_settings(hf: Mapping[str, Any], where: str, d_head: int) -> dict[str, Any]:
    """``rope_base``, ``rope_scaling`` and ``rope_dim`` for :class:`DecoderLMConfig` from
    ``rope_theta`` / ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5), and
    ``partial_rotary_factor`` (top level or among the RoPE parameters).

    Raises:
        ValueError: a scaling qkv does not have (``longrope``, ...), a parameter it does not
            know, or a partial rotary factor that gives no even width.
    """
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type"))
    base = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    out: dict[str, Any] = {"rope_base": base, "rope_scaling": None, "rope_dim": None}
    if kind not in (None, "default"):
        if kind not in _ROPE_KINDS:
            raise ValueError(f"{where}: RoPE scaling {kind!r} is not supported; known: "
                             f"{sorted(_ROPE_KINDS)} (and plain RoPE)")  # fmt: skip
        unknown = sorted(set(params) - set(_ROPE_PARAMS) - _ROPE_IGNORED)
        mscale = params.get("mscale") or params.get("mscale_all_dim")
        if unknown or (mscale and params.get("attention_factor") is None):
            raise ValueError(f"{where}: RoPE scaling parameters {unknown or ['mscale']} are not "
                             f"supported for {kind!r}")  # fmt: skip
        scaling = {_ROPE_PARAMS[k]: v for k, v in params.items() if k in _ROPE_PARAMS}
        # transformers' conventions: dynamic NTK scales from max_position_embeddings; llama3
        # and YaRN name their training length, or fall back to it.
        original = hf.get("max_position_embeddings")
        if kind == "dynamic" or scaling.get("original_max_len") is None:
            scaling["original_max_len"] = original
        if kind == "yarn" and scaling.get("factor") is None and original:
            scaling["factor"] = original / scaling["original_max_len"]
        for key in ("beta_fast", "beta_slow", "attention_factor", "factor"):
            if scaling.get(key) is None or (key.startswith("beta") and not scaling[key]):
                scaling.pop(key, None)  # None (or a zero beta) means the default
        out["rope_scaling"] = {"kind": _ROPE_KINDS[kind], **scaling}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        dim = int(d_head * float(partial))
        if dim < 2 or dim % 2:
            raise ValueError(f"{where}: partial_rotary_factor={partial} gives a rotary width of "
                             f"{dim} for head width {d_head}; expected an even width >= 2")
        out["rope_dim"] = dim
    return out


def hf_windows(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """``window`` or ``layer_windows`` for :class:`DecoderLMConfig`: ``layer_types`` (one
    ``"sliding_attention"`` or ``"full_attention"`` per layer) with ``sliding_window``, or
    ``sliding_window`` alone for every layer (Mistral, Phi-3); ``{}`` without a window."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if window is None:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        # (transformers refuses 0 for some families and accepts it for others; a window of no
        # key is never a model)
        raise ValueError(f"sliding_window must be a positive int or null, got {window!r}")
    if isinstance(types, list) and len(types) == num_layers:
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        return {"layer_windows": windows} if any(windows) else {}
    if hf.get("use_sliding_window") is False:
        return {}
    return {"window": window}


def llama_config(hf: Mapping[str, Any], *, where: str, **options: Any) -> DecoderLMConfig:
    """A Llama-style :class:`DecoderLMConfig` from a Llama ``config.json``.

    Also the base of the Llama-like families (:mod:`qkv.pretrained.hf.decoders`), which pass
    their own ``options`` (DecoderLMConfig fields) over the ones read here.

    Raises:
        ValueError: MLP biases, an activation other than SiLU (unless ``options`` set one),
            an unsupported RoPE scaling, or a missing size.
    """
    if hf_flag(hf, "mlp_bias", where, False):
        raise ValueError(f"{where}: mlp_bias=True is not supported (biases in the feed-forward)")
    if "activation" not in options and hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{where}: hidden_act={hf.get('hidden_act')!r}; Llama SwiGLU needs 'silu'")
    try:
        H = hf["num_attention_heads"]
        L = hf["num_hidden_layers"]
        D = hf.get("head_dim") or hf["hidden_size"] // H
        fields: dict[str, Any] = dict(
            d_model=hf["hidden_size"],
            num_layers=L,
            num_heads=H,
            num_kv_heads=hf.get("num_key_value_heads") or H,
            d_head=hf.get("head_dim"),
            d_ff=hf["intermediate_size"],
            max_len=hf.get("max_position_embeddings", 2048),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=hf_flag(hf, "tie_word_embeddings", where, False),
            bos_id=token_id(hf, "bos_token_id"),
            eos_id=token_id(hf, "eos_token_id"),
            pad_id=token_id(hf, "pad_token_id"),
            dropout=0.0,
            **rope_settings(hf, where, D),
            **hf_windows(hf, L),
        )
        if hf_flag(hf, "attention_bias", where, False):
            fields.update(qkv_bias=True, out_bias=True)
        scaling = fields["rope_scaling"]
        if scaling is not None and scaling["kind"] == "dynamic":
            # Dynamic NTK scales max_position_embeddings by up to its factor: the model's
            # length limit is the scaled one.
            fields["max_len"] = math.ceil(fields["max_len"] * scaling.get("factor", 1.0))
        return DecoderLMConfig.llama_style(hf["vocab_size"], **{**fields, **options})
    except KeyError as err:
        raise ValueError(f"{where}: config.json has no {err.args[0]!r}") from None


def _rows(start: int, stop: int) -> Transform:
    """Rows ``start .. stop - 1`` of a fused matrix."""
    return lambda t: t[start:stop]  # (stop - start, E)


def llama_entries(
    c: DecoderLMConfig,
    names: Mapping[str, str],
    *,
    q_transform: Transform | None = None,
    k_transform: Transform | None = None,
    norm_transform: Transform | None = None,
) -> list[Entry]:
    """The tensors a Llama-style ``DecoderLM`` with config ``c`` needs, under ``names``.

    ``norm_transform`` maps every norm weight as stored to qkv's (Gemma stores ``w`` for a
    norm that multiplies by ``1 + w``); fused ``qkv`` / ``gate_up`` roles in ``names`` are split
    by rows (q, k, v; gate, up).
    """
    E, F, V = c.d_model, c.ffn_dim, c.vocab_size
    H, Hkv, D = c.num_heads, c.num_kv_heads or c.num_heads, c.head_dim
    in_bias = c.bias if c.qkv_bias is None else c.qkv_bias
    biases = {"q": in_bias, "k": in_bias if c.k_bias is None else c.k_bias, "v": in_bias,
              "o": c.bias if c.out_bias is None else c.out_bias}  # fmt: skip

    def entry(role: str, dst: str, shape: tuple[int, ...], i: int = 0,
              fn: Transform | None = None) -> Entry:
        return Entry(names[role].format(i=i), shape, ((dst, fn),))

    embed = ("embed.weight", None), *((("lm_head.weight", None),) if c.tie_embeddings else ())
    entries = [
        Entry(names["embed"], (V, E), tuple(embed)),
        entry("norm_f", "norm_f.weight", (E,), 0, norm_transform),
    ]
    if not c.tie_embeddings:
        entries.append(entry("lm_head", "lm_head.weight", (V, E)))
    for i in range(c.num_layers):
        b, a = f"blocks.{i}", f"blocks.{i}.self_attn"
        if "qkv" in names:  # one fused projection: rows q, then k, then v
            q, k = H * D, H * D + Hkv * D
            entries.append(Entry(names["qkv"].format(i=i), (k + Hkv * D, E), (
                (f"{a}.q_proj.weight", _rows(0, q)), (f"{a}.k_proj.weight", _rows(q, k)),
                (f"{a}.v_proj.weight", _rows(k, k + Hkv * D)))))  # fmt: skip
        else:
            entries += [
                entry("q", f"{a}.q_proj.weight", (H * D, E), i, q_transform),
                entry("k", f"{a}.k_proj.weight", (Hkv * D, E), i, k_transform),
                entry("v", f"{a}.v_proj.weight", (Hkv * D, E), i),
            ]
        entries.append(entry("o", f"{a}.out_proj.weight", (E, H * D), i))
        for role, width in (("q", H * D), ("k", Hkv * D), ("v", Hkv * D), ("o", E)):
            if biases[role]:
                proj = "out_proj" if role == "o" else f"{role}_proj"
                entries.append(entry(f"{role}_bias", f"{a}.{proj}.bias", (width,), i))
        if c.qk_norm is not None:
            entries += [entry("q_norm", f"{a}.q_norm.weight", (D,), i, norm_transform),
                        entry("k_norm", f"{a}.k_norm.weight", (D,), i, norm_transform)]
        if "gate_up" in names:  # one fused projection: rows gate, then up
            entries.append(Entry(names["gate_up"].format(i=i), (2 * F, E), (
                (f"{b}.ffn.gate_proj.weight", _rows(0, F)),
                (f"{b}.ffn.up_proj.weight", _rows(F, 2 * F)))))  # fmt: skip
        else:
            entries += [entry("gate", f"{b}.ffn.gate_proj.weight", (F, E), i),
                        entry("up", f"{b}.ffn.up_proj.weight", (F, E), i)]
        entries.append(entry("down", f"{b}.ffn.down_proj.weight", (E, F), i))
        norms = ["attn_norm", "ffn_norm"]
        if c.sandwich_norm:
            norms += ["attn_out_norm", "ffn_out_norm"]
        entries += [entry(n, f"{b}.{n}.weight", (E,), i, norm_transform) for n in norms]
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
