"""Half precision on every backend: float16 and bfloat16 inputs with logits up to ~10⁵ are
computed in float32 (scores, masks, ALiBi, softmax, the weighted sum), as torch's kernels do.

References: ``qkv.reference`` (NumPy float64) on the same, already rounded, inputs; torch's own
kernel in the same dtype for the error bound (flash-attention's rule: at most 2× its error).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hostile_cases import BACKENDS, mask_case, ref_attention, run

import qkv
from helpers import assert_close, max_error
from qkv.attention.backends import math as math_backend
from qkv.attention.call import make_call
from qkv.attention.weights import attention_weights

HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def tiny_flash_tiles(monkeypatch):
    """Flash tiles of 2×3 even for a few queries, so tile edges cut through every case."""
    from qkv.attention import flash_blocks

    blocks = {"float32": (2, 3), "bfloat16": (2, 3), "float64": (2, 3)}
    monkeypatch.setattr(flash_blocks, "BLOCKS", blocks)
    monkeypatch.setattr(flash_blocks, "DECODE_ROWS", 0)


def half_inputs(dtype, amplitude, B=2, H=4, Hkv=2, T=33, S=40, D=16, seed=0):
    """Queries and keys of ``amplitude`` (logits ~ amplitude²), rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, T, D, generator=g) * amplitude).to(dtype)
    k = (torch.randn(B, Hkv, S, D, generator=g) * amplitude).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("kind", ["none", "causal", "float", "alibi", "window"])
@pytest.mark.parametrize("amplitude", [1.0, 10.0, 100.0])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_output_is_as_exact_as_torch(backend, dtype, amplitude, kind):
    """Logits up to ~10⁵ (float16 ``q·k`` overflows at 65504): the output is within one
    rounding of the float64 truth and at most 2× torch's own kernel's error."""
    q, k, v = half_inputs(dtype, amplitude)
    kw, add, _ = mask_case(kind, q.shape[1], q.shape[2], k.shape[2])
    ref, _ = ref_attention(q, k, v, add)
    out, _ = run(backend, q, k, v, kw, need_weights=False)
    mask32 = torch.from_numpy(add).float().to(q.device) if kind != "none" else None
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask32, enable_gqa=True)
    eps = torch.finfo(dtype).eps
    atol = max(2 * max_error(torch_out, ref), eps * float(np.abs(ref).max()))
    assert_close(out, ref, atol=atol, name=f"{backend} {dtype} amplitude {amplitude} {kind}")


@pytest.mark.parametrize("kind", ["none", "causal", "float", "alibi"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_weights_are_exact(backend, dtype, kind):
    """Weights (math: the softmax itself; flash and torch: rebuilt from the lse) are within
    one rounding of the float64 softmax, large logits included."""
    q, k, v = half_inputs(dtype, 30.0, H=2, Hkv=2)
    kw, add, _ = mask_case(kind, 2, q.shape[2], k.shape[2])
    _, ref_w = ref_attention(q, k, v, add)
    _, w = run(backend, q, k, v, kw, need_weights=True)
    assert w.dtype == dtype
    atol = torch.finfo(dtype).eps
    chosen = qkv.attention.explain(q, k, v, need_weights=True, backend=backend, **kw).chosen
    if chosen == "triton":
        # Triton (as FlashAttention) takes exponents in base 2: the float32 product
        # s·log2(e) and the base-2 lse each round by up to half an ulp of |s|·log2(e), here
        # ~3.6e3·1.44: a weight moves by about that much (2.4e-4 each) before its rounding.
        logits = float((q.double() @ k.double().transpose(-2, -1)).abs().max()) / 4.0
        atol += 4 * logits * 1.4427 * torch.finfo(torch.float32).eps / 2
    assert_close(w, ref_w, atol=atol, name=f"{backend} {dtype} {kind} weights ({chosen})")


@pytest.mark.parametrize("dtype", HALF)
def test_weights_rebuilt_from_an_lse_are_exact_in_half_precision(dtype):
    q, k, v = half_inputs(dtype, 30.0, H=4, Hkv=2)
    lse = torch.logsumexp(
        (q.float() @ k.float().repeat_interleave(2, 1).transpose(-2, -1)) / 4.0, dim=-1
    )  # (B, H, T)
    w = attention_weights(q, k, lse, enable_gqa=True, heads=[1, 3], rows=slice(5, 9))
    _, ref_w = ref_attention(q, k, v, None)
    assert_close(w, ref_w[:, [1, 3], 5:9], atol=torch.finfo(dtype).eps, name="rebuilt weights")


@pytest.mark.parametrize("dtype", HALF)
def test_a_float32_mask_is_not_rounded_to_half_precision(dtype):
    """A float32 mask whose entries need more than 8 bits keeps them on every backend."""
    q, k, v = half_inputs(dtype, 1.0, H=2, Hkv=2)
    g = torch.Generator().manual_seed(3)
    mask = torch.randn(q.shape[2], k.shape[2], generator=g) * 40.0 + 0.123  # (T, S) float32
    ref, _ = ref_attention(q, k, v, mask.double().cpu().numpy()[None, None])
    for backend in BACKENDS:
        if backend == "torch" and q.device.type != "cpu":
            # Torch's GPU kernels take a float mask in q's dtype only: named, it rounds it
            # (documented); auto leaves such a call to a backend that does not.
            assert "would be rounded" in qkv.attention.explain(q, k, v, mask).reasons["torch"]
            continue
        out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
        atol = 2 * torch.finfo(dtype).eps * float(np.abs(ref).max())
        assert_close(out, ref, atol=atol, name=f"{backend} {dtype} float32 mask")


def test_math_hooks_see_float32_and_their_replacements_are_used():
    """For half inputs the hook points of the math path see the float32 values the output
    is computed from; a replacement (of any float dtype) is what the output uses."""
    q, k, v = half_inputs(torch.bfloat16, 30.0, H=2, Hkv=2)
    call = make_call(q, k, v, None, 0.0, True, None, False, True)
    seen = {}

    def read(name):
        def hook(t):
            seen[name] = t.dtype
            return t
        return hook

    out, w = math_backend.run(call, on_scores=read("scores"), on_weights=read("weights"))
    plain, plain_w = math_backend.run(call)
    assert seen == {"scores": torch.float32, "weights": torch.float32}
    assert torch.equal(out, plain) and torch.equal(w, plain_w)
    assert out.dtype == w.dtype == torch.bfloat16

    def uniform(t):  # every visible key equally: a bfloat16 replacement
        keep = torch.isfinite(t)
        return (keep / keep.sum(-1, keepdim=True)).to(torch.bfloat16)

    out, w = math_backend.run(call, on_weights=lambda t: uniform(call_scores(call)))
    expected = torch.cumsum(v.double(), dim=2) / torch.arange(1, 41, dtype=torch.float64)[:, None]
    assert_close(out, expected[:, :, :33], atol=2 * torch.finfo(torch.bfloat16).eps * 4,
                 name="output from replaced weights")


def call_scores(call):
    """Causal scores of ``call`` with -inf above the diagonal, float32 ``(B, H, T, S)``."""
    s = call.query.float() @ call.key.float().transpose(-2, -1)
    T, S = s.shape[-2:]
    return s.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1), float("-inf"))


def test_module_output_is_the_same_with_a_hook_on_the_scores():
    """A hook on ``hook_scores`` switches a bfloat16 module to the math path: the output
    stays within one rounding of the fused kernel's."""
    torch.manual_seed(0)
    mha = qkv.nn.MultiheadAttention(32, 4, batch_first=True).to(torch.bfloat16).eval()
    x = (torch.randn(2, 9, 32) * 8).to(torch.bfloat16)
    fused, _ = mha(x, x, x, need_weights=False)
    dtypes = []
    handle = mha.hook_scores.add_hook(lambda s, _p: dtypes.append(s.dtype))
    hooked, _ = mha(x, x, x, need_weights=False)
    handle.remove()
    assert dtypes == [torch.float32]
    atol = 2 * torch.finfo(torch.bfloat16).eps * float(fused.detach().abs().max())
    assert_close(hooked, fused, atol=atol, name="math path (hooked) vs fused, bfloat16")


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_dropout_is_the_same_on_math_and_flash(dtype):
    q, k, v = half_inputs(dtype, 3.0, H=4, Hkv=2)
    outs = []
    for backend in ("math", "flash"):
        torch.manual_seed(11)
        outs.append(qkv.scaled_dot_product_attention(
            q, k, v, dropout_p=0.3, is_causal=True, enable_gqa=True, backend=backend
        ))
    atol = 2 * torch.finfo(dtype).eps * float(outs[0].abs().max())
    assert_close(outs[0], outs[1], atol=atol, name=f"math vs flash dropout ({dtype})")


