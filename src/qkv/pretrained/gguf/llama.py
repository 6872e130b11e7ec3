"""Llama-family GGUF files -> :class:`qkv.models.DecoderLM` (Llama style) and its tokenizer.

The sizes come from the metadata (``llama.embedding_length``, ``llama.block_count``,
``llama.attention.head_count`` / ``head_count_kv``, ``llama.feed_forward_length``,
``llama.rope.freq_base``, ``llama.attention.layer_norm_rms_epsilon``), the tensors under
llama.cpp's names:

    token_embd / output_norm / output          -> embed / norm_f / lm_head (absent = tied)
    blk.{i}.attn_q / attn_k / attn_v / attn_output -> blocks.{i}.self_attn.q/k/v/out_proj
    blk.{i}.ffn_gate / ffn_up / ffn_down        -> blocks.{i}.ffn.gate/up/down_proj
    blk.{i}.attn_norm / ffn_norm                -> blocks.{i}.attn_norm / ffn_norm

The query/key rows are permuted. llama.cpp rotates interleaved pairs ``(2j, 2j+1)`` (Meta's
original layout), so its converter reorders each head's rows of ``W_q`` and ``W_k`` from the
rotate-half layout ``[first halves | second halves]`` to ``[x0, x_{D/2}, x1, x_{D/2+1}, ...]``.
qkv, like Hugging Face, rotates halves, so :func:`unpermute_rows` puts the rows back.
"""

from __future__ import annotations

import os

from torch import Tensor

from qkv.checkpoint.backing import check_derived_buffers, check_sizes, meta_model
from qkv.checks import positive_int
from qkv.data.files import BadFileError, reading
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.pretrained.gguf.reader import GGUFFile, read_gguf
from qkv.pretrained.gguf.tokenizer import tokenizer_from_gguf
from qkv.pretrained.hf.llama import llama_entries
from qkv.pretrained.tokenizer import PretrainedTokenizer
from qkv.pretrained.weights import check_entries, load_entries, skip_init

__all__ = ["GGUF_LLAMA_NAMES", "gguf_llama_config", "load_gguf_llama", "unpermute_rows"]

GGUF_LLAMA_NAMES = {
    "embed": "token_embd.weight",
    "norm_f": "output_norm.weight",
    "lm_head": "output.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
}


def unpermute_rows(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's query/key row permutation.

    Args:
        w: ``(heads·D, E)`` with each head's rows interleaved ``[x0, x_{D/2}, x1, ...]``.
        heads: ``H`` for the query weight, ``Hkv`` for the key weight.

    Returns:
        ``(heads·D, E)`` with each head's rows as ``[x0 .. x_{D/2-1}, x_{D/2} .. x_{D-1}]``.
    """
    rows, E = w.shape
    D = rows // heads
    w = w.reshape(heads, D // 2, 2, E)  # (heads, D/2, 2, E): row 2j + a of a head
    return w.transpose(1, 2).reshape(rows, E)  # (heads·D, E): row a·D/2 + j


def gguf_llama_config(gguf: GGUFFile) -> DecoderLMConfig:
    """A Llama-style :class:`DecoderLMConfig` from GGUF metadata.

    Raises:
        qkv.data.files.BadFileError (a ValueError): an architecture other than ``llama``,
            missing keys, values of the wrong type, or partial rotary dimensions
            (``llama.rope.dimension_count`` different from the head width).
    """
    arch = gguf.get("general.architecture")
    if arch != "llama":
        raise BadFileError(
            f"GGUF file {gguf.path} has general.architecture={arch!r}; qkv reads 'llama' only",
            path=gguf.path,
        )
    with reading(gguf.path, "Llama metadata qkv can build a model from"):
        E = gguf.require("llama.embedding_length")
        H = positive_int("llama.attention.head_count", gguf.require("llama.attention.head_count"))
        Hkv = gguf.get("llama.attention.head_count_kv", H)
        D = gguf.get("llama.attention.key_length", E // H)
        rot = gguf.get("llama.rope.dimension_count", D)
        if rot != D:
            raise BadFileError(
                f"GGUF file {gguf.path}: llama.rope.dimension_count={rot} differs from the head "
                f"width {D}; partial rotary embeddings are not supported",
                path=gguf.path,
            )
        vocab = gguf.get("llama.vocab_size") or len(gguf.require("tokenizer.ggml.tokens"))
        tied = GGUF_LLAMA_NAMES["lm_head"] not in gguf.shapes
        return DecoderLMConfig.llama_style(
            vocab,
            d_model=E,
            num_layers=gguf.require("llama.block_count"),
            num_heads=H,
            num_kv_heads=Hkv,
            d_head=None if D == E // H else D,
            d_ff=gguf.require("llama.feed_forward_length"),
            max_len=gguf.get("llama.context_length", 2048),
            # The file stores float32; its exact value (9.99999974738e-06 for 1e-5) is what
            # llama.cpp and transformers use, so it is kept as read.
            norm_eps=float(gguf.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(gguf.get("llama.rope.freq_base", 10000.0)),
            tie_embeddings=tied,
            bos_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_id=gguf.get("tokenizer.ggml.eos_token_id"),
            pad_id=gguf.get("tokenizer.ggml.padding_token_id"),
            dropout=0.0,
        )


def load_gguf_llama(
    path: str | os.PathLike,
) -> tuple[DecoderLM, PretrainedTokenizer, GGUFFile]:
    """Read a Llama-family GGUF file into a float32 model in eval mode and its tokenizer.

    The metadata is checked against the tensor shapes of the file's header before the model is
    built (see :mod:`qkv.checkpoint.backing`); the tensors are read and dequantised last, each
    checked finite.

    Args:
        path: the ``.gguf`` file.

    Returns:
        ``(model, tokenizer, gguf)``; ``gguf`` keeps the metadata (its tensors are dropped to
        free memory).

    Raises:
        qkv.data.files.MissingFileError (a FileNotFoundError): no such file.
        qkv.data.files.BadFileError (a ValueError): not a Llama GGUF, an unsupported
            tokenizer, sizes the tensors do not back, or missing, unexpected, misshaped or
            non-finite tensors (named); every message names the file.
        ImportError: ``gguf`` or ``tokenizers`` missing (with the install command).
    """
    gguf = read_gguf(path, tensors=False)
    config = gguf_llama_config(gguf)
    # 1) sizes bounded by the header, 2) names and shapes, 3) computed buffers: all before the
    # model is built
    check_sizes(config, tensors=len(gguf.shapes), numel=gguf.numel, config_file=gguf.path,
                data_file=gguf.path)  # fmt: skip
    H, Hkv = config.num_heads, config.num_kv_heads or config.num_heads
    entries = llama_entries(
        config, GGUF_LLAMA_NAMES,
        q_transform=lambda w: unpermute_rows(w, H),
        k_transform=lambda w: unpermute_rows(w, Hkv),
    )
    check_entries(gguf.shapes, entries, where=gguf.path,
                  origin="the model the file's metadata describes")  # fmt: skip
    check_derived_buffers(meta_model(lambda: DecoderLM(config)),
                          file_bytes=gguf.path.stat().st_size, config_file=gguf.path)
    tokenizer = tokenizer_from_gguf(gguf)  # metadata only: cheap, so before the tensors
    with skip_init():
        model = DecoderLM(config)
    load_entries(model, gguf.read_tensors(), entries, where=gguf.path)
    gguf.tensors.clear()
    gguf.close()
    return model.eval(), tokenizer, gguf
