"""T5 checkpoints in Hugging Face format -> :class:`qkv.models.Seq2SeqTransformer`.

T5 (Raffel et al., 2020) is a pre-norm encoder-decoder with RMSNorm ("T5LayerNorm", no mean,
no bias), no biases anywhere, no absolute positions but a learned bucketed relative position
bias per stack (bidirectional in the encoder, causal in the decoder; the first block stores it
and every block adds it), unscaled attention scores, a ReLU feed-forward (T5 v1.1 and later: a
gated GELU, ``feed_forward_proj="gated-gelu"``), one embedding shared by both stacks, and, when
the output projection is the embedding, decoder outputs scaled by ``d_model ** -0.5``. Each is
an option of :class:`~qkv.models.Seq2SeqConfig` (``norm="pre"``, ``norm_kind="rmsnorm"``,
``bias=False``, ``positions="relative"``, ``attn_scale=1.0``, ``head_scale``).
Decoding starts from PAD (id 0). Names:

    shared / lm_head                                    -> src_embed, tgt_embed (, lm_head)
    {encoder,decoder}.block.0.layer.0.SelfAttention.relative_attention_bias
                                                        -> src_rel_bias / tgt_rel_bias
    encoder.block.{i}.layer.0.SelfAttention.{q,k,v,o}   -> encoder_blocks.{i}.self_attn.*_proj
    encoder.block.{i}.layer.0.layer_norm                -> encoder_blocks.{i}.attn_norm
    encoder.block.{i}.layer.1.DenseReluDense.wi / wo    -> encoder_blocks.{i}.ffn.linear1 / 2
      (gated: wi_0 / wi_1 / wo                          -> ffn.gate_proj / up_proj / down_proj)
    encoder.block.{i}.layer.1.layer_norm                -> encoder_blocks.{i}.ffn_norm
    decoder.block.{i}.layer.1.EncDecAttention           -> decoder_blocks.{i}.cross_attn
    decoder.block.{i}.layer.{1,2}.layer_norm            -> decoder_blocks.{i}.cross_norm, ffn_norm
    {encoder,decoder}.final_layer_norm                  -> encoder_norm / decoder_norm

The output projection is the embedding unless the file stores its own ``lm_head.weight`` (T5
v1.1); the output scale follows ``config.json`` (``scale_decoder_outputs``, or for older files
``tie_word_embeddings`` not false).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from qkv.checks import is_int
from qkv.models import Seq2SeqConfig
from qkv.pretrained.hf.common import HF_ACTIVATIONS, hf_flag, token_id
from qkv.pretrained.weights import Entry

__all__ = ["t5_config", "t5_entries", "t5_ignored"]

# gated feed-forward activation (Hugging Face name) -> qkv gated feed-forward kind
_GATED = {"gelu_new": "geglu", "gelu_pytorch_tanh": "geglu", "silu": "swiglu", "swish": "swiglu"}


def _activation(hf: Mapping[str, Any], where: str) -> str:
    """The qkv feed-forward kind of ``feed_forward_proj`` (``"relu"``, ``"gated-gelu"``, ...)."""
    proj = hf.get("feed_forward_proj", "relu")
    parts = proj.split("-") if isinstance(proj, str) else []
    gated = len(parts) == 2 and parts[0] == "gated"
    if not parts or len(parts) > 2 or (len(parts) == 2 and not gated):
        raise ValueError(f"{where}: feed_forward_proj={proj!r} is not 'ACT' or 'gated-ACT'")
    act = hf.get("dense_act_fn", parts[-1])
    if proj == "gated-gelu":  # transformers maps it to the tanh approximation
        act = "gelu_new"
    table = _GATED if gated else HF_ACTIVATIONS
    if act not in table:
        raise ValueError(f"{where}: feed_forward_proj={proj!r} (activation {act!r}) is not "
                         f"supported; known: {sorted(table)}")  # fmt: skip
    return table[act]


def t5_config(hf: Mapping[str, Any], *, where: str, names: Iterable[str]) -> Seq2SeqConfig:
    """A :class:`Seq2SeqConfig` from a T5 ``config.json`` and the weight file's tensor names
    (an ``lm_head.weight`` of its own unties the output projection).

    Raises:
        ValueError: an unsupported feed-forward, a missing size, bad token ids.
    """
    try:
        V, E = hf["vocab_size"], hf["d_model"]
        scale = hf_flag(hf, "scale_decoder_outputs", where,
                        hf_flag(hf, "tie_word_embeddings", where, True))
        start = token_id(hf, "decoder_start_token_id")
        pad = token_id(hf, "pad_token_id")
        layers = hf["num_layers"]
        dec_layers = hf.get("num_decoder_layers")
        return Seq2SeqConfig(
            src_vocab_size=V,
            tgt_vocab_size=V,
            d_model=E,
            num_heads=hf["num_heads"],
            num_encoder_layers=layers,
            num_decoder_layers=dec_layers if is_int(dec_layers) else layers,
            d_ff=hf["d_ff"],
            d_head=hf["d_kv"],
            dropout=0.0,  # inference: a loaded model is in eval mode anyway
            max_len=hf.get("n_positions", 512),
            norm="pre",
            norm_kind="rmsnorm",
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
            bias=False,
            output_bias=False,
            activation=_activation(hf, where),
            positions="relative",
            relative_buckets=hf.get("relative_attention_num_buckets", 32),
            relative_max_distance=hf.get("relative_attention_max_distance", 128),
            attn_scale=1.0,
            head_scale=E**-0.5 if scale is True else 1.0,
            embed_scale=1.0,
            share_embeddings=True,
            tie_embeddings="lm_head.weight" not in set(names),
            pad_id=pad,
            bos_id=start if start is not None else pad,
            eos_id=token_id(hf, "eos_token_id"),
        )
    except KeyError as err:
        raise ValueError(f"{where}: config.json has no {err.args[0]!r}") from err


def t5_entries(c: Seq2SeqConfig, names: Iterable[str] = ()) -> list[Entry]:
    """The tensors a T5 model with config ``c`` needs, under T5's names."""
    E, F, V = c.d_model, c.d_ff, c.tgt_vocab_size
    inner = c.num_heads * c.head_width

    def same(src: str, dst: str | tuple[str, ...], shape: tuple[int, ...]) -> Entry:
        targets = (dst,) if isinstance(dst, str) else dst
        return Entry(src, shape, tuple((t, None) for t in targets))

    def attention(src: str, dst: str) -> list[Entry]:
        return [same(f"{src}.q.weight", f"{dst}.q_proj.weight", (inner, E)),
                same(f"{src}.k.weight", f"{dst}.k_proj.weight", (inner, E)),
                same(f"{src}.v.weight", f"{dst}.v_proj.weight", (inner, E)),
                same(f"{src}.o.weight", f"{dst}.out_proj.weight", (E, inner))]  # fmt: skip

    def ffn(src: str, dst: str) -> list[Entry]:
        if c.activation in ("geglu", "swiglu"):
            return [same(f"{src}.wi_0.weight", f"{dst}.gate_proj.weight", (F, E)),
                    same(f"{src}.wi_1.weight", f"{dst}.up_proj.weight", (F, E)),
                    same(f"{src}.wo.weight", f"{dst}.down_proj.weight", (E, F))]  # fmt: skip
        return [same(f"{src}.wi.weight", f"{dst}.linear1.weight", (F, E)),
                same(f"{src}.wo.weight", f"{dst}.linear2.weight", (E, F))]  # fmt: skip

    embeds = ("src_embed.weight", "tgt_embed.weight") + (
        ("lm_head.weight",) if c.tie_embeddings else ())
    entries = [same("shared.weight", embeds, (V, E))]
    if not c.tie_embeddings:
        entries.append(same("lm_head.weight", "lm_head.weight", (V, E)))
    H, N = c.num_heads, c.relative_buckets
    for side, dst in (("encoder", "src"), ("decoder", "tgt")):
        bias = f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        entries.append(same(bias, f"{dst}_rel_bias.weight", (N, H)))
        entries.append(same(f"{side}.final_layer_norm.weight", f"{side}_norm.weight", (E,)))
    for i in range(c.num_encoder_layers):
        src, dst = f"encoder.block.{i}.layer", f"encoder_blocks.{i}"
        entries += attention(f"{src}.0.SelfAttention", f"{dst}.self_attn")
        entries.append(same(f"{src}.0.layer_norm.weight", f"{dst}.attn_norm.weight", (E,)))
        entries += ffn(f"{src}.1.DenseReluDense", f"{dst}.ffn")
        entries.append(same(f"{src}.1.layer_norm.weight", f"{dst}.ffn_norm.weight", (E,)))
    for i in range(c.num_decoder_layers):
        src, dst = f"decoder.block.{i}.layer", f"decoder_blocks.{i}"
        entries += attention(f"{src}.0.SelfAttention", f"{dst}.self_attn")
        entries.append(same(f"{src}.0.layer_norm.weight", f"{dst}.attn_norm.weight", (E,)))
        entries += attention(f"{src}.1.EncDecAttention", f"{dst}.cross_attn")
        entries.append(same(f"{src}.1.layer_norm.weight", f"{dst}.cross_norm.weight", (E,)))
        entries += ffn(f"{src}.2.DenseReluDense", f"{dst}.ffn")
        entries.append(same(f"{src}.2.layer_norm.weight", f"{dst}.ffn_norm.weight", (E,)))
    return entries


def t5_ignored(c: Seq2SeqConfig) -> Any:
    """Source names a T5 file may hold that are not read: copies of the shared embedding."""
    copies = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    return lambda name: name in copies
