"""BART checkpoints in Hugging Face format -> :class:`qkv.models.Seq2SeqTransformer`.

BART (Lewis et al., 2020) is a post-norm encoder-decoder with GELU feed-forwards, learned
positions whose table starts at row 2, a LayerNorm on the embeddings of each stack, no
embedding scale (``scale_embedding`` false in the released models), one embedding shared by
encoder, decoder and output, and a ``final_logits_bias``. Each is a generic option of
:class:`~qkv.models.Seq2SeqConfig` (``position_offset=2``, ``embed_norm=True``,
``embed_scale=1.0``, ``output_bias=True``); decoding starts from
``decoder_start_token_id`` (BART's EOS, id 2). Names (Marian uses the same ones, less the
position tables and embedding norms; :func:`bart_family_entries` serves both):

    model.shared                                       -> src_embed, tgt_embed (, lm_head)
    final_logits_bias                                  -> lm_head.bias
    model.{encoder,decoder}.embed_positions            -> src_pos / tgt_pos
    model.{encoder,decoder}.layernorm_embedding        -> src_embed_norm / tgt_embed_norm
    model.encoder.layers.{i}.self_attn.{q,k,v,out}_proj -> encoder_blocks.{i}.self_attn.*
    model.encoder.layers.{i}.self_attn_layer_norm      -> encoder_blocks.{i}.attn_norm
    model.encoder.layers.{i}.fc1 / fc2                 -> encoder_blocks.{i}.ffn.linear1 / linear2
    model.encoder.layers.{i}.final_layer_norm          -> encoder_blocks.{i}.ffn_norm
    model.decoder.layers.{i}.encoder_attn(_layer_norm) -> decoder_blocks.{i}.cross_attn / cross_norm

Copies of the tied embedding some files also store (``model.encoder.embed_tokens``,
``model.decoder.embed_tokens``, ``lm_head``) are not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from qkv.models import Seq2SeqConfig
from qkv.pretrained.hf.common import hf_activation, hf_flag, pad_token_id, token_id
from qkv.pretrained.weights import Entry

__all__ = ["bart_config", "bart_entries", "bart_family_entries", "bart_ignored", "same_sizes"]

_TIED_COPIES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                "lm_head.weight")  # fmt: skip


def same_sizes(hf: Mapping[str, Any], where: str, pairs: Iterable[tuple[str, str]]) -> None:
    """Encoder and decoder sizes qkv's one ``num_heads`` / ``d_ff`` must hold equal.

    Raises:
        ValueError: naming both keys and their values.
    """
    for enc, dec in pairs:
        if enc in hf and dec in hf and hf[enc] != hf[dec]:
            raise ValueError(f"{where}: {enc}={hf[enc]!r} and {dec}={hf[dec]!r} differ; qkv's "
                             "encoder and decoder share one value")  # fmt: skip


def family_config(hf: Mapping[str, Any], *, where: str, **options: Any) -> Seq2SeqConfig:
    """The :class:`Seq2SeqConfig` fields BART and Marian share, plus ``options``.

    Raises:
        ValueError: different encoder/decoder heads or widths, an unknown activation, a
            missing size (named with ``where``).
    """
    same_sizes(hf, where, (("encoder_attention_heads", "decoder_attention_heads"),
                           ("encoder_ffn_dim", "decoder_ffn_dim")))  # fmt: skip
    try:
        V = hf["vocab_size"]
        return Seq2SeqConfig(
            src_vocab_size=V,
            tgt_vocab_size=V,
            d_model=hf["d_model"],
            num_heads=hf["encoder_attention_heads"],
            num_encoder_layers=hf["encoder_layers"],
            num_decoder_layers=hf["decoder_layers"],
            d_ff=hf["encoder_ffn_dim"],
            dropout=0.0,  # inference: a loaded model is in eval mode anyway
            max_len=hf.get("max_position_embeddings", 1024),
            norm="post",
            activation=hf_activation(hf, "activation_function", where),
            share_embeddings=True,
            tie_embeddings=hf_flag(hf, "tie_word_embeddings", where, True),
            pad_id=pad_token_id(hf, where),
            bos_id=token_id(hf, "decoder_start_token_id"),
            eos_id=token_id(hf, "eos_token_id"),
            norm_eps=1e-5,
            embed_scale=None if hf_flag(hf, "scale_embedding", where, False) else 1.0,
            output_bias=True,
            **options,
        )
    except KeyError as err:
        raise ValueError(f"{where}: config.json has no {err.args[0]!r}") from err


def bart_config(hf: Mapping[str, Any], *, where: str) -> Seq2SeqConfig:
    """A :class:`Seq2SeqConfig` from a BART ``config.json``.

    Raises:
        ValueError: a setting qkv does not reproduce (pre-norm BART variants), different
            encoder/decoder sizes, an unknown activation, a missing size.
    """
    for key in ("normalize_before", "add_final_layer_norm"):
        if hf_flag(hf, key, where, False):
            raise ValueError(f"{where}: {key}=true (an mBART-style pre-norm layout) is not "
                             "supported for model_type 'bart'")  # fmt: skip
    return family_config(hf, where=where, positions="learned", position_offset=2,
                         embed_norm=True)  # fmt: skip


def bart_family_entries(c: Seq2SeqConfig, *, positions: bool, embed_norm: bool) -> list[Entry]:
    """The tensors a BART-family model (BART, Marian) with config ``c`` needs.

    Args:
        c: the config.
        positions: the file stores learned position tables (BART).
        embed_norm: the file stores embedding LayerNorms (BART).
    """
    E, F, V = c.d_model, c.d_ff, c.tgt_vocab_size
    inner = c.num_heads * c.head_width

    def same(src: str, dst: str | tuple[str, ...], shape: tuple[int, ...]) -> Entry:
        targets = (dst,) if isinstance(dst, str) else dst
        return Entry(src, shape, tuple((t, None) for t in targets))

    def linear(src: str, dst: str, out: int, inp: int) -> list[Entry]:
        return [same(f"{src}.weight", f"{dst}.weight", (out, inp)),
                same(f"{src}.bias", f"{dst}.bias", (out,))]  # fmt: skip

    def norm(src: str, dst: str) -> list[Entry]:
        return [same(f"{src}.weight", f"{dst}.weight", (E,)),
                same(f"{src}.bias", f"{dst}.bias", (E,))]  # fmt: skip

    def attention(src: str, dst: str) -> list[Entry]:
        out = []
        for name in ("q_proj", "k_proj", "v_proj"):
            out += linear(f"{src}.{name}", f"{dst}.{name}", inner, E)
        return out + linear(f"{src}.out_proj", f"{dst}.out_proj", E, inner)

    embeds = ("src_embed.weight", "tgt_embed.weight") + (
        ("lm_head.weight",) if c.tie_embeddings else ())
    entries = [
        same("model.shared.weight", embeds, (V, E)),
        Entry("final_logits_bias", (1, V), (("lm_head.bias", lambda t: t.reshape(-1)),)),
    ]
    if not c.tie_embeddings:
        entries.append(same("lm_head.weight", "lm_head.weight", (V, E)))
    for side, dst in (("encoder", "src"), ("decoder", "tgt")):
        if positions:
            rows = c.max_len + c.position_offset
            entries.append(same(f"model.{side}.embed_positions.weight", f"{dst}_pos.weight",
                                (rows, E)))  # fmt: skip
        if embed_norm:
            entries += norm(f"model.{side}.layernorm_embedding", f"{dst}_embed_norm")
    for i in range(c.num_encoder_layers):
        src, dst = f"model.encoder.layers.{i}", f"encoder_blocks.{i}"
        entries += attention(f"{src}.self_attn", f"{dst}.self_attn")
        entries += norm(f"{src}.self_attn_layer_norm", f"{dst}.attn_norm")
        entries += linear(f"{src}.fc1", f"{dst}.ffn.linear1", F, E)
        entries += linear(f"{src}.fc2", f"{dst}.ffn.linear2", E, F)
        entries += norm(f"{src}.final_layer_norm", f"{dst}.ffn_norm")
    for i in range(c.num_decoder_layers):
        src, dst = f"model.decoder.layers.{i}", f"decoder_blocks.{i}"
        entries += attention(f"{src}.self_attn", f"{dst}.self_attn")
        entries += norm(f"{src}.self_attn_layer_norm", f"{dst}.attn_norm")
        entries += attention(f"{src}.encoder_attn", f"{dst}.cross_attn")
        entries += norm(f"{src}.encoder_attn_layer_norm", f"{dst}.cross_norm")
        entries += linear(f"{src}.fc1", f"{dst}.ffn.linear1", F, E)
        entries += linear(f"{src}.fc2", f"{dst}.ffn.linear2", E, F)
        entries += norm(f"{src}.final_layer_norm", f"{dst}.ffn_norm")
    return entries


def bart_entries(c: Seq2SeqConfig, names: Iterable[str] = ()) -> list[Entry]:
    """The tensors a BART model with config ``c`` needs, under BART's names."""
    return bart_family_entries(c, positions=True, embed_norm=True)


def bart_ignored(c: Seq2SeqConfig) -> Any:
    """Source names a BART file may hold that are not read: copies of the tied embedding."""
    tied = _TIED_COPIES if c.tie_embeddings else _TIED_COPIES[:2]
    return lambda name: name in tied
