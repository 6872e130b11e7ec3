"""Paged attention on the Triton kernel (``PagedKVCache(kernel="triton")``) against the
chunked path through qkv's attention core, in float64 where it can.

Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py) with 16×16 tiles, so pages of 3 and 16 positions cut across tiles. Three
sequences with 0, 5 and 17 positions cached each add ``T`` new queries (a prompt, a decoding
step); grouped heads; head widths that are and are not a power of two. Tolerances as in
test_triton.py: float32 within 1e-5 of float64; bfloat16 within twice the chunked path's own
error plus one rounding.
"""

from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, assert_close, max_error
from qkv.attention import triton as triton_env
from qkv.nn.paged_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not triton_env.installed(), reason="triton is not installed")

CACHED = (0, 5, 17)  # positions each sequence holds before this forward


def _attend(kernel, page, T, H=4, Hkv=2, D=16, Dv=16, dtype=torch.float32, nan_row=False):
    """The output of one paged forward: ``(B, H, T, Dv)``, the same pages and inputs for
    every kernel and dtype."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, num_blocks=40, block_size=page, kv_heads=Hkv, head_dim=D,
                         dtype=dtype, device=DEVICE, kernel=kernel)
    layer = cache.layers[0]
    if Dv != D:  # values of another width
        layer.v_pool = torch.zeros(40, Hkv, page, Dv, dtype=dtype, device=DEVICE)
    tables = [cache.allocate(cache.blocks_for(n + T)) for n in CACHED]
    for pool in (layer.k_pool, layer.v_pool):  # earlier positions: random, in every page
        pool.copy_(torch.randn(pool.shape, generator=g, dtype=torch.float64).to(pool))
    cache.set_batch(tables, list(CACHED))
    B = len(CACHED)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, T, Dv, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    if nan_row:
        q[1, 3, T - 1, 2] = float("nan")
    with torch.no_grad():
        return layer.attend(q, k, v, scale=None)


@pytest.mark.parametrize("page", [3, 16])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("D,Dv", [(16, 16), (24, 20)])
def test_paged_kernel_equals_the_chunked_path_in_float64(page, T, D, Dv):
    out = _attend("triton", page, T, D=D, Dv=Dv)
    exact = _attend("chunks", page, T, D=D, Dv=Dv, dtype=torch.float64)
    assert_close(out, exact, atol=1e-5, rtol=1e-5, name=f"paged page={page} T={T} D={D}")


def test_bfloat16_within_twice_the_chunked_paths_error():
    out = _attend("triton", 3, 4, dtype=torch.bfloat16)
    exact = _attend("chunks", 3, 4, dtype=torch.float64)
    chunks = _attend("chunks", 3, 4, dtype=torch.bfloat16)
    bound = 2 * max_error(chunks, exact) + 2**-8 * float(exact.abs().max())
    assert max_error(out, exact) <= bound, f"{max_error(out, exact):.3e} > {bound:.3e}"


def test_a_non_finite_query_row_is_nan_and_the_rest_unchanged():
    out = _attend("triton", 16, 2, nan_row=True)
    ref = _attend("chunks", 16, 2, nan_row=True)
    assert out[1, 3, 1].isnan().all() and ref[1, 3, 1].isnan().all()
    ok = ~out.isnan().any(-1)
    assert ok.sum() == out[..., 0].numel() - 1
    assert_close(out[ok], ref[ok], atol=1e-5, rtol=1e-5, name="finite rows")


def test_kernel_choice_and_refusals():
    cache = PagedKVCache(1, num_blocks=4, block_size=4, kv_heads=1, head_dim=8)
    q = torch.randn(1, 2, 1, 8, device=DEVICE)
    assert cache.fused(q) == (DEVICE.type == "cuda")  # auto: the kernel on a GPU only
    assert not PagedKVCache(1, num_blocks=4, block_size=4, kv_heads=1, head_dim=8,
                            kernel="chunks").fused(q)
    forced = PagedKVCache(1, num_blocks=4, block_size=4, kv_heads=1, head_dim=8,
                          kernel="triton")
    with pytest.raises(ValueError, match="float32/bfloat16/float16 queries"):
        forced.fused(q.double())
    with pytest.raises(ValueError, match="kernel must be one of auto, triton, chunks"):
        PagedKVCache(1, num_blocks=4, block_size=4, kv_heads=1, head_dim=8, kernel="cuda")
