"""Peak memory of a flex call: the output plus one group of tiles, whatever the length.

Each probe runs one inference call in a fresh interpreter (peak-RSS growth over the call,
inputs not counted: :mod:`qkv.bench.measure`), at T and 2T. Beyond the output (and its
log-sum-exp), the call may hold a few ``(B, H, GROUP_ROWS, SPAN_KEYS)`` float32 tiles: the
scores, their exps and a ``score_mod``'s temporaries; nothing that grows with T.
"""

from __future__ import annotations

import sys

import pytest

from qkv.attention.flex.loop import GROUP_ROWS, SPAN_KEYS
from qkv.bench.measure import run_probe

MiB = 2**20
B, H, D = 1, 8, 64
TILE = B * H * GROUP_ROWS * SPAN_KEYS * 4  # one float32 group of tiles

PROBE = r"""
import json, sys, torch, qkv
from qkv.bench.measure import peak_rss_bytes, reset_peak_rss
T, kind = int(sys.argv[1]), sys.argv[2]
q, k, v = (torch.randn(1, 8, T, 64) for _ in range(3))
mods = {"window": lambda b, h, i, j: (i >= j) & (i - j < 256), "causal": lambda b, h, i, j: i >= j}
mask = mods["window" if kind == "window" else "causal"]
score = (lambda s, b, h, i, j: 30 * torch.tanh(s / 30)) if kind == "softcap" else None
bm = qkv.create_block_mask(mask, None, None, T, T)
qkv.flex_attention(*(t[:, :, :300] for t in (q, k, v)), score,
                   qkv.create_block_mask(mask, None, None, 300, 300))  # warm-up
reset_peak_rss()
base = peak_rss_bytes()
with torch.no_grad():
    out = qkv.flex_attention(q, k, v, score, bm)
print(json.dumps({"peak": peak_rss_bytes() - base, "out": out.numel() * out.element_size()}))
"""


def _extra(T: int, kind: str) -> int:
    """Peak bytes of one call beyond its output and log-sum-exp."""
    r = run_probe([sys.executable, "-c", PROBE, str(T), kind], threads=2, timeout=300)
    return r["peak"] - r["out"] - B * H * T * 4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["window", "causal", "softcap"])
def test_flex_peak_is_the_output_and_one_group_of_tiles(kind):
    small, large = _extra(2048, kind), _extra(4096, kind)
    assert large <= 4 * TILE, (
        f"{kind}: {large / MiB:.1f} MiB beyond the output at T=4096 (a group of tiles is "
        f"{TILE / MiB:.1f} MiB)")
    assert large - small <= 2 * MiB, (
        f"{kind}: the extra grew from {small / MiB:.1f} to {large / MiB:.1f} MiB from T=2048 "
        "to 4096: something O(T) beyond the output, or O(T^2)")
