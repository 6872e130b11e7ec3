"""run_with_cache and the residual-stream decomposition, against torch hooks and hand math."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from analysis_models import encoder, gpt2, ids, llama, seq2seq

import qkv.inspect as qi
from helpers import assert_close


def _torch_hooked(model, inputs, block_prefix: str):
    """Block inputs/outputs, sublayer outputs and q_proj outputs read with plain torch hooks on
    the real modules (not the HookPoints)."""
    seen, handles = {}, []
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) == 2 and parts[0] == block_prefix:
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(f"{name}.pre", args[0].clone())))
            handles.append(module.register_forward_hook(
                lambda m, args, out, name=name: seen.__setitem__(f"{name}.post", out.clone())))
        elif len(parts) == 3 and parts[0] == block_prefix and parts[2] in ("self_attn", "ffn"):
            handles.append(module.register_forward_hook(
                lambda m, args, out, name=name: seen.__setitem__(
                    name, (out[0] if isinstance(out, tuple) else out).clone())))
    try:
        with torch.no_grad():
            out = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return out, seen


CASES = {
    "gpt2": (gpt2, "blocks", lambda: (ids(),)),
    "llama": (llama, "blocks", lambda: (ids(),)),
    "encoder-post": (lambda: encoder("post"), "blocks", lambda: (ids(),)),
    "seq2seq": (seq2seq, "decoder_blocks", lambda: (ids(2, 6, 1), ids(2, 5, 2))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cache_equals_torch_hooks(case):
    make, prefix, inputs_fn = CASES[case]
    model, inputs = make(), inputs_fn()
    expected_out, seen = _torch_hooked(model, inputs, prefix)
    out, cache = qi.run_with_cache(model, *inputs)
    assert_close(out, expected_out, atol=1e-5, name=f"{case} output with every hook point cached")
    L = sum(1 for k in seen if k.endswith(".post"))
    for l in range(L):
        p = f"{prefix}.{l}"
        assert_close(cache[f"{p}.hook_resid_pre"], seen[f"{p}.pre"], atol=1e-5, name=f"{p} pre")
        assert_close(cache[f"{p}.hook_resid_post"], seen[f"{p}.post"], atol=1e-5, name=f"{p} post")
        assert_close(cache[f"{p}.hook_attn_out"], seen[f"{p}.self_attn"], atol=1e-5,
                     name=f"{p} attn out")  # fmt: skip
        assert_close(cache[f"{p}.hook_ffn_out"], seen[f"{p}.ffn"], atol=1e-5, name=f"{p} ffn")
    for value in cache.values.values():
        assert not value.requires_grad


def test_attention_hook_points_equal_torch_sdpa():
    """hook_q/k/v from the projections; hook_weights and hook_out from torch's own formula."""
    model = gpt2()
    x = ids()
    _, cache = qi.run_with_cache(model, x)
    attn = model.blocks[1].self_attn
    h = model.blocks[1].attn_norm(cache["blocks.1.hook_resid_pre"])  # (B, T, E)
    B, T, _ = h.shape
    H, D = attn.num_heads, attn.d_head
    with torch.no_grad():
        q = attn.q_proj(h).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = attn.k_proj(h).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = attn.v_proj(h).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
    for name, ref in (("hook_q", q), ("hook_k", k), ("hook_v", v), ("hook_weights", weights),
                      ("hook_out", out)):  # fmt: skip
        assert_close(cache[f"blocks.1.self_attn.{name}"], ref, atol=1e-5, name=name)


def test_names_select_and_errors():
    model, x = gpt2(), ids()
    plain = model(x)
    out, cache = qi.run_with_cache(model, x, names="blocks.*.hook_resid_post")
    assert cache.names == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    assert torch.equal(out, plain), "caching the residual stream must not change the output"
    _, cache = qi.run_with_cache(model, x, names=["blocks.0.hook_attn_out", "blocks.1.*.hook_q"])
    assert cache.names == ["blocks.0.hook_attn_out", "blocks.1.self_attn.hook_q"]  # module order
    _, cache = qi.run_with_cache(model, x, names=lambda n: n.endswith("hook_ffn_out"))
    assert cache.names == ["blocks.0.hook_ffn_out", "blocks.1.hook_ffn_out"]
    _, cache = qi.run_with_cache(model, x)
    assert "blocks.0.self_attn.hook_inputs" not in cache
    expected = [n for n in qi.hook_points(model) if not n.endswith("hook_inputs")]
    assert cache.names == expected and len(cache) == 2 * 12
    assert isinstance(qi.run_with_cache(model, x, names="*.hook_inputs")[1]
                      ["blocks.0.self_attn.hook_inputs"].query, torch.Tensor)  # fmt: skip
    with pytest.raises(ValueError, match=r"'blocks.9.hook_resid_pre' matches no name.*"
                                         r"blocks\.\*\.hook_resid_post"):  # fmt: skip
        qi.run_with_cache(model, x, names="blocks.9.hook_resid_pre")
    with pytest.raises(ValueError, match="predicate chose no hook point"):
        qi.run_with_cache(model, x, names=lambda n: False)
    with pytest.raises(TypeError, match="names must be"):
        qi.run_with_cache(model, x, names=3)
    with pytest.raises(KeyError, match="not in this cache"):
        cache["nope"]


def test_hook_point_firing_twice_is_an_error():
    model = gpt2()

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(x) + self.inner(x)

    with pytest.raises(ValueError, match="fired more than once"):
        qi.run_with_cache(Twice(), ids(), names="inner.blocks.0.hook_resid_pre")


def test_resid_helpers():
    model = gpt2()
    _, cache = qi.run_with_cache(model, ids())
    acc = cache.accumulated_resid()
    assert acc.shape == (3, 2, 7, 24)
    assert torch.equal(acc[2], cache["blocks.1.hook_resid_post"])
    assert torch.equal(cache.resid(1, "mid"), cache["blocks.1.hook_resid_mid"])
    assert torch.equal(cache.resid(-1), cache.resid(2))
    with pytest.raises(ValueError, match="layer must be an int"):
        cache.resid(3)
    with pytest.raises(ValueError, match="where must be"):
        cache.resid(0, "after")


def _independent_heads(z, W_O):
    """Each head's write, by a loop over heads and a plain matmul (not the library's einsum)."""
    H, D = z.shape[1], z.shape[3]
    return [z[:, h] @ W_O[:, h * D:(h + 1) * D].T for h in range(H)]  # each (B, T, E)


@pytest.mark.parametrize("case", ["gpt2", "llama", "encoder-pre", "seq2seq"])
def test_decomposition_sums_to_the_stream(case):
    model, inputs, prefix = {
        "gpt2": (gpt2(), (ids(),), "blocks"),
        "llama": (llama(), (ids(),), "blocks"),
        "encoder-pre": (encoder("pre"), (ids(),), "blocks"),
        "seq2seq": (seq2seq(), (ids(2, 6, 1), ids(2, 5, 2)), "decoder_blocks"),
    }[case]
    _, cache = qi.run_with_cache(model, *inputs)
    L = cache.num_layers()
    for layer in range(L + 1):
        parts = cache.decompose_resid(layer)
        assert_close(parts.total(), parts.stream, atol=1e-5,
                     name=f"{case}: sum of components vs resid_pre of block {layer}")  # fmt: skip
        whole = cache.decompose_resid(layer, heads=False)
        assert_close(whole.total(), whole.stream, atol=1e-5, name=f"{case} layer terms {layer}")
    parts = cache.decompose_resid()
    for l in range(L):
        attn = model.get_submodule(f"{prefix}.{l}.self_attn")
        expected = _independent_heads(cache[f"{prefix}.{l}.self_attn.hook_out"],
                                      attn.out_proj.weight.detach())  # fmt: skip
        for h, ref in enumerate(expected):
            got = parts.components[parts.heads[(l, h)]]
            assert_close(got, ref, atol=1e-6, name=f"{case} L{l}H{h} vs loop matmul")
            assert parts.labels[parts.heads[(l, h)]] == f"L{l}H{h}"
    if case == "seq2seq":
        assert "L0.cross.H1" in parts.labels and "L1.cross_bias" in parts.labels
    if case == "llama":
        assert not any("bias" in label for label in parts.labels)


def test_decomposition_refuses_post_norm_and_training():
    _, cache = qi.run_with_cache(encoder("post"), ids())
    with pytest.raises(ValueError, match="post-norm"):
        cache.decompose_resid(1)
    model = gpt2().train()
    _, cache = qi.run_with_cache(model, ids())
    with pytest.raises(ValueError, match="eval mode"):
        cache.decompose_resid()
    _, cache = qi.run_with_cache(gpt2(), ids(), names="blocks.*.hook_resid_*")
    with pytest.raises(KeyError, match="hook_out"):
        cache.decompose_resid()


def test_sandwich_norm_splits_by_layer_not_by_head():
    from qkv.models import DecoderLM, DecoderLMConfig

    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4,
                                      norm_kind="rmsnorm", sandwich_norm=True)).eval()
    _, cache = qi.run_with_cache(model, torch.randint(0, 50, (2, 7)))
    with pytest.raises(ValueError, match="sandwich_norm"):
        cache.decompose_resid()
    parts = cache.decompose_resid(heads=False)
    err = (parts.total() - parts.stream).abs().max().item()
    assert err < 1e-5, f"layer terms of a sandwich-norm model miss the stream by {err:.2e}"
