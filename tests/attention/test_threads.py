"""The thread policy: attention and decoding steps run on the cores other processes leave free.

The policy is safe only because the thread count changes the time, never the bits: every
backend's forward and backward, and programmable attention, give bit-identical results on one
thread and on two. The load reading is checked against a real busy process.
"""

from __future__ import annotations

import time

import pytest
import torch

import qkv
from qkv.attention import threads
from qkv.attention.dispatch import BACKENDS
from qkv.bench.measure import busy_core


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("requested", "cores", "others", "want"), [
    (2, 2, 0.0, 2), (2, 2, 0.4, 2), (2, 2, 0.7, 1), (2, 2, 1.9, 1), (2, 2, None, 2),
    (1, 2, 0.0, 1), (8, 8, 3.2, 5), (4, 8, 3.0, 4), (8, 8, 9.0, 1),
])
def test_threads_for(requested, cores, others, want):
    assert threads.threads_for(requested, cores, others) == want


STAT = """cpu  900 0 100 1000 0 0 0 0 0 0
cpu0 100 0 0 900 50 0 0 0 0 0
cpu1 300 0 100 100 0 0 0 10 0 0
cpu2 500 0 0 0 0 0 0 0 0 0
intr 12345
"""


def test_busy_seconds_counts_only_this_process_s_cpus():
    ticks = threads._CLOCK_TICKS
    assert threads.busy_seconds(STAT, {0, 1}) == pytest.approx((100 + 410) / ticks)
    assert threads.busy_seconds(STAT, None) == pytest.approx((100 + 410 + 500) / ticks)
    assert threads.busy_seconds(STAT, {7}) is None
    assert threads.busy_seconds("intr 1\n", None) is None


def test_a_busy_process_is_seen():
    threads.others_busy(time.monotonic() - 2 * threads.SAMPLE_S)  # a fresh reading
    with busy_core(seconds=30):
        time.sleep(0.2)
        threads.others_busy(time.monotonic() + threads.SAMPLE_S)  # start the interval
        time.sleep(0.6)
        others = threads.others_busy(time.monotonic() + 2 * threads.SAMPLE_S)
    if others is None:
        pytest.skip("no /proc/stat on this system: the policy keeps torch's setting")
    assert others >= 0.5, f"a busy loop beside us read as {others:.2f} busy cores"


def test_fitted_threads_uses_the_free_cores_and_restores(two_threads, monkeypatch):
    monkeypatch.setattr(threads, "others_busy", lambda: 1.0)
    monkeypatch.setattr(threads, "_cores", lambda: 2)
    with threads.fitted_threads() as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(KeyError), threads.fitted_threads():
        raise KeyError("restored on error too")
    assert torch.get_num_threads() == 2
    threads.set_policy("fixed")
    try:
        with threads.fitted_threads():
            assert torch.get_num_threads() == 2
    finally:
        threads.set_policy("adaptive")
    with pytest.raises(ValueError, match="thread policy must be one of"):
        threads.set_policy("auto")


def test_a_bad_policy_in_the_environment_warns_and_keeps_the_default():
    import os
    import subprocess
    import sys

    code = "from qkv.attention import threads; print(threads.policy())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "QKV_THREADS": "fast"}, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "adaptive", proc.stderr
    assert "QKV_THREADS='fast' is not one of ('adaptive', 'fixed')" in proc.stderr, proc.stderr


def test_a_decoding_step_runs_on_the_free_cores(two_threads, monkeypatch):
    from qkv.generate.session import make_session
    from qkv.models import DecoderLM, DecoderLMConfig

    monkeypatch.setattr(threads, "others_busy", lambda: 1.0)
    monkeypatch.setattr(threads, "_cores", lambda: 2)
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt2_style(vocab_size=50, d_model=32, num_layers=1,
                                                 num_heads=2, max_len=64)).eval()
    seen = []
    model.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    session = make_session(model, [[1, 2, 3]], 4, pad_id=None, bos_id=None)
    with torch.no_grad():
        session.next(session.first().argmax(-1))
    assert seen == [1, 1] and torch.get_num_threads() == 2, seen


def _run(fn, inputs, threads_n):
    torch.set_num_threads(threads_n)
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    return [out.detach()] + [t.grad for t in leaves]


def _calls():
    window = qkv.create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < 100), None, None,
                                   333, 333)
    calls = {f"{name}-causal": (lambda q, k, v, name=name: qkv.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True, backend=name)) for name in BACKENDS}
    calls["flex-window"] = lambda q, k, v: qkv.flex_attention(q, k, v, None, window,
                                                              enable_gqa=True)
    calls["flex-softcap"] = lambda q, k, v: qkv.flex_attention(
        q, k, v, lambda s, b, h, i, j: 20 * torch.tanh(s / 20), window, enable_gqa=True)
    return calls


@pytest.mark.parametrize("name", list(_calls()))
def test_one_thread_and_two_give_the_same_bits(name, two_threads):
    g = torch.Generator().manual_seed(3)
    T = 77 if name.startswith("triton") else 333  # interpreted: still 5 tiles of 16 a side
    inputs = [torch.randn(2, h, T, 40, generator=g) for h in (4, 2, 2)]
    fn = _calls()[name]
    one, two = _run(fn, inputs, 1), _run(fn, inputs, 2)
    for what, a, b in zip(("out", "dq", "dk", "dv"), one, two, strict=True):
        assert torch.equal(a, b), f"{name} {what}: max diff {float((a - b).abs().max()):.3e}"
