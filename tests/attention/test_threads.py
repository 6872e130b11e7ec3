"""The thread policy: inference and decoding steps run on the cores other processes leave free.

A result must never depend on the machine's load. The policy fits only inference (never a call
recording a graph, never a backward), and only where this CPU's kernels were seen to give the
same bits on both counts (:func:`threads.bits_hold`, which fails on CPUs whose BLAS splits a
reduction over threads): every backend and programmable attention give the same bits on a busy
machine as on a quiet one, whichever CPU runs the suite. The load reading is checked against a
real busy process.
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
    # The mechanics, whatever this CPU's kernels do (on an Intel Xeon under
    # ATEN_CPU_CAPABILITY=avx2 torch's flash kernel and a 48-row linear give other bits on one
    # thread than on two, so the policy keeps the count there: the decoding test checks both).
    monkeypatch.setattr(threads, "bits_hold", lambda n, requested: True)
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


@pytest.mark.parametrize("holds", [True, False])
def test_a_decoding_step_runs_on_the_free_cores(two_threads, monkeypatch, holds):
    from qkv.generate.session import make_session
    from qkv.models import DecoderLM, DecoderLMConfig

    monkeypatch.setattr(threads, "others_busy", lambda: 1.0)
    monkeypatch.setattr(threads, "_cores", lambda: 2)
    monkeypatch.setattr(threads, "bits_hold", lambda n, requested: holds)
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt2_style(vocab_size=50, d_model=32, num_layers=1,
                                                 num_heads=2, max_len=64)).eval()
    seen = []
    model.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    session = make_session(model, [[1, 2, 3]], 4, pad_id=None, bos_id=None)
    with torch.no_grad():
        session.next(session.first().argmax(-1))
    want = 1 if holds else 2  # where the bits would move, torch's setting is kept
    assert seen == [want, want] and torch.get_num_threads() == 2, seen


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


def _inputs(name):
    g = torch.Generator().manual_seed(3)
    T = 77 if name.startswith("triton") else 333  # interpreted: still 5 tiles of 16 a side
    return [torch.randn(2, h, T, 40, generator=g) for h in (4, 2, 2)]


def _busy(monkeypatch, others: float) -> None:
    monkeypatch.setattr(threads, "others_busy", lambda: others)
    monkeypatch.setattr(threads, "_cores", lambda: 2)


@pytest.mark.parametrize("name", list(_calls()))
def test_inference_gives_the_same_bits_on_a_busy_machine(name, two_threads, monkeypatch):
    fn, inputs = _calls()[name], _inputs(name)
    _busy(monkeypatch, 0.0)
    quiet = fn(*inputs)
    _busy(monkeypatch, 1.0)
    with threads.fitted_threads(*inputs) as n:
        pass
    assert n == (1 if threads.bits_hold(1, 2) else 2), n
    busy = fn(*inputs)  # on one thread where this CPU's kernels hold their bits
    assert torch.equal(quiet, busy), f"{name} on {n} thread(s): max diff " \
        f"{float((quiet - busy).abs().max()):.3e}"


def _train(fn, inputs):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("name", list(_calls()))
def test_training_keeps_torch_threads(name, two_threads, monkeypatch):
    """A forward that records a graph, and its backward, run on torch's setting whatever the
    load: the policy is never asked."""
    fn, inputs = _calls()[name], _inputs(name)
    quiet = _train(fn, inputs)
    _busy(monkeypatch, 1.0)
    asked = []
    monkeypatch.setattr(threads, "threads_for", lambda *a: asked.append(a) or 1)
    busy = _train(fn, inputs)
    assert not asked, f"{name}: the thread policy was asked during training: {asked[:3]}"
    for what, a, b in zip(("out", "dq", "dk", "dv"), quiet, busy, strict=True):
        assert torch.equal(a, b), f"{name} {what}: max diff {float((a - b).abs().max()):.3e}"


def test_kernels_whose_bits_follow_the_thread_count_keep_torch_s_setting(two_threads,
                                                                         monkeypatch):
    def by_threads(x):
        return x * torch.get_num_threads()  # other bits on other counts, as a K-split BLAS

    monkeypatch.setattr(threads._State, "bits", {})
    monkeypatch.setattr(threads, "_probe_inputs", lambda: [(by_threads, lambda: (torch.ones(3),))])
    _busy(monkeypatch, 1.0)
    assert threads.bits_hold(1, 2) is False
    with threads.fitted_threads(torch.ones(1)) as n:
        assert n == 2 and torch.get_num_threads() == 2
    monkeypatch.setattr(threads._State, "bits", {})
    monkeypatch.setattr(threads, "_probe_inputs", lambda: [(torch.exp, lambda: (torch.ones(3),))])
    assert threads.bits_hold(1, 2) is True
    with threads.fitted_threads(torch.ones(1)) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
