"""BERT checkpoints in Hugging Face format -> :class:`qkv.models.Encoder`.

BERT (Devlin et al., 2019) is a post-norm encoder: embeddings (word + learned position + token
type) through a LayerNorm, then blocks of self-attention and a GELU feed-forward, each summed
into the residual stream and normalised. qkv's :class:`~qkv.models.Encoder` has the same
layout, so loading is renaming:

    embeddings.word_embeddings / position_embeddings / token_type_embeddings / LayerNorm
        -> embed / pos / token_type / embed_norm
    encoder.layer.{i}.attention.self.query / key / value  -> blocks.{i}.self_attn.q/k/v_proj
    encoder.layer.{i}.attention.output.dense / LayerNorm  -> blocks.{i}.self_attn.out_proj,
                                                             blocks.{i}.attn_norm
    encoder.layer.{i}.intermediate.dense / output.dense   -> blocks.{i}.ffn.linear1 / linear2
    encoder.layer.{i}.output.LayerNorm                    -> blocks.{i}.ffn_norm

A ``bert.`` prefix (task models such as ``BertForMaskedLM``) is expected when present; the
pooler, task heads (``cls.*``) and the ``position_ids`` buffer are not part of an encoder and
are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor

from qkv.models import Encoder, EncoderConfig
from qkv.pretrained.hf.common import hf_activation, token_id
from qkv.pretrained.weights import Entry, load_entries, with_prefix

__all__ = ["bert_config", "bert_entries", "bert_ignored", "load_bert_weights"]

def bert_config(hf: Mapping[str, Any], *, where: str, pooling: str = "mean") -> EncoderConfig:
    """An :class:`EncoderConfig` from a BERT ``config.json``.

    Args:
        hf: the parsed ``config.json`` (``model_type`` ``"bert"``).
        where: the folder, for messages.
        pooling: ``"mean"`` or ``"cls"`` (from sentence-transformers' pooling config).

    Raises:
        ValueError: a setting qkv's encoder does not reproduce (relative position embeddings,
            an unknown activation), or a missing size.
    """
    kind = hf.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(
            f"{where}: position_embedding_type={kind!r} is not supported (only 'absolute')"
        )
    try:
        return EncoderConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            d_ff=hf["intermediate_size"],
            max_len=hf.get("max_position_embeddings", 512),
            type_vocab_size=hf.get("type_vocab_size", 2),
            dropout=0.0,  # inference: a loaded model is in eval mode anyway
            norm="post",
            activation=hf_activation(hf, "hidden_act", where),
            norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            positions="learned",
            pooling=pooling,
            pad_id=token_id(hf, "pad_token_id"),
        )
    except KeyError as err:
        raise ValueError(f"{where}: config.json has no {err.args[0]!r}") from err


def _ignored(name: str) -> bool:
    return name.removeprefix("bert.").startswith(("pooler.", "cls.")) or name.endswith(
        "position_ids"
    )


def bert_ignored(name: str) -> bool:
    """Source names a BERT checkpoint may hold that an encoder does not use."""
    return _ignored(name)


def bert_entries(c: EncoderConfig, names: Iterable[str]) -> list[Entry]:
    """The tensors an :class:`Encoder` with config ``c`` needs, under BERT's names (with a
    ``bert.`` prefix when ``names``, the file's tensor names, use one)."""
    prefix = "bert." if any(k.startswith("bert.") for k in names) else ""
    E, F = c.d_model, c.ffn_dim

    def same(src: str, dst: str, shape: tuple[int, ...]) -> Entry:
        return Entry(src, shape, ((dst, None),))

    def linear(src: str, dst: str, out: int, inp: int) -> list[Entry]:
        return [same(f"{src}.weight", f"{dst}.weight", (out, inp)),
                same(f"{src}.bias", f"{dst}.bias", (out,))]

    def norm(src: str, dst: str) -> list[Entry]:
        return [same(f"{src}.weight", f"{dst}.weight", (E,)),
                same(f"{src}.bias", f"{dst}.bias", (E,))]

    entries = [
        same("embeddings.word_embeddings.weight", "embed.weight", (c.vocab_size, E)),
        same("embeddings.position_embeddings.weight", "pos.weight", (c.max_len, E)),
        *norm("embeddings.LayerNorm", "embed_norm"),
    ]
    if c.type_vocab_size:
        entries.append(same(
            "embeddings.token_type_embeddings.weight", "token_type.weight",
            (c.type_vocab_size, E),
        ))
    for i in range(c.num_layers):
        src, dst = f"encoder.layer.{i}", f"blocks.{i}"
        for hf_name, qkv_name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            entries += linear(f"{src}.attention.self.{hf_name}", f"{dst}.self_attn.{qkv_name}",
                              E, E)
        entries += linear(f"{src}.attention.output.dense", f"{dst}.self_attn.out_proj", E, E)
        entries += norm(f"{src}.attention.output.LayerNorm", f"{dst}.attn_norm")
        entries += linear(f"{src}.intermediate.dense", f"{dst}.ffn.linear1", F, E)
        entries += linear(f"{src}.output.dense", f"{dst}.ffn.linear2", E, F)
        entries += norm(f"{src}.output.LayerNorm", f"{dst}.ffn_norm")
    return with_prefix(entries, prefix)


def load_bert_weights(model: Encoder, state: Mapping[str, Tensor], *, where: str) -> None:
    """Fill ``model`` from a BERT state dict (strict; see :func:`load_entries`).

    Raises:
        ValueError: missing, unexpected or misshaped tensors, named.
    """
    entries = bert_entries(model.config, state)
    load_entries(model, state, entries, where=where, ignore=bert_ignored)
