"""GPT-2 checkpoints in Hugging Face format -> :class:`qkv.models.DecoderLM` (GPT-2 style).

GPT-2 (Radford et al., 2019) is a pre-norm decoder with learned positions, LayerNorm, tanh-GELU
and tied input/output embeddings: exactly :meth:`DecoderLMConfig.gpt2_style`. Two quirks of the
checkpoint: its linear layers are ``Conv1D`` modules that store weights as ``(in, out)``
(transposed here to ``nn.Linear``'s ``(out, in)``), and the query, key and value projections
are one fused ``c_attn`` of width ``3·E`` (cut into three here):

    wte / wpe / ln_f                    -> embed / pos / norm_f
    h.{i}.ln_1 / ln_2                   -> blocks.{i}.attn_norm / ffn_norm
    h.{i}.attn.c_attn  (E, 3E)          -> blocks.{i}.self_attn.q_proj | k_proj | v_proj
    h.{i}.attn.c_proj  (E, E)           -> blocks.{i}.self_attn.out_proj
    h.{i}.mlp.c_fc / c_proj             -> blocks.{i}.ffn.linear1 / linear2

A ``transformer.`` prefix (``GPT2LMHeadModel``) is expected when the file has one; the
causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` of old checkpoints, and a tied
``lm_head.weight`` copy, are ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor

from qkv.models import DecoderLM, DecoderLMConfig
from qkv.pretrained.hf.common import hf_activation, hf_flag, token_id
from qkv.pretrained.weights import Entry, load_entries, transpose, with_prefix

__all__ = ["gpt2_config", "gpt2_entries", "gpt2_ignored", "load_gpt2_weights"]


def gpt2_config(hf: Mapping[str, Any], *, where: str) -> DecoderLMConfig:
    """A GPT-2-style :class:`DecoderLMConfig` from a GPT-2 ``config.json``.

    Raises:
        ValueError: options qkv does not reproduce (``scale_attn_by_inverse_layer_idx``,
            cross-attention, ``scale_attn_weights=False``), an unknown activation, a missing
            size.
    """
    for key, bad in (("scale_attn_by_inverse_layer_idx", True), ("add_cross_attention", True),
                     ("scale_attn_weights", False)):
        if hf.get(key, not bad) == bad:
            raise ValueError(f"{where}: GPT-2 option {key}={bad} is not supported")
    try:
        E = hf["n_embd"]
        return DecoderLMConfig.gpt2_style(
            hf["vocab_size"],
            d_model=E,
            num_layers=hf["n_layer"],
            num_heads=hf["n_head"],
            d_ff=hf.get("n_inner") or 4 * E,
            max_len=hf.get("n_positions", 1024),
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            activation=hf_activation(hf, "activation_function", where, default="gelu_new"),
            tie_embeddings=hf_flag(hf, "tie_word_embeddings", where, True),
            bos_id=token_id(hf, "bos_token_id"),
            eos_id=token_id(hf, "eos_token_id"),
            dropout=0.0,
        )
    except KeyError as err:
        raise ValueError(f"{where}: config.json has no {err.args[0]!r}") from err


def gpt2_ignored(c: DecoderLMConfig) -> Callable[[str], bool]:
    """Source names a GPT-2 checkpoint may hold that the model does not use: the causal-mask
    buffers of old checkpoints and, with tied embeddings, the ``lm_head.weight`` copy."""

    def ignored(name: str) -> bool:
        tied_copy = c.tie_embeddings and name == "lm_head.weight"
        return tied_copy or name.endswith((".attn.bias", ".attn.masked_bias"))

    return ignored


def gpt2_entries(c: DecoderLMConfig, names: Iterable[str]) -> list[Entry]:
    """The tensors a GPT-2-style :class:`DecoderLM` with config ``c`` needs, under GPT-2's
    names (with a ``transformer.`` prefix when ``names``, the file's tensor names, use one)."""
    prefix = "transformer." if any(k.startswith("transformer.") for k in names) else ""
    E, F, V = c.d_model, c.ffn_dim, c.vocab_size

    def same(src: str, dst: str, shape: tuple[int, ...]) -> Entry:
        return Entry(src, shape, ((dst, None),))

    def norm(src: str, dst: str) -> list[Entry]:
        return [same(f"{src}.weight", f"{dst}.weight", (E,)),
                same(f"{src}.bias", f"{dst}.bias", (E,))]

    def conv1d(src: str, dst: str, inp: int, out: int) -> list[Entry]:
        return [Entry(f"{src}.weight", (inp, out), ((f"{dst}.weight", transpose),)),
                same(f"{src}.bias", f"{dst}.bias", (out,))]

    def cut(j: int, weight: bool):  # the j-th E-wide third of c_attn (q, k, v)
        if weight:
            return lambda t: t[:, j * E:(j + 1) * E].t()  # (E, E) as (out, in)
        return lambda t: t[j * E:(j + 1) * E]  # (E,)

    embed_targets = [("embed.weight", None)]
    if c.tie_embeddings:
        embed_targets.append(("lm_head.weight", None))
    entries = [
        Entry("wte.weight", (V, E), tuple(embed_targets)),
        same("wpe.weight", "pos.weight", (c.max_len, E)),
        *norm("ln_f", "norm_f"),
    ]
    if not c.tie_embeddings:
        entries.append(same("lm_head.weight", "lm_head.weight", (V, E)))
    for i in range(c.num_layers):
        src, dst = f"h.{i}", f"blocks.{i}"
        qkv_names = ("q_proj", "k_proj", "v_proj")
        entries += [
            Entry(f"{src}.attn.c_attn.weight", (E, 3 * E), tuple(
                (f"{dst}.self_attn.{n}.weight", cut(j, True)) for j, n in enumerate(qkv_names))),
            Entry(f"{src}.attn.c_attn.bias", (3 * E,), tuple(
                (f"{dst}.self_attn.{n}.bias", cut(j, False)) for j, n in enumerate(qkv_names))),
            *conv1d(f"{src}.attn.c_proj", f"{dst}.self_attn.out_proj", E, E),
            *norm(f"{src}.ln_1", f"{dst}.attn_norm"),
            *norm(f"{src}.ln_2", f"{dst}.ffn_norm"),
            *conv1d(f"{src}.mlp.c_fc", f"{dst}.ffn.linear1", E, F),
            *conv1d(f"{src}.mlp.c_proj", f"{dst}.ffn.linear2", F, E),
        ]
    return with_prefix(entries, prefix, bare=("lm_head.weight",))


def load_gpt2_weights(model: DecoderLM, state: Mapping[str, Tensor], *, where: str) -> None:
    """Fill ``model`` from a GPT-2 state dict (strict; see :func:`load_entries`).

    Raises:
        ValueError: missing, unexpected or misshaped tensors, named.
    """
    c = model.config
    load_entries(model, state, gpt2_entries(c, state), where=where, ignore=gpt2_ignored(c))
