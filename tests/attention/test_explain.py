"""qkv.explain: which backend auto picks, and why not the others."""

from __future__ import annotations

import pytest
import torch

import qkv
from helpers import backend_names


def inputs(T=8, S=8):
    return torch.randn(1, 2, T, 8), torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8)


def test_auto_picks_torch_without_weights():
    e = qkv.explain(*inputs())
    assert e.chosen == "torch"
    assert e.reasons["math"] == "torch is preferred (faster) for this call"
    assert str(e).splitlines()[0].startswith("auto -> torch")
    assert e.shapes == {"B": 1, "H": 2, "Hkv": 2, "T": 8, "S": 8, "D": 8, "Dv": 8}


def test_auto_picks_torch_lse_for_weights_on_cpu():
    """Weights never force the O(T·S) math path on the output: on CPU torch's flash kernel
    returns its lse and the weights are rebuilt from it; flash + rebuild where it cannot."""
    e = qkv.explain(*inputs(), need_weights=True)
    assert e.chosen == "torch"
    q, k, v = inputs()
    e = qkv.explain(q, k, v[..., :5], need_weights=True)
    assert e.chosen == "flash" and "Dv == D" in e.reasons["torch"]
    e = qkv.explain(q, k[:, :1], v[:, :1], attn_mask=torch.ones(8, 8, dtype=torch.bool),
                    need_weights=True, enable_gqa=True)
    assert e.chosen == "flash" and "grouped-query" in e.reasons["torch"]
    e = qkv.explain(q.to("meta"), k.to("meta"), v.to("meta"), need_weights=True)
    assert "torch: not chosen, the fused kernel does not return attention weights" in str(e)


def test_auto_picks_math_for_weights_after_dropout():
    e = qkv.explain(*inputs(), need_weights=True, dropout_p=0.1)
    assert e.chosen == "math" and "dropout" in e.reasons["flash"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alibi_slopes": torch.tensor([0.5, 0.25])},
        {"is_causal": True, "window": 4},
        {"is_causal": "bottom-right"},
    ],
)
def test_auto_streams_structured_masks_with_flash(kwargs):
    e = qkv.explain(*inputs(T=4), **kwargs)
    assert e.chosen == "flash"
    assert "dense (T, S) mask" in e.reasons["torch"]


def test_auto_keeps_a_float32_mask_off_torch_gpu_kernels():
    """Off the CPU, torch's kernels take a float mask only in the query's dtype: a float32
    mask with half-precision queries would lose bits (0.25 at a logit of 100), so auto
    passes such a call on; a mask already in q's dtype, or any mask on CPU, stays."""
    q, k, v = (t.half() for t in inputs())
    m32 = torch.randn(8, 8)  # (T, S)
    on = [t.to("meta") for t in (q, k, v, m32)]
    e = qkv.explain(*on)
    assert e.chosen != "torch" and "mask would be rounded to torch.float16" in e.reasons["torch"]
    assert "torch" not in qkv.explain(*on[:3], on[3].half()).reasons
    assert "rounded" not in qkv.explain(q, k, v, m32).reasons.get("torch", "")


def test_auto_picks_math_for_empty():
    assert qkv.explain(*inputs(S=0)).chosen == "math"


@pytest.mark.parametrize(
    "kwargs", [{}, {"need_weights": True}, {"is_causal": True}, {"is_causal": "bottom-right"}]
)
def test_explain_agrees_with_what_runs(kwargs, monkeypatch):
    """The backend explain names is the one scaled_dot_product_attention actually runs."""
    from qkv.attention import dispatch

    ran = []
    for name, module in dispatch.BACKENDS.items():
        original = module.run
        monkeypatch.setattr(module, "run", lambda call, _o=original, _n=name: ran.append(_n) or _o(call))
    q, k, v = inputs()
    qkv.scaled_dot_product_attention(q, k, v, **kwargs)
    assert ran == [qkv.explain(q, k, v, **kwargs).chosen]


def test_explain_named_backend():
    e = qkv.explain(*inputs(), backend="math")
    assert e.chosen == "math" and e.reasons["torch"] == "backend='math' was requested"
    with pytest.raises(ValueError, match="cannot honour"):
        qkv.explain(*inputs(), backend="torch", need_weights=True, dropout_p=0.1)


@pytest.mark.parametrize("units", [False, True], ids=["avx2", "avx512"])
def test_auto_half_precision_policy_follows_the_cpu(units, monkeypatch):
    """Without native half-precision units (AVX2) flash serves half-precision training and
    decoding; with them (AVX-512, AMX) torch's kernel serves every half-precision call."""
    from qkv.attention.backends import torch_kernel

    monkeypatch.setattr(torch_kernel, "half_precision_units", lambda: units)
    q, k, v = (t.bfloat16() for t in inputs(T=64, S=64))
    assert qkv.explain(q, k, v).chosen == "torch"
    assert qkv.explain(q.requires_grad_(), k, v).chosen == ("torch" if units else "flash")
    with torch.no_grad():
        assert qkv.explain(q, k, v).chosen == "torch"
    q1 = q.detach()[:, :, :1]
    e = qkv.explain(q1, k, v)
    if units:
        assert e.chosen == "torch"
    else:
        assert e.chosen == "flash" and "decoding" in e.reasons["torch"]


def test_half_precision_units_reads_the_cpu_capability():
    from qkv.attention.backends.torch_kernel import half_precision_units

    capability = torch.backends.cpu.get_cpu_capability()
    assert half_precision_units() == capability.startswith("AVX512"), capability


def test_one_query_after_a_cache_is_a_plain_call():
    """is_causal="bottom-right" with T = 1 hides nothing: no causal mask is built, so auto
    does not send one decoding step down the masked path."""
    from qkv.attention.call import make_call

    q, k = torch.randn(1, 8, 1, 16), torch.randn(1, 8, 300, 16)
    call = make_call(q, k, k, None, 0.0, "bottom-right", None, False, False)
    assert call.causal is None and call.plain
    with torch.no_grad():
        assert qkv.explain(q, k, k, is_causal="bottom-right").chosen == "torch"


def test_alibi_distances_survive_a_dropped_causal_mask():
    """Top-left causal with one key (S = 1) hides nothing, but ALiBi's distances still count
    from the causal diagonal: every backend equals the written-out bias."""
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (4, 1, 1))
    slopes = torch.tensor([0.5, 2.0])
    i = torch.arange(4, dtype=torch.float64)[:, None]  # (T, 1): distance |i - 0|
    bias = -slopes[:, None, None] * i.abs()[None]  # (H, T, 1)
    want = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5 + bias, -1) @ v
    for backend in backend_names(auto=False):
        got = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, alibi_slopes=slopes,
                                               backend=backend)
        assert (got - want).abs().max() < 1e-12, backend


@pytest.mark.parametrize("H,Hkv,S", [(9, 3, 4096), (16, 4, 16384), (8, 8, 16384)])
def test_auto_keeps_plain_decoding_on_torchs_kernel(H, Hkv, S):
    """Measured: torch's kernel (grouped heads folded into the query length) beats
    flash-decoding on plain calls at every S up to 16k; only masks send decoding to flash."""
    q, k = torch.randn(1, H, 1, 16), torch.randn(1, Hkv, S, 16)
    with torch.no_grad():
        assert qkv.explain(q, k, k, enable_gqa=True, is_causal="bottom-right").chosen == "torch"
