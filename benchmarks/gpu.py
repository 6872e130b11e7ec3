"""GPU benchmark suite: qkv's ``triton`` backend against ``auto`` and torch's kernels.

    python benchmarks/gpu.py [--device cuda|cpu] [--quick] [--out PATH] [--max-seconds N]
                             [--groups dense,decode,paged,alibi,window,document,relative,weights]

CPU dry run (tiny sizes, Triton's interpreter):
    TRITON_INTERPRET=1 python benchmarks/gpu.py --device cpu --quick --out /tmp/gpu_dry.json

The cases, timing method and JSON layout are described in :mod:`qkv.bench.gpu`; this script
adds paged decoding (``qkv.nn.PagedKVCache``, a layer above what ``qkv.bench`` imports): the
Triton kernel reading pages in place, the chunked gather, and torch's SDPA on the same cache
unpaged.
"""

import sys

import torch
import torch.nn.functional as F

from qkv.bench.gpu import _guard, _math, _qkv, main
from qkv.nn.paged_cache import PagedKVCache


def _paged(dev, sh, page=16):
    """A paged decoding step (write the new key and value, attend) of every implementation."""
    (q, k, v), (B, Hkv, S, D) = _qkv(dev, sh), (sh["B"], sh["Hkv"], sh["S"], sh["D"])

    def pages(t):  # (pages, Hkv, page, D): sequence b's pages in order
        return t.reshape(B, Hkv, S // page, page, D).transpose(1, 2).reshape(
            B * S // page, Hkv, page, D)
    tables = torch.arange(B * S // page).reshape(B, S // page).tolist()
    new = (k[:, :, -1:], v[:, :, -1:])  # the step writes what is there: the cache unchanged

    def paged(kernel):
        cache = PagedKVCache(1, num_blocks=B * S // page, block_size=page, kv_heads=Hkv,
                             head_dim=D, dtype=q.dtype, device=dev, kernel=kernel)
        layer = cache.layers[0]
        layer.k_pool, layer.v_pool = pages(k), pages(v)
        cache.set_batch(tables, [S - 1] * B)
        return lambda q, k, v: layer.attend(q, *new, scale=None)
    impls = {"triton": _guard(paged, "triton"), "chunks": paged("chunks"),
             "torch_sdpa_unpaged": lambda q, k, v: F.scaled_dot_product_attention(
                 q, k, v, enable_gqa=True)}
    return (q, k, v), impls, lambda: _math(q, k, v, enable_gqa=True)


def paged_cases(quick: bool) -> list[dict]:
    """Paged decoding, 8 sequences of 4096 positions in pages of 16 (H=32 over Hkv=8)."""
    shapes = dict(B=2, H=2, Hkv=1, D=32, T=1, S=64) if quick else dict(
        B=8, H=32, Hkv=8, D=128, T=1, S=4096)
    return [dict(name=f"paged decode S={shapes['S']}", group="paged", shapes=shapes,
                 bwd=False, build=_paged, base="triton")]


if __name__ == "__main__":
    sys.exit(main(extra_cases=paged_cases))
