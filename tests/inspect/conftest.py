"""Fixtures of the inspect tests."""

from __future__ import annotations

import pytest

import qkv


@pytest.fixture
def spy_backends(monkeypatch):
    """Record (backend auto picks, need_weights) of every SDPA call an Attention makes."""
    import qkv.nn.attention as module

    seen: list[tuple[str, bool]] = []

    def spy(*args, **kwargs):
        seen.append((qkv.explain(*args, **kwargs).chosen, kwargs.get("need_weights", False)))
        return qkv.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(module, "scaled_dot_product_attention", spy)
    return seen
