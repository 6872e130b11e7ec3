"""The drop-ins' errors are catchable as torch's (AssertionError / RuntimeError) and as
qkv's (ValueError / TypeError), with messages that name the argument."""

from __future__ import annotations

import pytest
import torch

import qkv.nn as qnn


def _cases():
    mha = qnn.MultiheadAttention(8, 2)
    x = torch.randn(3, 2, 8)
    return [
        ("embed_dim must be divisible by num_heads", lambda: qnn.MultiheadAttention(9, 2), ValueError),
        ("query must have last dimension embed_dim=8", lambda: mha(torch.randn(3, 2, 7), x, x), ValueError),
        ("key_padding_mask must have shape", lambda: mha(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError),
        ("attn_mask must have shape", lambda: mha(x, x, x, attn_mask=torch.zeros(4, 3)), ValueError),
        ("attn_mask must be boolean", lambda: mha(x, x, x, attn_mask=torch.zeros(3, 3, dtype=torch.long)), TypeError),
        ("query must be a torch.Tensor", lambda: mha("x", x, x), TypeError),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("torch_style", [AssertionError, RuntimeError])
def test_errors_are_catchable_as_torch_raises_them(case, torch_style):
    message, fn, python_style = _cases()[case]
    with pytest.raises(torch_style, match=message):
        fn()
    with pytest.raises(python_style, match=message):
        fn()


def test_a_torch_style_except_block_keeps_working():
    mha = qnn.MultiheadAttention(8, 2)
    try:
        mha(torch.randn(3, 2, 7), torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    except AssertionError as error:  # how code written against torch's module catches it
        assert "embed_dim=8" in str(error)
    else:
        raise AssertionError("no error raised")


def test_a_nested_tensor_input_is_refused_by_name():
    """Issue 31: torch's "NestedTensorImpl doesn't support sizes" came out instead."""
    import warnings

    from qkv.nn import MultiheadAttention
    from qkv.nn.errors import DropInTypeError

    m = MultiheadAttention(8, 2, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: nested tensors are a prototype
        x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    with pytest.raises(DropInTypeError, match=r"query is a nested tensor; .* pad the sequences"):
        m(x, x, x)
