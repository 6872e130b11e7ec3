"""The GGUF path on small files written inside the tests with ``gguf.GGUFWriter``.

A random Llama-style qkv model is written as llama.cpp would write it (float32 tensors under
llama.cpp's names, query/key rows permuted to the interleaved layout, a byte-level BPE
vocabulary with merges and a control token) and read back by ``qkv.pretrained.load``: the
logits must be identical, the tokenizer must merge, keep the control token whole and add BOS
when the file says so; broken files fail naming the problem.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv.pretrained
from helpers import assert_close
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.pretrained.gguf.llama import unpermute_rows


def _gguf():
    try:
        import gguf as module
    except ImportError:
        pytest.fail("the GGUF tests need the gguf package: pip install 'qkv[pretrained]'")
    return module


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of query/key rows (the reference)."""
    rows, E = w.shape
    return w.reshape(heads, 2, rows // heads // 2, E).swapaxes(1, 2).reshape(rows, E)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


SPELL = bytes_to_unicode()
TOKENS = [SPELL[b] for b in range(256)] + ["he", "hel", "Ġw", "<|end|>", "<s>"]
MERGES = ["h e", "he l", "Ġ w"]
CONFIG = DecoderLMConfig.llama_style(
    len(TOKENS), d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48, max_len=64,
    rope_base=5000.0, tie_embeddings=False, norm_eps=1e-6,
)  # fmt: skip


def write_gguf(path, model: DecoderLM, *, arch="llama", drop=(), tokenizer_model="gpt2"):
    g = _gguf()
    c = model.config
    w = g.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_len)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * 259 + [3, 3])  # 3 = control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(len(TOKENS) - 1)
    w.add_eos_token_id(len(TOKENS) - 2)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    names = {"token_embd.weight": sd["embed.weight"], "output_norm.weight": sd["norm_f.weight"],
             "output.weight": sd["lm_head.weight"]}  # fmt: skip
    for i in range(c.num_layers):
        b = f"blocks.{i}"
        names |= {
            f"blk.{i}.attn_q.weight": llama_cpp_permute(sd[f"{b}.self_attn.q_proj.weight"], 4),
            f"blk.{i}.attn_k.weight": llama_cpp_permute(sd[f"{b}.self_attn.k_proj.weight"], 2),
            f"blk.{i}.attn_v.weight": sd[f"{b}.self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[f"{b}.self_attn.out_proj.weight"],
            f"blk.{i}.ffn_gate.weight": sd[f"{b}.ffn.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[f"{b}.ffn.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[f"{b}.ffn.down_proj.weight"],
            f"blk.{i}.attn_norm.weight": sd[f"{b}.attn_norm.weight"],
            f"blk.{i}.ffn_norm.weight": sd[f"{b}.ffn_norm.weight"],
        }
    for name, t in names.items():
        if name not in drop:
            w.add_tensor(name, np.ascontiguousarray(t.numpy(), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def model() -> DecoderLM:
    torch.manual_seed(0)
    m = DecoderLM(CONFIG).eval()
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for p in m.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize(("heads", "D"), [(1, 2), (3, 8), (9, 64)])
def test_unpermute_inverts_llama_cpp(heads, D):
    w = torch.randn(heads * D, 5)
    assert torch.equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)


def test_gguf_file_loads_with_identical_logits(tmp_path, model):
    write_gguf(tmp_path / "tiny.gguf", model)
    bundle = qkv.pretrained.load(tmp_path / "tiny.gguf")
    assert bundle.config.to_dict() == {**CONFIG.to_dict(), "bos_id": 260, "eos_id": 259,
                                       "norm_eps": bundle.config.norm_eps}  # fmt: skip
    ids = torch.randint(0, len(TOKENS), (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(bundle.model(ids), model(ids), atol=1e-6, name="GGUF logits")
    folder_bundle = qkv.pretrained.load(tmp_path)  # a folder holding one .gguf
    assert folder_bundle.source["format"] == "gguf"


def test_gguf_tokenizer_merges_and_specials(tmp_path, model):
    write_gguf(tmp_path / "tiny.gguf", model)
    tok = qkv.pretrained.load(tmp_path / "tiny.gguf").tokenizer
    ids = tok.encode("hello world<|end|>")
    assert ids == [260, 257, 108, 111, 258, 111, 114, 108, 100, 259]
    assert tok.decode(ids[1:]) == "hello world<|end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert tok.encode_chat([{"role": "user", "content": "hel"}]) == [257, 259]
    assert (tok.bos_id, tok.eos_id) == (260, 259)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"drop": ("blk.1.ffn_up.weight",)}, r"missing tensor\(s\) 'blk.1.ffn_up.weight'"),
        ({"arch": "gpt2"}, "general.architecture='gpt2'; qkv reads 'llama' only"),
        ({"tokenizer_model": "llama"}, "tokenizer.ggml.model='llama'; qkv reads byte-level"),
    ],
    ids=["missing-tensor", "architecture", "tokenizer"],
)
def test_broken_gguf_files_say_why(tmp_path, model, kwargs, message):
    write_gguf(tmp_path / "bad.gguf", model, **kwargs)
    with pytest.raises(ValueError, match=message):
        qkv.pretrained.load(tmp_path / "bad.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"not gguf at all" * 10)
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        qkv.pretrained.load(tmp_path / "fake.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"is a file but not a \.gguf file"):
        qkv.pretrained.load(tmp_path / "weights.bin")


def _same_reading(a, b) -> None:
    """Every field (types, parts, value indices) and tensor of two readers equal."""
    assert list(a.fields) == list(b.fields)
    for key in a.fields:
        fa, fb = a.fields[key], b.fields[key]
        assert (fa.types, fa.data, fa.offset) == (fb.types, fb.data, fb.offset), key
        assert len(fa.parts) == len(fb.parts), key
        for x, y in zip(fa.parts, fb.parts, strict=True):
            assert x.dtype == y.dtype and np.array_equal(x, y), key
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert (ta.tensor_type, ta.data_offset, list(ta.shape)) == (
            tb.tensor_type, tb.data_offset, list(tb.shape)), ta.name
        assert np.array_equal(ta.data, tb.data), ta.name


@pytest.mark.self_check
def test_the_plain_view_reader_reads_what_the_packages_reader_reads(tmp_path, model):
    """qkv reads the header through a plain view of the memory map (3x faster on SmolLM2's
    vocabulary): every field and tensor as ``gguf.GGUFReader`` reads them, on a file with
    every value kind (strings, string and int arrays, floats, bools) and on the packaged
    SmolLM2 file (49,152 tokens, 48,900 merges)."""
    from qkv.pretrained.gguf.reader import _reader_class
    from qkv.pretrained.registry import locate

    g = _gguf()
    fast = _reader_class(g)
    assert fast is not g.GGUFReader, "the installed gguf's reader is used unchanged"
    write_gguf(tmp_path / "tiny.gguf", model)
    files = [tmp_path / "tiny.gguf", locate("SmolLM2-135M-Instruct")]
    for path in files:
        _same_reading(fast(str(path)), g.GGUFReader(str(path)))
