"""qkv's TransformerEncoder reproduces torch's nested-tensor path, and only where torch takes it.

torch's encoder converts a padded batch to a nested tensor in eval mode when
``enable_nested_tensor`` is on and a dozen other conditions hold; its output is then zero at
padded positions (``to_padded_tensor(0.)``), and a Transformer's decoder reads that memory.
Each row of the grid below says whether torch takes the path (and if not, torch's reason, in
torch's words); the test checks qkv's decision, torch's evidence (zero rows in its output) and
every output position against torch in float64.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import qkv.nn as qn
from helpers import assert_close

E, H, FF, N, S, T = 8, 2, 16, 3, 6, 5
F64 = torch.float64
TOL = dict(atol=1e-9, rtol=1e-9)

# Padding masks, torch polarity (True = padding); "left" = padding only at the end of each row.
LEFT = [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]]
RAGGED = [[0, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0], [1, 0, 0, 1, 1, 1]]
FULL_ROW = [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]

TAKEN = ""
GRAD = ("grad is enabled and at least one of query or the input/output projection weights or "
        "biases requires_grad")
# id: (layer kwargs, encoder kwargs, forward setup, torch's reason; TAKEN = nested path).
GRID = {
    "base": ({}, {}, {}, TAKEN),
    "gelu": ({"activation": "gelu"}, {}, {}, TAKEN),
    "gelu_module": ({"activation": torch.nn.GELU()}, {}, {}, TAKEN),
    "relu_module_3_layers_norm": ({"activation": torch.nn.ReLU()}, {"layers": 3, "norm": True},
                                  {}, TAKEN),
    "float_kpm": ({}, {}, {"kpm": "float"}, TAKEN),
    "float_kpm_finite": ({}, {}, {"kpm": "float_finite"}, TAKEN),  # -1.0 counts as padding
    "fully_padded_row": ({}, {}, {"kpm": FULL_ROW}, TAKEN),
    "ragged_no_mask_check": ({}, {"mask_check": False}, {"kpm": RAGGED}, TAKEN),  # prefixes
    "no_grad_needed": ({}, {}, {"grad": True, "frozen": True}, TAKEN),
    "ragged": ({}, {}, {"kpm": RAGGED},
               "mask_check enabled, and src and src_key_padding_mask was not left aligned"),
    "tanh": ({"activation": torch.tanh}, {}, {},
             "self.use_nested_tensor (set in init) was not True"),
    "seq_first": ({"batch_first": False}, {}, {},
                  "self.use_nested_tensor (set in init) was not True"),
    "norm_first": ({"norm_first": True}, {}, {},
                   "self.use_nested_tensor (set in init) was not True"),
    "no_bias": ({"bias": False}, {}, {}, "self.use_nested_tensor (set in init) was not True"),
    "odd_heads": ({"nhead": 1}, {}, {}, "self.use_nested_tensor (set in init) was not True"),
    "nested_off": ({}, {"enable_nested_tensor": False}, {},
                   "self.use_nested_tensor (set in init) was not True"),
    "training": ({}, {}, {"training": True}, "self.layers[0] was in training mode"),
    "grad": ({}, {}, {"grad": True}, GRAD),
    "mask_too": ({}, {}, {"mask": True}, "src_key_padding_mask and mask were both supplied"),
    "no_kpm": ({}, {}, {"kpm": None}, "src_key_padding_mask was None"),
    "unbatched": ({}, {}, {"unbatched": True},
                  "input not batched; expected src.dim() of 3 but got 2"),
    "fastpath_off": ({}, {}, {"fastpath": False},
                     "torch.backends.mha.get_fastpath_enabled() was not True"),
}


def _kpm(spec, unbatched):
    if spec is None:
        return None
    if isinstance(spec, list):
        m = torch.tensor(spec, dtype=torch.bool)
    else:
        m = torch.tensor(LEFT, dtype=torch.bool)
    if spec == "float":
        m = torch.zeros(m.shape, dtype=F64).masked_fill(m, float("-inf"))
    elif spec == "float_finite":
        m = torch.zeros(m.shape, dtype=F64).masked_fill(m, -1.0)
    return m[0] if unbatched else m


def _pair(layer_kw, enc_kw):
    layer_kw = {"nhead": H, "dropout": 0.0, "batch_first": True, **layer_kw}
    norm, layers = enc_kw.pop("norm", False), enc_kw.pop("layers", 2)

    def build(nn):
        layer = nn.TransformerEncoderLayer(E, dim_feedforward=FF, dtype=F64, **layer_kw)
        final = torch.nn.LayerNorm(E, dtype=F64) if norm else None
        return nn.TransformerEncoder(layer, layers, final, **enc_kw)

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "enable_nested_tensor is True, but ..."
        ref = build(torch.nn)
    ours = build(qn)
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert ours.use_nested_tensor == ref.use_nested_tensor
    return ref, ours


@contextlib.contextmanager
def _fastpath(enabled):
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


@pytest.mark.parametrize("name", GRID)
def test_encoder_nested_path_matches_torch(name):
    layer_kw, enc_kw, setup, reason = GRID[name]
    ref, ours = _pair(dict(layer_kw), dict(enc_kw))
    unbatched = setup.get("unbatched", False)
    batch_first = layer_kw.get("batch_first", True)
    shape = (S, E) if unbatched else (N, S, E) if batch_first else (S, N, E)
    src = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    kw = {"src_key_padding_mask": _kpm(setup.get("kpm", "left"), unbatched)}
    if setup.get("mask"):
        kw["mask"] = torch.rand(S, S, generator=torch.Generator().manual_seed(2)) < 0.3
        kw["mask"].fill_diagonal_(False)
    for module in (ref, ours):
        module.train(setup.get("training", False))
        module.requires_grad_(not setup.get("frozen", False))
    with _fastpath(setup.get("fastpath", True)), torch.set_grad_enabled(setup.get("grad", False)):
        assert ours.why_not_nested(src, kw.get("mask"), kw["src_key_padding_mask"]) == reason
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r_out, o_out = ref(src, **kw), ours(src, **kw)
    if ref.norm is None:  # torch's own evidence: zero rows come from its nested path only
        zero_rows = bool(r_out.eq(0).all(-1).any())
        assert zero_rows == (reason == TAKEN), f"torch zero rows: {zero_rows}"
    assert_close(o_out, r_out, **TOL, name=f"{name} output")


@pytest.mark.parametrize(
    ("config", "taken"),
    [({"batch_first": True}, True), ({"batch_first": True, "activation": "gelu"}, True),
     ({"batch_first": False}, False), ({"batch_first": True, "norm_first": True}, False)],
)
def test_transformer_eval_reads_the_same_memory(config, taken):
    """The module_db failure: the decoder attends to the memory torch's nested path made."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.nn.Transformer(E, H, 2, 2, FF, 0.0, dtype=F64, **config).eval()
    ours = qn.Transformer(E, H, 2, 2, FF, 0.0, dtype=F64, **config).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(3)
    src, tgt = torch.randn(N, S, E, generator=g, dtype=F64), torch.randn(N, T, E, generator=g,
                                                                         dtype=F64)
    if not config["batch_first"]:
        src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
    kpm = _kpm("left", False)
    # No memory_key_padding_mask: the decoder reads the padded memory positions too, zeros
    # where torch's encoder took the nested path (module_db's Transformer sample 25).
    kw = {"src_key_padding_mask": kpm,
          "tgt_mask": qn.Transformer.generate_square_subsequent_mask(T, dtype=F64)}
    with torch.no_grad():
        assert (ours.encoder.why_not_nested(src, None, kpm) == "") is taken
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r_out, o_out = ref(src, tgt, **kw), ours(src, tgt, **kw)
    assert_close(o_out, r_out, **TOL, name="transformer output")
