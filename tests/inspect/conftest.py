"""Fixtures of the inspect tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def spy_backends(monkeypatch):
    """Record (backend auto picks, need_weights) of every kernel call an attention module's
    core makes."""
    import qkv.nn.core as core
    from qkv.attention import dispatch

    seen: list[tuple[str, bool]] = []

    def spy(call, backend="auto"):
        seen.append((dispatch.decide(call, with_costs=False).chosen, call.need_weights))
        return dispatch.select(call, backend).run(call)

    monkeypatch.setattr(core, "run_call", spy)
    return seen
