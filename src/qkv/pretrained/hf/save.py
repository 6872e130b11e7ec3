"""A qkv model written as a Hugging Face folder: ``hf.gpt2``, ``hf.llama``, ``hf.bert`` reversed.

    qkv.pretrained.save_hf(bundle_or_model, "out/")      # config.json, model.safetensors, ...
    AutoModelForCausalLM.from_pretrained("out/")          # same logits (transformers)
    qkv.pretrained.load("out/")                           # the same model back, exactly

Families, by the model's config: a :class:`~qkv.models.DecoderLM` with learned positions is
GPT-2 (``model_type "gpt2"``), one with rotary positions is Llama (``"llama"``), an
:class:`~qkv.models.Encoder` is BERT (``"bert"``, with sentence-transformers' pooling files).

Nothing is written twice: the tensor names and their transforms are the loaders' own tables
(:func:`~qkv.pretrained.hf.gpt2.gpt2_entries`, ``llama_entries``, ``bert_entries``), run
backwards (:func:`invert_entries`: each transform, applied to a tensor of indices, says where
every element of the source tensor went). The config is checked the same way: the
``config.json`` written is read back with the loader's own function, and every field that
does not come back equal (say ``norm_kind="layernorm"`` on a rotary model: Llama has RMSNorm)
is refused by name, before anything is written. ``dropout`` is written (``resid_pdrop``,
``hidden_dropout_prob``, ``attention_dropout``) but loading gives 0.0: a loaded model is for
inference.

The folder is written into a temporary sibling and renamed into place (as qkv checkpoints).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.checkpoint.folder import _atomic_folder, _write_json
from qkv.models import DecoderLM, Encoder
from qkv.nn.lora import LoRALinear
from qkv.pretrained.bundle import DecoderBundle, EncoderBundle
from qkv.pretrained.hf.bert import bert_config, bert_entries
from qkv.pretrained.hf.common import HF_ACTIVATIONS
from qkv.pretrained.hf.gpt2 import gpt2_config, gpt2_entries
from qkv.pretrained.hf.llama import HF_LLAMA_NAMES, llama_config, llama_entries
from qkv.pretrained.tokenizer import PretrainedTokenizer
from qkv.pretrained.weights import Entry

__all__ = ["hf_config", "invert_entries", "save_hf"]

# qkv activation -> the first Hugging Face name that loads as it.
_HF_NAME = {qkv: hf for hf, qkv in reversed(list(HF_ACTIVATIONS.items()))}
# Fields the loaders do not read back as written (inference settings), compared as normalised.
_NOT_COMPARED = ("dropout",)


def _ids(c: Any) -> dict[str, Any]:
    return {"bos_token_id": getattr(c, "bos_id", None), "eos_token_id": getattr(c, "eos_id", None),
            "pad_token_id": c.pad_id}  # fmt: skip


def _activation(c: Any, family: str) -> str:
    if c.activation not in _HF_NAME:
        raise ValueError(f"{type(c).__name__}.activation={c.activation!r} has no {family} "
                         f"equivalent; expected one of {sorted(_HF_NAME)}")  # fmt: skip
    return _HF_NAME[c.activation]


def _gpt2(c: Any) -> dict[str, Any]:
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
        "n_embd": c.d_model, "n_layer": c.num_layers, "n_head": c.num_heads,
        "n_inner": c.ffn_dim, "n_positions": c.max_len, "layer_norm_epsilon": c.norm_eps,
        "activation_function": _activation(c, "GPT-2"),
        "tie_word_embeddings": c.tie_embeddings, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout, **_ids(c),
    }


def _llama(c: Any) -> dict[str, Any]:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads or c.num_heads,
        "head_dim": c.head_dim, "intermediate_size": c.ffn_dim,
        "max_position_embeddings": c.max_len, "rms_norm_eps": c.norm_eps, "hidden_act": "silu",
        "rope_theta": c.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": c.dropout,
        "tie_word_embeddings": c.tie_embeddings, **_ids(c),
    }


def _bert(c: Any) -> dict[str, Any]:
    if not c.type_vocab_size:
        raise ValueError(f"EncoderConfig.type_vocab_size={c.type_vocab_size!r} has no BERT "
                         "equivalent (BERT always adds token type embeddings); use >= 1")
    return {
        "model_type": "bert", "architectures": ["BertModel"], "vocab_size": c.vocab_size,
        "hidden_size": c.d_model, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "intermediate_size": c.ffn_dim,
        "max_position_embeddings": c.max_len, "type_vocab_size": c.type_vocab_size,
        "hidden_act": _activation(c, "BERT"), "layer_norm_eps": c.norm_eps,
        "position_embedding_type": "absolute", "hidden_dropout_prob": c.dropout,
        "attention_probs_dropout_prob": c.dropout, "pad_token_id": c.pad_id,
    }


def _normalised(c: Any) -> dict[str, Any]:
    """A config's fields with defaults resolved (``d_ff=None`` is its width), for comparing."""
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    if "d_ff" in fields:
        fields["d_ff"] = c.ffn_dim
    if "d_head" in fields:
        fields["d_head"] = c.head_dim
    if "num_kv_heads" in fields:
        fields["num_kv_heads"] = c.num_kv_heads or c.num_heads
    return {k: v for k, v in fields.items() if k not in _NOT_COMPARED}


def hf_config(model: nn.Module) -> tuple[str, dict[str, Any]]:
    """``(model_type, config.json contents)`` for a qkv model, checked to load back as it is.

    Raises:
        TypeError: not a :class:`~qkv.models.DecoderLM` or :class:`~qkv.models.Encoder`.
        ValueError: an option with no equivalent in the family (named, with the value the
            family would give instead).
    """
    if isinstance(model, Encoder):
        c = model.config
        hf, family = _bert(c), "BERT"
        back = bert_config(hf, where="save_hf", pooling=c.pooling)
    elif isinstance(model, DecoderLM):
        c = model.config
        if c.positions == "learned":
            hf, family, read = _gpt2(c), "GPT-2", gpt2_config
        elif c.positions == "rope":
            hf, family, read = _llama(c), "Llama", llama_config
        else:
            raise ValueError(
                f"DecoderLMConfig.positions={c.positions!r} has no Hugging Face equivalent here: "
                "GPT-2 has 'learned' positions and Llama 'rope'"
            )
        back = read(hf, where="save_hf")
    else:
        raise TypeError(f"save_hf writes qkv DecoderLM (GPT-2, Llama style) and Encoder (BERT "
                        f"style) models, got {type(model).__name__}")  # fmt: skip
    ours, theirs = _normalised(c), _normalised(back)
    if ours != theirs:
        bad = [f"{k}={ours[k]!r} (a {family} model has {theirs.get(k)!r})" for k in ours
               if ours[k] != theirs.get(k)]  # fmt: skip
        raise ValueError(f"{type(c).__name__} options with no {family} equivalent: "
                         + "; ".join(bad))  # fmt: skip
    hf["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return hf["model_type"], hf


def _entries(kind: str, model: nn.Module) -> list[Entry]:
    c = model.config
    if kind == "gpt2":
        return gpt2_entries(c, ["transformer."])  # GPT2LMHeadModel's own names
    if kind == "llama":
        return llama_entries(c, HF_LLAMA_NAMES)
    return bert_entries(c, [])


def invert_entries(entries: Iterable[Entry], state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The source tensors that ``entries`` would turn into ``state`` (a qkv state dict).

    Each entry's transforms are index selections (a transpose, a slice of a fused matrix), so
    applying one to ``arange(numel).reshape(shape)`` says which source element each target
    element is; the source is filled from the targets through those indices. Every source
    element must be filled, tied targets must agree, and every key of ``state`` must be used.

    Raises:
        ValueError: a state key no entry reads, a source element no target fills, tied
            targets that differ, a transform that does not select (a converter bug), named.
    """
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for e in entries:
        n = math.prod(e.shape)
        index = torch.arange(n).reshape(e.shape)
        first = state[e.targets[0][0]]
        src = torch.zeros(n, dtype=first.dtype)
        filled = torch.zeros(n, dtype=torch.bool)
        for key, fn in e.targets:
            if key not in state:
                raise ValueError(f"save_hf: the model has no {key!r} (read by {e.source!r})")
            where = (index if fn is None else fn(index)).reshape(-1)
            value = state[key].detach().to("cpu").reshape(-1)
            if where.numel() != value.numel() or where.dtype != torch.long:
                raise ValueError(f"save_hf: the transform from {e.source!r} to {key!r} is not "
                                 "an index selection; cannot invert it")  # fmt: skip
            seen = filled[where]
            if bool(seen.any()) and not torch.equal(src[where][seen], value[seen]):
                raise ValueError(f"save_hf: {key!r} and another tensor tied to {e.source!r} "
                                 "differ")  # fmt: skip
            src[where] = value
            filled[where] = True
            used.add(key)
        if not bool(filled.all()):
            raise ValueError(f"save_hf: {int((~filled).sum())} elements of {e.source!r} are "
                             "filled by no model tensor")  # fmt: skip
        out[e.source] = src.reshape(e.shape).contiguous()
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(f"save_hf: model tensors {unused[:8]} have no Hugging Face name")
    return out


def _tokenizer_files(tok: Any, folder: Path, model: nn.Module) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template)."""
    tok.backend.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {k: v for k, v in tok.special_tokens.items() if v is not None}
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    config["model_max_length"] = tok.max_length or model.config.max_len
    _write_json(folder / "tokenizer_config.json", config)


def _sentence_transformers(folder: Path, bundle: Any, model: Encoder) -> None:
    """Pooling and normalisation as sentence-transformers stores them (what the loader reads)."""
    c = model.config
    parts = [("", "Transformer"), ("1_Pooling", "Pooling")]
    if bundle is None or bundle.normalize:
        parts.append(("2_Normalize", "Normalize"))
    modules = [{"idx": i, "name": str(i), "path": where,
                "type": f"sentence_transformers.models.{kind}"}
               for i, (where, kind) in enumerate(parts)]  # fmt: skip
    _write_json(folder / "modules.json", modules)
    (folder / "1_Pooling").mkdir()
    _write_json(folder / "1_Pooling" / "config.json", {
        "word_embedding_dimension": c.d_model, "pooling_mode_cls_token": c.pooling == "cls",
        "pooling_mode_mean_tokens": c.pooling == "mean", "pooling_mode_max_tokens": False,
    })
    tok = getattr(bundle, "tokenizer", None)
    length = getattr(tok, "max_length", None) or c.max_len
    _write_json(folder / "sentence_bert_config.json", {"max_seq_length": length})


def save_hf(model_or_bundle: Any, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write a qkv model (or a bundle with its tokenizer) as a Hugging Face folder.

    Args:
        model_or_bundle: a :class:`~qkv.models.DecoderLM` (GPT-2 style: learned positions;
            Llama style: rotary positions), an :class:`~qkv.models.Encoder` (BERT style), or a
            :class:`DecoderBundle` / :class:`EncoderBundle` (its tokenizer is written too).
        path: the folder to create (an existing empty folder is filled).
        overwrite: replace an existing folder that holds files (atomically); otherwise it
            is refused.

    Returns:
        The folder: ``config.json``, ``model.safetensors`` (tensors under the family's names,
        in the model's dtype), and with a tokenizer ``tokenizer.json`` and
        ``tokenizer_config.json``; for an encoder, sentence-transformers' ``modules.json``,
        ``1_Pooling/config.json`` and ``sentence_bert_config.json``.

    Raises:
        TypeError: another kind of model, or a tokenizer with no Hugging Face form (only a
            :class:`~qkv.pretrained.PretrainedTokenizer` has one).
        ValueError: an option the family has no equivalent for (named, see :func:`hf_config`).
        FileExistsError: ``path`` holds files and ``overwrite`` is False, or is a file.
        ValueError: an empty ``path``.
        OSError: the folder cannot be written (nothing is left half-written).
    """
    from safetensors.torch import save_file

    bundles = (DecoderBundle, EncoderBundle)
    bundle = model_or_bundle if isinstance(model_or_bundle, bundles) else None
    model = bundle.model if bundle is not None else model_or_bundle
    if any(isinstance(m, LoRALinear) for m in getattr(model, "modules", list)()):
        raise ValueError("the model has LoRA adapters, which a Hugging Face folder of its family "
                         "has no names for: fold them in with qkv.nn.lora.merge_lora(model), or "
                         "save them alone with qkv.checkpoint.adapters.save_adapters")
    kind, config = hf_config(model)
    tok = getattr(bundle, "tokenizer", None)
    if tok is not None and not isinstance(tok, PretrainedTokenizer):
        raise TypeError(f"the bundle's tokenizer is a {type(tok).__name__}, which has no "
                        "Hugging Face form; save the model alone: save_hf(bundle.model, path)")
    tensors = invert_entries(_entries(kind, model), model.state_dict())
    dest = Path(path)
    if str(path) == "":
        raise ValueError("path is empty; name the folder to write (an empty path would be the "
                         "current folder)")
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"{dest} is a file, not a folder; save_hf writes a folder and "
                              "never replaces a file, even with overwrite=True")
    if dest.exists() and not overwrite and any(dest.iterdir()):
        raise FileExistsError(f"{dest} exists and is not empty; pass overwrite=True to "
                              "replace it")

    def write(folder: Path) -> None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        if tok is not None:
            _tokenizer_files(tok, folder, model)
        if kind == "bert":
            _sentence_transformers(folder, bundle, model)
        _write_json(folder / "config.json", config)  # last: a folder without it is incomplete

    _atomic_folder(dest, write)
    return dest
