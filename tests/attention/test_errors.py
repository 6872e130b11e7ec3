"""Every bad input gets a clear error naming the argument, what came and what was expected."""

from __future__ import annotations

import re

import pytest
import torch

import qkv
from qkv.attention import backends


def qkv_(T=4, S=6, H=2, Hkv=2, D=8, Dv=8, B=2, dtype=torch.float32):
    return (
        torch.randn(B, H, T, D, dtype=dtype),
        torch.randn(B, Hkv, S, D, dtype=dtype),
        torch.randn(B, Hkv, S, Dv, dtype=dtype),
    )


def sdpa(*args, **kwargs):
    return qkv.scaled_dot_product_attention(*args, **kwargs)


def test_not_a_tensor():
    _, k, v = qkv_()
    with pytest.raises(TypeError, match=r"query must be a torch.Tensor, got list"):
        sdpa([[1.0]], k, v)


def test_integer_tensors():
    q, k, v = qkv_()
    with pytest.raises(TypeError, match=r"key must be a floating-point tensor .* got dtype torch.int64"):
        sdpa(q, k.long(), v)


def test_rank_too_small():
    _, k, v = qkv_()
    with pytest.raises(ValueError, match=r"query must have at least 2 dimensions .* got shape \(8,\)"):
        sdpa(torch.randn(8), k, v)


def test_ranks_that_do_not_broadcast():
    """Different ranks broadcast as in torch (tests/attention/test_broadcast.py); these do not."""
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"same leading \(batch\) dimensions or broadcast together, got query \(2, 2, 4, 8\), key \(3, 2, 6, 8\)"):
        sdpa(q, k.repeat(2, 1, 1, 1)[:3], v.repeat(2, 1, 1, 1)[:3])


def test_head_width_mismatch():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"same head width D .* query \(2, 2, 4, 8\) with D=8 and key \(2, 2, 6, 7\) with D=7"):
        sdpa(q, k[..., :7], v)


def test_key_value_length_mismatch():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"same length S .* key \(2, 2, 6, 8\) with S=6 and value \(2, 2, 5, 8\) with S=5"):
        sdpa(q, k, v[..., :5, :])


def test_heads_not_a_multiple():
    q, k, v = qkv_(H=5, Hkv=2)
    with pytest.raises(ValueError, match=r"H \(query heads, 5\) to be a multiple of Hkv \(key/value heads, 2\)"):
        sdpa(q, k, v, enable_gqa=True)


def test_gqa_not_enabled():
    q, k, v = qkv_(H=4, Hkv=2)
    with pytest.raises(ValueError, match=r"query has H=4 heads but key/value have Hkv=2 .* enable_gqa=True"):
        sdpa(q, k, v)


def test_key_value_heads_differ():
    q, k, _ = qkv_(H=6, Hkv=2)
    with pytest.raises(ValueError, match=r"key and value must have the same number of heads"):
        sdpa(q, k, torch.randn(2, 3, 6, 8))


def test_batch_dims_differ():
    q, _, _ = qkv_()
    with pytest.raises(ValueError, match=r"same leading \(batch\) dimensions or broadcast"):
        sdpa(q, torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8))


def test_mask_does_not_broadcast():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 5\) does not broadcast to the attention scores \(\.\.\., H, T, S\) = \(2, 2, 4, 6\)"):
        sdpa(q, k, v, attn_mask=torch.ones(4, 5, dtype=torch.bool))


def test_mask_would_enlarge_scores():
    q, k, v = qkv_(B=1)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 1, 4, 6\) would enlarge"):
        sdpa(q, k, v, attn_mask=torch.ones(3, 1, 4, 6, dtype=torch.bool))


def test_mask_too_many_dims():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"attn_mask has shape \(1, 1, 2, 2, 4, 6\) with 6 dimensions"):
        sdpa(q, k, v, attn_mask=torch.ones(1, 1, 2, 2, 4, 6, dtype=torch.bool))


def test_integer_mask():
    q, k, v = qkv_()
    with pytest.raises(TypeError, match=r"attn_mask must be boolean .* got dtype torch.int64"):
        sdpa(q, k, v, attn_mask=torch.ones(4, 6, dtype=torch.long))


def test_nan_mask():
    q, k, v = qkv_()
    m = torch.zeros(4, 6)
    m[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"attn_mask contains NaN"):
        sdpa(q, k, v, attn_mask=m)


def test_posinf_mask():
    q, k, v = qkv_()
    m = torch.zeros(4, 6)
    m[1, 2] = float("inf")
    with pytest.raises(ValueError, match=r"attn_mask contains \+inf"):
        sdpa(q, k, v, attn_mask=m)


def test_mixed_dtypes():
    q, k, v = qkv_()
    with pytest.raises(TypeError, match=r"share one dtype, got query torch.float32, key torch.float64"):
        sdpa(q, k.double(), v)


def test_mixed_devices():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"one device, got query on cpu, key on meta"):
        sdpa(q, k.to("meta"), v)


def test_unknown_backend():
    q, k, v = qkv_()
    known = ", ".join(repr(name) for name in ("auto", *backends.REGISTRY))  # all registered
    with pytest.raises(ValueError, match=re.escape(f"backend must be one of {known}, got 'cuda'")):
        sdpa(q, k, v, backend="cuda")


def test_backend_that_cannot_return_weights():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"backend='torch' cannot honour this call: weights after dropout cannot be rebuilt"):
        sdpa(q, k, v, backend="torch", need_weights=True, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"backend='torch' cannot honour this call: the fused kernel does not return attention weights"):
        sdpa(q.to("meta"), k.to("meta"), v.to("meta"), backend="torch", need_weights=True)


def test_torch_backend_refuses_empty():
    q, k, v = qkv_(S=0)
    with pytest.raises(ValueError, match=r"backend='torch' cannot honour this call: empty sequence"):
        sdpa(q, k, v, backend="torch")


@pytest.mark.parametrize("p", [-0.1, 1.0, "0.1"])
def test_bad_dropout(p):
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        sdpa(q, k, v, dropout_p=p)


def test_bad_scale():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"scale must be a finite number or None, got inf"):
        sdpa(q, k, v, scale=float("inf"))


def test_bad_is_causal():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"is_causal must be a bool, 'top-left' or 'bottom-right', got 'top'"):
        sdpa(q, k, v, is_causal="top")


@pytest.mark.parametrize("w", [0, -2, 1.5, True])
def test_bad_window(w):
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"window must be a positive int or None"):
        sdpa(q, k, v, is_causal=True, window=w)


def test_window_needs_causal():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"window \(a sliding causal window\) needs is_causal"):
        sdpa(q, k, v, window=3)


def test_bad_alibi_slopes():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(H,\) = \(2,\), got \(3,\)"):
        sdpa(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match=r"alibi_slopes must be a float tensor"):
        sdpa(q, k, v, alibi_slopes=[0.5, 0.25])


def test_flash_refuses_weights_with_dropout():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"backend='flash' cannot honour this call: weights after dropout"):
        sdpa(q, k, v, dropout_p=0.1, need_weights=True, backend="flash")


def test_explain_validates_too():
    q, k, v = qkv_()
    with pytest.raises(ValueError, match=r"same head width D"):
        qkv.explain(q, k[..., :3], v)


# Every argument error of SDPA, with the exception class it is documented to raise.
BAD_CALLS = [
    ("head width", lambda q, k, v: sdpa(q, k[..., :7], v), ValueError, r"same head width D"),
    ("lengths", lambda q, k, v: sdpa(q, k, v[..., :5, :]), ValueError, r"same length S"),
    ("rank", lambda q, k, v: sdpa(torch.randn(8), k, v), ValueError, r"at least 2 dimensions"),
    ("gqa", lambda q, k, v: sdpa(torch.randn(2, 4, 4, 8), k, v), ValueError, r"enable_gqa=True"),
    ("mask shape", lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(4, 5, dtype=torch.bool)),
     ValueError, r"does not broadcast"),
    ("mask NaN", lambda q, k, v: sdpa(q, k, v, attn_mask=torch.full((4, 6), float("nan"))),
     ValueError, r"attn_mask contains NaN"),
    ("dropout", lambda q, k, v: sdpa(q, k, v, dropout_p=1.5), ValueError, r"dropout_p must be"),
    ("backend", lambda q, k, v: sdpa(q, k, v, backend="cuda"), ValueError, r"backend must be"),
    ("weights", lambda q, k, v: sdpa(q, k, v, backend="torch", need_weights=True, dropout_p=0.1),
     ValueError, r"cannot honour"),
    ("dtype", lambda q, k, v: sdpa(q, k.double(), v), TypeError, r"share one dtype"),
    ("int", lambda q, k, v: sdpa(q.long(), k, v), TypeError, r"floating-point tensor"),
    ("mask dtype", lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(4, 6, dtype=torch.long)),
     TypeError, r"attn_mask must be boolean"),
    ("not a tensor", lambda q, k, v: sdpa([[1.0]], k, v), TypeError, r"must be a torch.Tensor"),
]


@pytest.mark.parametrize(("what", "bad", "kind", "message"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_errors_are_caught_as_torch_and_as_python_errors(what, bad, kind, message):
    """``except RuntimeError`` (code written for torch's SDPA) and ``except ValueError`` /
    ``except TypeError`` (Python convention) both catch, with qkv's message."""
    q, k, v = qkv_()
    for catch in (kind, RuntimeError):
        with pytest.raises(catch, match=message):
            bad(q, k, v)
    try:
        bad(q, k, v)
    except RuntimeError as e:  # the pattern code written for torch uses
        assert isinstance(e, kind), f"{what}: {type(e).__name__} is not a {kind.__name__}"
        expected = qkv.attention.AttentionArgumentError if kind is ValueError else qkv.attention.AttentionTypeError
        assert isinstance(e, expected), f"{what}: {type(e).__name__}"


def test_error_classes():
    from qkv.attention.errors import AttentionArgumentError, AttentionTypeError

    assert issubclass(AttentionArgumentError, ValueError) and issubclass(AttentionArgumentError, RuntimeError)
    assert issubclass(AttentionTypeError, TypeError) and issubclass(AttentionTypeError, RuntimeError)
    assert qkv.attention.AttentionArgumentError is AttentionArgumentError


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_a_dropout_mask_too_large_to_draw_is_refused_before_it_is_drawn(backend, monkeypatch):
    """The fused backends draw torch's (B, H, T, S) keep mask (one seed, the same drops on
    every backend): at T = S = 8192, H = 4 that is 2.25 GiB while drawn, refused here on a
    machine said to have 4 GiB (half of it the limit), before the mask is drawn."""
    from qkv.attention import dropout

    monkeypatch.setattr(dropout, "_memory_bytes", lambda: 4 << 30)
    q, k, v = (torch.randn(1, 4, 8192, 8) for _ in range(3))
    with pytest.raises(qkv.attention.AttentionArgumentError,
                       match=r"dropout_p=0.1 draws torch's keep mask of \(B, H, T, S\) = "
                             r"\(1, 4, 8192, 8192\), 2.2 GiB .* more than the 2.0 GiB half "
                             r"this machine's memory: use dropout_p=0"):
        qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.1, backend=backend)
    monkeypatch.setattr(dropout, "_memory_bytes", lambda: 64 << 30)  # fits: the same mask drawn
    small = [t[:, :, :64] for t in (q, k, v)]
    out = qkv.scaled_dot_product_attention(*small, dropout_p=0.1, backend=backend)
    assert out.shape == (1, 4, 64, 8)
