"""Programmable attention in the modules: ``score_mod`` / ``block_mask`` through
``qkv.nn.Attention``, ``TransformerBlock`` and ``qkv.inspect.capture``.

The reference is written here from the module's parameters and plain torch ops on the whole
``(B, H, T, S)`` grid (projections, ``score_mod`` on full index tensors, ALiBi, masks, a
softmax whose dead rows are zero); it shares no code with qkv's kernel or its folding of the
mask parts. Everything runs in float64 with the tolerance 1e-10, forward and gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from helpers import assert_close
from qkv.attention.mods import document_mask
from qkv.nn import Attention, TransformerBlock
from qkv.nn.alibi import alibi_slopes
from qkv.nn.hooks import AttentionInputs

NEG = float("-inf")
TOL = dict(atol=1e-10, rtol=1e-10)
DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2], [0] * 6 + [1] * 7])  # (2, 13)

SCORE_MODS = {
    "none": None,
    "softcap": lambda s, b, h, q, k: 3.0 * torch.tanh(s / 3.0),
    "head_bias": lambda s, b, h, q, k: s + 0.1 * h - 0.05 * (q - k).abs(),
}


def mask_mods(T: int):
    docs = DOCS[:, :T]
    return {
        "none": None,
        "document": document_mask(docs),
        "window": lambda b, h, q, k: (q - k).abs() < 3,
        "prefix": lambda b, h, q, k: (k < 4) | (q >= k),
    }


def reference(attn, x, *, score_mod=None, mask_mod=None, causal=False, alibi=None, mask=None,
              dropout=None):  # fmt: skip
    """``(out (B, T, E), weights (B, H, T, T))`` of self-attention by its definition."""
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.d_head
    p = dict(attn.named_parameters())
    B, T, _ = x.shape
    q = F.linear(x, p["q_proj.weight"], p["q_proj.bias"]).reshape(B, T, H, D).transpose(1, 2)
    k = F.linear(x, p["k_proj.weight"], p["k_proj.bias"]).reshape(B, T, Hkv, D).transpose(1, 2)
    v = F.linear(x, p["v_proj.weight"], p["v_proj.bias"]).reshape(B, T, Hkv, D).transpose(1, 2)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)  # (B, H, T, D)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, T)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    i = torch.arange(T).view(1, 1, T, 1)
    j = torch.arange(T).view(1, 1, 1, T)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).expand(B, H, T, T)
    if alibi is not None:  # "causal": j - i, "symmetric": -|i - j|
        slopes = alibi_slopes(H, dtype=torch.float64).view(1, H, 1, 1)
        s = s - slopes * (i - j).abs().double()
    if mask is not None:
        s = s.masked_fill(~mask, NEG) if mask.dtype == torch.bool else s + mask
    hide = torch.zeros(B, H, T, T, dtype=torch.bool)
    if mask_mod is not None:
        hide |= ~mask_mod(b, h, i, j).expand(B, H, T, T)
    if causal:
        hide |= j > i
    s = s.masked_fill(hide, NEG)
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: zeros
    applied = w if dropout is None else dropout(w)
    out = (applied @ v).transpose(1, 2).reshape(B, T, H * D)  # (B, T, H·D)
    return F.linear(out, p["out_proj.weight"], p["out_proj.bias"]), applied


def make(H=4, Hkv=4, alibi=None, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    attn = Attention(16, H, num_kv_heads=Hkv, alibi=alibi is not None,
                     alibi_symmetric=alibi == "symmetric", dropout=dropout).double()  # fmt: skip
    with torch.no_grad():
        for prm in attn.parameters():
            prm.add_(0.1 * torch.randn_like(prm))
    return attn


def grads(out, *tensors):
    torch.manual_seed(1)
    probe = torch.randn_like(out)
    return torch.autograd.grad((out * probe).sum(), tensors)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("score,mask_name", [
    (score, mask) for score in SCORE_MODS for mask in ("none", "document", "window", "prefix")
    if (score, mask) != ("none", "none")  # no mod is no flex call: test_attention_module.py
])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T", [7, 13])
def test_attention_flex_equals_reference(heads, score, mask_name, causal, T):
    attn = make(*heads)
    x = torch.randn(2, T, 16, dtype=torch.float64, requires_grad=True)
    score_mod, mask_mod = SCORE_MODS[score], mask_mods(T)[mask_name]
    bm = None if mask_mod is None else qkv.create_block_mask(mask_mod, 2, None, T, T,
                                                             BLOCK_SIZE=4)  # fmt: skip
    out, w = attn(x, is_causal=causal, score_mod=score_mod, block_mask=bm, need_weights=True)
    ref, ref_w = reference(attn, x, score_mod=score_mod, mask_mod=mask_mod, causal=causal)
    assert_close(out, ref, **TOL, name="output")
    assert_close(w, ref_w, **TOL, name="weights")
    params = list(attn.parameters())
    for got, want, name in zip(grads(out, x, *params), grads(ref, x, *params),
                               ["x"] + [n for n, _ in attn.named_parameters()],
                               strict=True):  # fmt: skip
        assert_close(got, want, **TOL, name=f"grad {name}")


@pytest.mark.parametrize("alibi", ["causal", "symmetric"])
@pytest.mark.parametrize("extra", ["none", "bool_mask", "float_mask"])
def test_alibi_and_mask_tensors_fold_after_score_mod(alibi, extra):
    """ALiBi and a mask tensor apply after score_mod (a soft cap never unmasks a key)."""
    T = 13
    attn = make(4, 2, alibi=alibi)
    x = torch.randn(2, T, 16, dtype=torch.float64, requires_grad=True)
    mask = None
    if extra == "bool_mask":  # padding: the last 3 keys of row 1 hidden
        mask = torch.ones(2, 1, 1, T, dtype=torch.bool)
        mask[1, ..., -3:] = False
    elif extra == "float_mask":
        mask = 0.3 * torch.randn(1, 4, T, T, dtype=torch.float64)
    causal = alibi == "causal"
    softcap = SCORE_MODS["softcap"]
    bm = qkv.create_block_mask(mask_mods(T)["document"], 2, None, T, T, BLOCK_SIZE=4)
    out, w = attn(x, is_causal=causal, mask=mask, score_mod=softcap, block_mask=bm,
                  need_weights=True)  # fmt: skip
    ref, ref_w = reference(attn, x, score_mod=softcap, mask_mod=mask_mods(T)["document"],
                           causal=causal, alibi=alibi, mask=mask)  # fmt: skip
    assert_close(out, ref, **TOL, name="output")
    assert_close(w, ref_w, **TOL, name="weights")
    assert_close(grads(out, x)[0], grads(ref, x)[0], **TOL, name="grad x")


def test_block_mask_with_a_cache_is_bottom_right():
    """Prefix then suffix through the KV cache equals one call over the whole sequence."""
    T, split = 13, 8
    attn = make(4, 2)
    x = torch.randn(2, T, 16, dtype=torch.float64)
    mod = mask_mods(T)["document"]
    full, _ = attn(x, is_causal=True, block_mask=qkv.create_block_mask(mod, 2, None, T, T,
                                                                        BLOCK_SIZE=4))
    cache = qkv.nn.LayerKVCache()
    first, _ = attn(x[:, :split], is_causal=True, cache=cache, block_mask=qkv.create_block_mask(
        mod, 2, None, split, split, BLOCK_SIZE=4))  # fmt: skip
    shifted = lambda b, h, q, k: mod(b, h, q + split, k)  # noqa: E731 (queries start at split)
    second, _ = attn(x[:, split:], is_causal=True, cache=cache, block_mask=qkv.create_block_mask(
        shifted, 2, None, T - split, T, BLOCK_SIZE=4))  # fmt: skip
    assert_close(torch.cat([first, second], dim=1), full, **TOL, name="cached output")


def test_dropout_runs_the_dense_path_with_torch_dropout():
    """Attention dropout (training) drops the weights as F.dropout does with the same seed."""
    T = 13
    attn = make(4, 2, dropout=0.3).train()
    x = torch.randn(2, T, 16, dtype=torch.float64, requires_grad=True)
    mod = mask_mods(T)["document"]
    bm = qkv.create_block_mask(mod, 2, None, T, T, BLOCK_SIZE=4)
    torch.manual_seed(7)
    out, w = attn(x, is_causal=True, block_mask=bm, need_weights=True)
    torch.manual_seed(7)
    drop = lambda t: F.dropout(t, 0.3, training=True)  # noqa: E731
    ref, ref_w = reference(attn, x, mask_mod=mod, causal=True, dropout=drop)
    assert_close(out, ref, **TOL, name="output with dropout")
    assert_close(w, ref_w, **TOL, name="dropped weights")
    _, undropped = reference(attn, x, mask_mod=mod, causal=True)
    assert int((w == 0).sum()) > int((undropped == 0).sum()), "dropout dropped nothing"


def test_hooks_on_scores_and_weights_see_and_replace_flex_weights():
    T = 13
    attn = make(4, 2)
    x = torch.randn(2, T, 16, dtype=torch.float64)
    mod, softcap = mask_mods(T)["window"], SCORE_MODS["softcap"]
    bm = qkv.create_block_mask(mod, 2, None, T, T, BLOCK_SIZE=4)
    seen = {}
    handle = attn.hook_scores.add_hook(lambda s, _p: seen.setdefault("scores", s.clone()))
    out, _ = attn(x, score_mod=softcap, block_mask=bm, need_weights=True)
    handle.remove()
    ref, ref_w = reference(attn, x, score_mod=softcap, mask_mod=mod)
    assert_close(out, ref, **TOL, name="output through the dense path")
    assert_close(torch.softmax(seen["scores"], -1).nan_to_num(0), ref_w, **TOL, name="scores")

    def ablate(weights, _p):  # head 0 attends to nothing
        weights = weights.clone()
        weights[:, 0] = 0
        return weights

    handle = attn.hook_weights.add_hook(ablate)
    out, _ = attn(x, score_mod=softcap, block_mask=bm)
    handle.remove()
    H, D = 4, attn.d_head
    _, ref_w = reference(attn, x, score_mod=softcap, mask_mod=mod)
    ref_w = ref_w.clone()
    ref_w[:, 0] = 0
    v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(2, T, 2, D).transpose(1, 2)
    merged = (ref_w @ v.repeat_interleave(2, 1)).transpose(1, 2).reshape(2, T, H * D)
    assert_close(out, attn.out_proj(merged), **TOL, name="ablated output")


@pytest.mark.parametrize("heads,rows", [(None, None), ([3, 1], slice(5, 11)), ([2], -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_capture_rebuilds_flex_weights(heads, rows, causal):
    T = 13
    attn = make(4, 2, alibi="causal" if causal else "symmetric")
    x = torch.randn(2, T, 16, dtype=torch.float64)
    mod, score = mask_mods(T)["document"], SCORE_MODS["head_bias"]
    bm = qkv.create_block_mask(mod, 2, None, T, T, BLOCK_SIZE=4)
    out, w = attn(x, is_causal=causal, score_mod=score, block_mask=bm, need_weights=True)
    with qkv.inspect.capture(attn, heads=heads, rows=rows) as cap:
        again, _ = attn(x, is_causal=causal, score_mod=score, block_mask=bm)
    assert torch.equal(again, out), "capture changed the output"
    hs = list(range(4)) if heads is None else heads
    r = slice(None) if rows is None else slice(T - 1, T) if rows == -1 else rows
    assert_close(cap[0], w[:, hs, r], **TOL, name="captured weights")
    assert cap.kinds[""] == ("causal self" if causal else "self")


def test_block_forwards_score_mod_and_block_mask():
    """A TransformerBlock with a document mask equals the block run on each document alone."""
    torch.manual_seed(0)
    block = TransformerBlock(16, 4, 32, num_kv_heads=2, norm="pre").double()
    lengths = [3, 5, 5]
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]  # (1, 13)
    x = torch.randn(1, 13, 16, dtype=torch.float64, requires_grad=True)
    bm = qkv.create_block_mask(document_mask(ids), 1, None, 13, 13, BLOCK_SIZE=4)
    softcap = SCORE_MODS["softcap"]
    packed = block(x, is_causal=True, block_mask=bm, score_mod=softcap)
    alone = torch.cat([block(part, is_causal=True, score_mod=softcap)
                       for part in x.split(lengths, dim=1)], dim=1)  # fmt: skip
    assert_close(packed, alone, **TOL, name="block output")
    assert_close(grads(packed, x)[0], grads(alone, x)[0], **TOL, name="grad x")


def test_bad_flex_arguments_are_named():
    attn = make()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="score_mod must be a function"):
        attn(x, score_mod=3)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        attn(x, block_mask=torch.ones(6, 6, dtype=torch.bool))
    bm = qkv.create_block_mask(lambda b, h, q, k: q >= k, 1, None, 5, 5)
    with pytest.raises(ValueError, match=r"block_mask was made for Q_LEN=5, KV_LEN=5.*T=6"):
        attn(x, block_mask=bm)
    bm = qkv.create_block_mask(lambda b, h, q, k: q >= k, 3, None, 6, 6)
    with pytest.raises(ValueError, match="block_mask was made for B=3"):
        attn(x, block_mask=bm)


def test_a_replaced_kernel_refuses_flex_calls():
    attn = make()
    attn.kernel = lambda call: (torch.zeros_like(call.query), None)
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="kernel call is replaced"):
        attn(x, score_mod=SCORE_MODS["softcap"])
    out, _ = attn(x)  # non-flex calls still take the replacement
    assert torch.equal(out, attn.out_proj(torch.zeros(1, 6, 16, dtype=torch.float64)))


def test_a_replaced_inputs_record_is_checked():
    attn = make()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    bad = qkv.create_block_mask(lambda b, h, q, k: q >= k, 1, None, 4, 4)

    def swap(inputs: AttentionInputs, _p):
        import dataclasses

        return dataclasses.replace(inputs, block_mask=bad)

    handle = attn.hook_inputs.add_hook(swap)
    with pytest.raises(ValueError, match=r"AttentionInputs\.block_mask was made for Q_LEN=4"):
        attn(x, score_mod=SCORE_MODS["softcap"])
    handle.remove()


def test_a_flex_record_runs_through_flex_parts_only():
    T = 13
    attn = make(4, 2, alibi="causal")
    x = torch.randn(2, T, 16, dtype=torch.float64)
    bm = qkv.create_block_mask(mask_mods(T)["document"], 2, None, T, T, BLOCK_SIZE=4)
    with qkv.inspect.capture(attn, keep_inputs=True) as cap:
        attn(x, is_causal=True, score_mod=SCORE_MODS["softcap"], block_mask=bm)
    (record,) = cap.inputs[""]
    assert record.is_flex and record.block_mask is bm
    with pytest.raises(ValueError, match="has a score_mod or block_mask"):
        record.to_call()
    _, w = qkv.flex_attention(record.query, record.key, record.value, *record.flex_parts(),
                              enable_gqa=True, need_weights=True)  # fmt: skip
    assert_close(w, cap[0], **TOL, name="weights from flex_parts")
