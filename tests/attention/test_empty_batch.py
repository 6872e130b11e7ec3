"""An empty batch (B = 0) gives an empty result on every path, as torch's kernels do.

Every backend in the registry, with and without weights and log-sum-exp, forward and
backward; programmable attention; flash-decoding (one query); the modules. Shapes are
compared with torch's ``scaled_dot_product_attention`` on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.attention.dispatch import BACKENDS

CASES = [  # (H, Hkv, T, S, causal, mask)
    (4, 4, 5, 7, False, None),
    (4, 2, 5, 7, True, None),
    (4, 1, 1, 9, False, "bool"),  # one query: the decoding path
    (4, 4, 6, 6, False, "float"),
]


def _inputs(H, Hkv, T, S, mask):
    q, k, v = torch.randn(0, H, T, 8), torch.randn(0, Hkv, S, 8), torch.randn(0, Hkv, S, 8)
    m = None
    if mask == "bool":
        m = torch.ones(0, 1, T, S, dtype=torch.bool)
    elif mask == "float":
        m = torch.zeros(0, 1, T, S)
    return q, k, v, m


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize(("H", "Hkv", "T", "S", "causal", "mask"), CASES)
def test_empty_batch_gives_an_empty_result(backend, H, Hkv, T, S, causal, mask):
    q, k, v, m = _inputs(H, Hkv, T, S, mask)
    gqa = H != Hkv
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal,
                                          enable_gqa=gqa)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = qkv.scaled_dot_product_attention(*leaves, attn_mask=m, is_causal=causal,
                                           enable_gqa=gqa, backend=backend)
    assert out.shape == want.shape == (0, H, T, 8), (out.shape, want.shape)
    out.sum().backward()
    for leaf in leaves:
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape, leaf.grad
    lse_refused = backend == "torch" and gqa  # torch's kernel: no grouped lse (tested apart)
    if not lse_refused:
        out, lse = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal,
                                                    enable_gqa=gqa, backend=backend,
                                                    return_lse=True)
        assert out.shape == (0, H, T, 8) and lse.shape == (0, H, T), (out.shape, lse.shape)
    if backend != "torch":  # torch's kernel returns no weights (a clear refusal, tested apart)
        out, w = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal,
                                                  enable_gqa=gqa, backend=backend,
                                                  need_weights=True)
        assert out.shape == (0, H, T, 8) and w.shape == (0, H, T, S), (out.shape, w.shape)


@pytest.mark.parametrize("score_mod", [None, lambda s, b, h, q, k: s * 0.5])
def test_flex_with_an_empty_batch(score_mod):
    q = torch.randn(0, 2, 200, 8, requires_grad=True)
    block_mask = qkv.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 200, 200)
    out, lse, w = qkv.flex_attention(q, q, q, score_mod, block_mask, return_lse=True,
                                     need_weights=True)
    assert out.shape == (0, 2, 200, 8) and lse.shape == (0, 2, 200) and w.shape == (0, 2, 200, 200)
    qkv.flex_attention(q, q, q, score_mod, block_mask).sum().backward()
    assert q.grad.shape == q.shape


def test_modules_with_an_empty_batch():
    mha = qkv.nn.MultiheadAttention(16, 4, batch_first=True)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(0, 5, 16)
    out, w = mha(x, x, x)
    want, want_w = ref(x, x, x)
    assert out.shape == want.shape and w.shape == want_w.shape, (out.shape, w.shape)
