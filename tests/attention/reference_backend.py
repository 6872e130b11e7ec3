"""A fourth attention backend, for the tests only: attention by its definition, in float64.

``softmax(q·kᵀ·scale + mask) · v`` with every step in float64 and the key/value heads of a
group repeated (no folding, no tiles, no kernel), rounded to the query's dtype at the end. It
follows the contract of :mod:`qkv.attention.backends` through qkv's own shared definitions:
the mask parts (user mask, causal diagonal, window, ALiBi) by
:func:`qkv.attention.masks.apply_mask`, dead rows (zero weights, ``lse = -inf``, zero
gradient) by the math backend's ``softmax_rows`` and ``row_lse``, non-finite query rows by
:func:`~qkv.attention.masks.poison_rows`. It has no dropout, so ``why_not`` refuses it, and
no cost model, so ``qkv.explain`` says "no cost model" for it.

``QKV_TEST_EXTRA_BACKEND=1`` registers it for a whole test run (tests/attention/conftest.py),
so that every grid built on ``helpers.backend_names`` runs it with no test file edited;
test_backend_registry.py registers it for one test with :func:`registered`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from torch import Tensor

from qkv.attention import backends
from qkv.attention.backends.math import row_lse, softmax_rows
from qkv.attention.call import AttentionCall
from qkv.attention.masks import apply_mask, poison_rows

NAME = "reference"


def why_not(call: AttentionCall) -> str | None:
    """The reference backend honours every call without dropout."""
    if call.dropout_p > 0.0:
        return "the reference backend has no dropout"
    return None


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """Output ``(B, H, T, Dv)`` and, with ``need_weights``, weights ``(B, H, T, S)``."""
    out, weights, _ = run_lse(call)
    return out, weights


def run_lse(call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`run` plus the float64 log-sum-exp ``(B, H, T)`` (``-inf`` on dead rows)."""
    q = call.query
    k = call.key.double().repeat_interleave(call.groups, dim=1)  # (B, H, S, D)
    v = call.value.double().repeat_interleave(call.groups, dim=1)  # (B, H, S, Dv)
    scores = q.double() @ k.transpose(-2, -1) * call.scale  # (B, H, T, S)
    scores = apply_mask(scores, call)  # hidden keys -inf; float masks and ALiBi added
    lse = row_lse(scores)  # (B, H, T)
    weights = softmax_rows(scores)  # (B, H, T, S); dead rows 0
    out = poison_rows((weights @ v).to(q.dtype), q)  # (B, H, T, Dv)
    if not call.need_weights:
        return out, None, lse
    return out, poison_rows(weights.to(q.dtype), q), lse


@contextlib.contextmanager
def registered() -> Iterator[str]:
    """This backend in the registry for the ``with`` block (after ``math``: ``auto`` never
    picks it); left as found, so it nests inside a run that registered it already."""
    module = sys.modules[__name__]
    if backends.REGISTRY.get(NAME) is module:
        yield NAME
        return
    backends.register(module)
    try:
        yield NAME
    finally:
        backends.unregister(NAME)
