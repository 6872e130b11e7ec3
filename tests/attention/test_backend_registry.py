"""The backend registry (qkv.attention.backends): what it holds, what it checks, and a fourth
backend (the test reference, reference_backend.py) plugged in and out at run time."""

from __future__ import annotations

import os
import types

import pytest
import reference_backend
import torch

import qkv
from helpers import assert_close, backend_names, max_error
from qkv.attention import backends, dispatch
from qkv.attention.call import make_call
from qkv.attention.costs import predict


def _inputs(dtype=torch.float64, T=6, S=9):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 8, generator=g, dtype=dtype)
    k = torch.randn(2, 2, S, 8, generator=g, dtype=dtype)
    v = torch.randn(2, 2, S, 5, generator=g, dtype=dtype)
    return q, k, v


def _clone(name: str, **drop) -> types.ModuleType:
    """A backend module called ``name`` that runs the reference's functions, minus ``drop``."""
    module = types.ModuleType(f"test_backend_{name}")
    parts = {a: getattr(reference_backend, a) for a in ("why_not", "run", "run_lse")}
    for attr, value in {"NAME": name, **parts}.items():
        if attr not in drop:
            setattr(module, attr, value)
    return module


def _predicts_nothing(q, k, v, name) -> bool:
    """Whether costs.predict has no model of ``name`` (and one of math) for this call."""
    call = make_call(q, k, v, None, 0.0, False, None, True, False)
    return predict(call, name) is None and predict(call, "math") is not None


def _registered_for_the_run() -> bool:
    """Whether conftest.py registered the reference for the whole run: then it stays."""
    return os.environ.get("QKV_TEST_EXTRA_BACKEND") == "1"


def test_builtins_are_registered_fastest_first():
    assert list(backends.PREFERENCE)[:4] == ["torch", "triton", "flash", "math"]
    assert dispatch.BACKENDS is backends.REGISTRY and dispatch.PREFERENCE is backends.PREFERENCE
    assert list(backends.REGISTRY) == list(backends.PREFERENCE), "one order for both views"
    assert backend_names()[:4] == ["auto", "torch", "flash", "math"]
    with pytest.raises(TypeError):
        backends.REGISTRY["x"] = backends.math  # read-only: register() keeps both views


def test_reference_backend_runs_by_name_and_explain_has_no_cost_model():
    q, k, v = _inputs()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    kw = dict(is_causal="bottom-right", window=4, alibi_slopes=slopes, enable_gqa=True)
    with reference_backend.registered() as name:
        assert name in backend_names() and name in dispatch.PREFERENCE
        e = qkv.explain(q, k, v, **kw)
        assert e.chosen != name, "registered after math: auto never reaches it"
        assert name not in e.costs and _predicts_nothing(q, k, v, name)
        line = next(ln for ln in str(e).splitlines() if ln.strip().startswith(f"{name}:"))
        assert "no cost model" in line, str(e)
        named = qkv.explain(q, k, v, backend=name, **kw)
        assert named.chosen == name and "no cost model" in str(named), str(named)
        out, w = qkv.scaled_dot_product_attention(q, k, v, backend=name, need_weights=True, **kw)
        want, want_w = qkv.scaled_dot_product_attention(
            q, k, v, backend="math", need_weights=True, **kw
        )
        err = max_error(out, want)
        assert err < 1e-12, f"reference vs math backend: max abs error {err:.3e}"
        assert_close(w, want_w, atol=1e-12, name="reference weights vs math")
        with pytest.raises(ValueError, match=r"cannot honour this call: .*no dropout"):
            qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.1, backend=name, **kw)
    if not _registered_for_the_run():
        assert name not in backends.REGISTRY and name not in backend_names()


def test_a_backend_preferred_first_is_what_auto_runs():
    q, k, v = _inputs()
    backends.register(_clone("first"), preference=0)
    try:
        assert dispatch.PREFERENCE[0] == "first"
        assert qkv.explain(q, k, v, enable_gqa=True).chosen == "first"
        e = qkv.explain(q, k, v, enable_gqa=True, dropout_p=0.2)  # "first" refuses dropout
        assert e.chosen != "first" and "no dropout" in e.reasons["first"], str(e)
    finally:
        backends.unregister("first")
    assert "first" not in dispatch.PREFERENCE and "first" not in dispatch.BACKENDS


@pytest.mark.parametrize("missing", ["NAME", "why_not", "run", "run_lse"])
def test_register_names_what_a_backend_lacks(missing):
    with pytest.raises(TypeError, match=rf"lacks {missing} \("):
        backends.register(_clone("broken", **{missing: True}))
    assert "broken" not in backends.REGISTRY


def test_register_refuses_bad_names_and_positions():
    with pytest.raises(ValueError, match="already registered"):
        backends.register(_clone("flash"))
    with pytest.raises(ValueError, match="other than 'auto'"):
        backends.register(_clone("auto"))
    with pytest.raises(ValueError, match="preference must be"):
        backends.register(_clone("late"), preference=99)
    module = _clone("odd")
    module.prefer_not = "not a function"
    with pytest.raises(TypeError, match="prefer_not must be callable"):
        backends.register(module)
    assert set(backends.REGISTRY) >= {"torch", "flash", "math"}
    assert not {"late", "odd", "auto"} & set(backends.REGISTRY)


def test_unregister_keeps_the_math_fallback():
    with pytest.raises(ValueError, match="fallback"):
        backends.unregister("math")
    with pytest.raises(KeyError, match="no backend named 'nope'"):
        backends.unregister("nope")
