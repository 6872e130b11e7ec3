"""Every mask argument of every torch drop-in, in every dtype, against torch itself.

For each (module, mask argument, dtype) torch is run first and decides what qkv must do:

* torch accepts the mask (bool, or the inputs' float dtype): qkv's output equals torch's;
* torch refuses it with ``AssertionError: only bool and floating types of ...`` (integer and
  complex masks): qkv raises ``DropInTypeError`` (an AssertionError and a TypeError) whose
  message names the argument as *this* module calls it (``mask``, ``src_mask``, ...);
* torch crashes deep inside (``RuntimeError`` from ``bmm``/SDPA for a float mask of another
  precision; ``torch.full`` overflowing on an integer ``tgt_mask``): qkv either names the
  argument in a ``DropInTypeError`` (integers) or, for a float mask of another precision,
  computes what torch computes with the mask cast to the inputs' dtype.

Then the hostile values torch has no single answer for: masks on another device (``meta``),
non-tensor masks, wrong shapes, and mismatched ``src``/``tgt``/``memory`` batches.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import qkv.nn as qn
from qkv.nn.errors import DropInArgumentError, DropInTypeError

E, H, N, S, T = 8, 2, 3, 5, 4
DTYPES = [torch.bool, torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.uint8, torch.int8, torch.complex64]  # fmt: skip
G = torch.Generator().manual_seed(0)
SRC, TGT = torch.randn(N, S, E, generator=G), torch.randn(N, T, E, generator=G)


def _mask(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The last key hidden: True, or -1e4 added, or 1 in an integer mask."""
    if dtype == torch.bool:
        m = torch.zeros(shape, dtype=torch.bool)
        m[..., -1] = True
        return m
    m = torch.zeros(shape, dtype=dtype)
    m[..., -1] = -1e4 if (dtype.is_floating_point or dtype.is_complex) else 1
    return m


def _mha(m):
    return m.MultiheadAttention(E, H, batch_first=True)


def _enc_layer(m):
    return m.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True)


def _dec_layer(m):
    return m.TransformerDecoderLayer(E, H, 16, dropout=0.0, batch_first=True)


# name -> (build(module namespace), call(module, mask), mask shape, the argument qkv names)
CASES = {
    "mha.attn_mask": (_mha, lambda mod, k: mod(SRC, SRC, SRC, attn_mask=k)[0], (S, S),
                      "attn_mask"),
    "mha.key_padding_mask": (_mha, lambda mod, k: mod(SRC, SRC, SRC, key_padding_mask=k)[0],
                             (N, S), "key_padding_mask"),
    "enc_layer.src_mask": (_enc_layer, lambda mod, k: mod(SRC, src_mask=k), (S, S),
                           "src_mask"),
    "enc_layer.src_key_padding_mask": (_enc_layer, lambda mod, k: mod(
        SRC, src_key_padding_mask=k), (N, S), "src_key_padding_mask"),
    "encoder.mask": (lambda m: m.TransformerEncoder(_enc_layer(m), 2, enable_nested_tensor=False),
                     lambda mod, k: mod(SRC, mask=k), (S, S), "mask"),
    "encoder.src_key_padding_mask": (lambda m: m.TransformerEncoder(_enc_layer(m), 2),
                                     lambda mod, k: mod(SRC, src_key_padding_mask=k), (N, S),
                                     "src_key_padding_mask"),
    "dec_layer.tgt_mask": (_dec_layer, lambda mod, k: mod(TGT, SRC, tgt_mask=k), (T, T),
                           "tgt_mask"),
    "dec_layer.memory_mask": (_dec_layer, lambda mod, k: mod(TGT, SRC, memory_mask=k), (T, S),
                              "memory_mask"),
    "decoder.tgt_mask": (lambda m: m.TransformerDecoder(_dec_layer(m), 2),
                         lambda mod, k: mod(TGT, SRC, tgt_mask=k), (T, T), "tgt_mask"),
    "decoder.memory_key_padding_mask": (lambda m: m.TransformerDecoder(_dec_layer(m), 2),
                                        lambda mod, k: mod(TGT, SRC, memory_key_padding_mask=k),
                                        (N, S), "memory_key_padding_mask"),
}
TRANSFORMER_ARGS = {"src_mask": (S, S), "tgt_mask": (T, T), "memory_mask": (T, S),
                    "src_key_padding_mask": (N, S), "tgt_key_padding_mask": (N, T),
                    "memory_key_padding_mask": (N, S)}  # fmt: skip
for _arg, _shape in TRANSFORMER_ARGS.items():
    CASES[f"transformer.{_arg}"] = (
        lambda m: m.Transformer(E, H, 1, 1, 16, dropout=0.0, batch_first=True),
        lambda mod, k, a=_arg: mod(SRC, TGT, **{a: k}), _shape, _arg,
    )


@pytest.fixture(scope="module")
def pairs():
    """(torch module, qkv module with torch's weights), eval mode, per case."""
    out = {}
    for name, (build, *_rest) in CASES.items():
        torch.manual_seed(0)
        ref = build(torch.nn).eval()
        ours = build(qn).eval()
        ours.load_state_dict(ref.state_dict())
        out[name] = (ref, ours)
    return out


def _run(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notes on mixed mask types
        try:
            return fn(), None
        except Exception as err:  # torch's outcome, whatever it is, is what is under test
            return None, err


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", list(CASES))
def test_each_mask_dtype_does_what_torch_does_or_names_the_argument(pairs, case, dtype):
    _, call, shape, arg = CASES[case]
    ref, ours = pairs[case]
    mask = _mask(shape, dtype)
    want, torch_error = _run(lambda: call(ref, mask))
    if torch_error is None:  # 1) torch accepts: the same values
        got = call(ours, mask)
        err = float((got - want).detach().abs().max())
        assert err <= 1e-5, f"{case} {dtype}: max |qkv - torch| = {err:.2e}"
        return
    if dtype.is_floating_point:  # 3) torch crashes on another float precision; qkv casts
        assert isinstance(torch_error, RuntimeError), repr(torch_error)
        got = call(ours, mask)
        want = call(ref, mask.to(SRC.dtype))
        err = float((got - want).detach().abs().max())
        assert err <= 1e-5, f"{case} {dtype}: max |qkv - torch(cast mask)| = {err:.2e}"
        return
    # 2) torch refuses (AssertionError) or crashes (RuntimeError in torch.full): qkv names it
    assert isinstance(torch_error, AssertionError | RuntimeError), repr(torch_error)
    with pytest.raises(DropInTypeError, match=rf"^{arg} must be boolean .* got dtype {dtype}"):
        call(ours, mask)
    with pytest.raises(AssertionError):  # caught the way torch's refusal is caught
        call(ours, mask)


@pytest.mark.parametrize("case", list(CASES))
def test_masks_on_another_device_non_tensors_and_wrong_shapes(pairs, case):
    _, call, shape, arg = CASES[case]
    ours = pairs[case][1]
    meta = torch.zeros(shape, dtype=torch.bool, device="meta")
    with pytest.raises(DropInArgumentError, match=rf"^{arg} must be on the inputs' device cpu"):
        call(ours, meta)
    with pytest.raises(DropInTypeError, match=rf"^{arg} must be a torch.Tensor or None, got list"):
        call(ours, [[True]])
    wrong = torch.zeros((*shape[:-1], shape[-1] + 1), dtype=torch.bool)
    with pytest.raises(DropInArgumentError, match=rf"^{arg} must have shape .* got "):
        call(ours, wrong)


def test_mismatched_batches_and_ranks_name_the_inputs():
    torch.manual_seed(0)
    tr = qn.Transformer(E, H, 1, 1, 16, dropout=0.0, batch_first=True).eval()
    with pytest.raises(DropInArgumentError, match="src and tgt must have the same batch size"):
        tr(SRC, TGT[:2])
    with pytest.raises(DropInArgumentError, match="src and tgt must both be batched"):
        tr(SRC, TGT[0])
    with pytest.raises(DropInTypeError, match=r"tgt must be a torch\.Tensor, got list"):
        tr(SRC, TGT.tolist())
    with pytest.raises(DropInArgumentError, match="src and tgt must be on one device"):
        tr(SRC, TGT.to("meta"))
    dec = qn.TransformerDecoderLayer(E, H, 16, dropout=0.0, batch_first=True).eval()
    with pytest.raises(DropInArgumentError, match="tgt and memory must have the same batch"):
        dec(TGT, SRC[:2])
    with pytest.raises(DropInArgumentError, match="tgt and memory must have the same batch"):
        dec(TGT, SRC[0])
    mha = qn.MultiheadAttention(E, H, batch_first=True)
    with pytest.raises(DropInArgumentError, match="query, key and value must be on one device"):
        mha(SRC, SRC.to("meta"), SRC.to("meta"))
    enc = qn.TransformerEncoder(qn.TransformerEncoderLayer(E, H, 16, batch_first=True), 1)
    with pytest.raises(DropInTypeError, match=r"src must be a torch\.Tensor, got str"):
        enc("src")


def test_stacks_of_custom_layers_still_check_mask_types():
    class Passthrough(torch.nn.Module):
        def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
            return src

    enc = qn.TransformerEncoder(Passthrough(), 2)
    with pytest.raises(DropInTypeError, match=r"^mask must be boolean .* got dtype torch\.int64"):
        enc(SRC, mask=torch.zeros(S, S, dtype=torch.long))
    assert torch.equal(enc(SRC, mask=torch.zeros(S, S)), SRC)
