"""The torch drop-ins capture with ``torch.export`` (qkv's supported path; not TorchScript).

``torch.jit.script`` cannot compile qkv's modules (Python-level dispatch, closures, keyword-only
extras), so TorchScript is documented as unsupported and ``torch.export.export`` /
``torch.compile`` are the ways to capture them. Each test exports a drop-in (``strict=False``,
torch's recommended mode) and checks that the exported program equals the eager module, and
torch's module, on fresh inputs of the same shapes.
"""

from __future__ import annotations

import warnings

import torch

import qkv.nn as qn
from helpers import assert_close

E, H, FF, N, T, S = 8, 2, 16, 3, 5, 6
TOL = dict(atol=1e-5, rtol=1e-5)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(seed):
    g = _gen(seed)
    q, kv = torch.randn(N, T, E, generator=g), torch.randn(N, S, E, generator=g)
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[0, -2:] = True
    return q, kv, kpm


def test_export_multihead_attention_matches_eager_and_torch():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = qn.MultiheadAttention(E, H, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    q, kv, kpm = _inputs(1)
    program = torch.export.export(ours, (q, kv, kv), {"key_padding_mask": kpm}, strict=False)
    q, kv, _ = _inputs(2)  # fresh values, same shapes
    out, weights = program.module()(q, kv, kv, key_padding_mask=kpm)
    eager = ours(q, kv, kv, key_padding_mask=kpm)
    expected = ref(q, kv, kv, key_padding_mask=kpm)
    for got, want, name in [(out, eager[0], "output vs eager"), (weights, eager[1],
                            "weights vs eager"), (out, expected[0], "output vs torch"),
                            (weights, expected[1], "weights vs torch")]:
        assert_close(got, want, **TOL, name=name)


def test_export_encoder_layer_matches_eager_and_torch():
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=True).eval()
    ours = qn.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    _, src, kpm = _inputs(1)
    program = torch.export.export(ours, (src,), {"src_key_padding_mask": kpm}, strict=False)
    _, src, _ = _inputs(2)
    out = program.module()(src, src_key_padding_mask=kpm)
    assert_close(out, ours(src, src_key_padding_mask=kpm), **TOL, name="output vs eager")
    assert_close(out, ref(src, src_key_padding_mask=kpm), **TOL, name="output vs torch")


def test_export_encoder_runs_the_general_path_like_torch():
    """Under export torch's encoder never takes its nested path (mask_check, or parameters
    that need grad), so padded positions keep their values; qkv decides the same way."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=True), 2).eval()
    ours = qn.TransformerEncoder(qn.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=True), 2)
    ours.load_state_dict(ref.state_dict(), strict=True)
    ours.eval()
    _, src, kpm = _inputs(1)
    program = torch.export.export(ours, (src,), {"src_key_padding_mask": kpm}, strict=False)
    out = program.module()(src, src_key_padding_mask=kpm)
    assert not out.eq(0).all(-1).any(), "no zeroed positions in the exported program"
    assert_close(out, ref(src, src_key_padding_mask=kpm), **TOL, name="output vs torch")
