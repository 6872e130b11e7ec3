"""The paged KV cache and continuous batching (issue 29). References: the model without a cache
(the paged attention over pages), ``qkv.generate.greedy`` / ``sample`` on each request alone
(the engine, with requests arriving while others run)."""

from __future__ import annotations

import re
import time

import pytest
import torch

from qkv.attention import triton as triton_env
from qkv.generate import greedy, sample, strip
from qkv.generate.batching import BatchingEngine
from qkv.generate.engine import SamplingParams
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn import paged_cache
from qkv.nn.paged_cache import PagedKVCache

TIMEOUT = 60  # seconds any test waits for a token


def _model(kind: str = "llama") -> DecoderLM:
    torch.manual_seed(0)
    if kind == "llama":
        config = DecoderLMConfig.llama_style(vocab_size=211, d_model=64, num_layers=2,
                                             num_heads=4, num_kv_heads=2)  # fmt: skip
    else:
        config = DecoderLMConfig(vocab_size=211, d_model=64, num_layers=2, num_heads=4,
                                 positions=kind, max_len=256)  # fmt: skip
    return DecoderLM(config).eval()


def _cache(model, blocks=64, size=4, kernel="auto") -> PagedKVCache:
    c = model.config
    return PagedKVCache(c.num_layers, num_blocks=blocks, block_size=size,
                        kv_heads=c.num_kv_heads or c.num_heads, head_dim=c.head_dim,
                        kernel=kernel)  # fmt: skip


@pytest.mark.parametrize("kind", ["llama", "learned"])
@pytest.mark.parametrize("size,chunk,kernel", [
    (1, 32, "chunks"), (3, 2, "chunks"), (16, 32, "chunks"), (4, 1, "chunks"),
    (3, 0, "triton"), (16, 0, "triton"),  # the Triton kernel (interpreted without a GPU)
])
@torch.no_grad()
def test_paged_prefill_and_steps_equal_no_cache(kind, size, chunk, kernel, monkeypatch):
    """Three sequences of 7, 20 and 2 prompt tokens in pages of ``size``, attended ``chunk``
    blocks at a time (or by the Triton kernel reading pages in place), then five steps
    together: each row's logits equal the model's on the row's whole sequence."""
    if kernel == "triton" and not triton_env.installed():
        pytest.skip("triton is not installed")
    monkeypatch.setattr(paged_cache, "CHUNK_BLOCKS", chunk)
    model = _model(kind)
    cache = _cache(model, size=size, kernel=kernel)
    seqs = [torch.randint(0, 211, (n,)).tolist() for n in (7, 20, 2)]
    tables = [cache.allocate(cache.blocks_for(len(s) + 5)) for s in seqs]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for b, s in enumerate(seqs):  # prefill one at a time
        cache.set_batch([tables[b]], [0])
        got[b].append(model(torch.tensor([s]), cache=cache, positions=torch.arange(len(s))[None])[0])
    for _ in range(5):  # then steps together
        new = [torch.randint(0, 211, (1,)).item() for _s in seqs]
        cache.set_batch(tables, [len(s) for s in seqs])
        out = model(torch.tensor([[t] for t in new]), cache=cache,
                    positions=torch.tensor([[len(s)] for s in seqs]))  # fmt: skip
        for b, s in enumerate(seqs):
            s.append(new[b])
            got[b].append(out[b])
    for b, s in enumerate(seqs):
        err = float((torch.cat(got[b]) - model(torch.tensor([s]))[0]).abs().max())
        assert err <= 1e-5, f"row {b}: max error {err:.3g}"


def _alone(model, prompt, n, eos=2):
    return strip(greedy(model, [prompt], max_new_tokens=n, eos_id=eos), eos)[0]


@pytest.mark.parametrize("kind", ["llama", "learned"])
def test_requests_arriving_while_others_run_get_their_greedy_tokens(kind):
    model = _model(kind)
    torch.manual_seed(1)
    prompts = [torch.randint(3, 211, (n,)).tolist() for n in (5, 17, 1, 40, 9, 33, 2, 12)]
    lengths = [30, 12, 25, 8, 40, 16, 3, 21]
    engine = BatchingEngine(model, eos_id=2, max_batch=3, block_size=8, num_blocks=30).start()
    try:
        requests = []
        for p, n in zip(prompts, lengths, strict=True):
            requests.append(engine.submit(p, SamplingParams(max_new_tokens=n)))
            time.sleep(0.005)
        outputs = [list(r.tokens(timeout=TIMEOUT)) for r in requests]
    finally:
        engine.shutdown(timeout=TIMEOUT)
    for i, (p, n, out) in enumerate(zip(prompts, lengths, outputs, strict=True)):
        assert out == _alone(model, p, n), f"request {i}"
    assert engine.blocks.held == 0 and not engine.running
    assert {r.finish_reason for r in requests} <= {"stop", "length"}


def test_a_request_that_does_not_fit_waits_for_blocks():
    """A pool for two requests: the third waits until one ends, then gets its tokens."""
    model = _model()
    engine = BatchingEngine(model, eos_id=None, max_batch=8, block_size=4, num_blocks=8).start()
    try:
        reqs = [engine.submit([5 + i, 6, 7, 8], SamplingParams(max_new_tokens=12))
                for i in range(3)]  # each needs 4 blocks  # fmt: skip
        outs = [list(r.tokens(timeout=TIMEOUT)) for r in reqs]
    finally:
        engine.shutdown(timeout=TIMEOUT)
    assert outs == [_alone(model, [5 + i, 6, 7, 8], 12, eos=None) for i in range(3)]
    assert engine.blocks.held == 0


def test_sampled_requests_draw_as_alone_and_cancel_frees_blocks():
    model = _model()
    engine = BatchingEngine(model, max_batch=4, block_size=4, num_blocks=64).start()
    try:
        prompt = [9, 8, 7]
        drawn = engine.submit(prompt, SamplingParams(max_new_tokens=10, temperature=0.9,
                                                     top_p=0.9, seed=5))  # fmt: skip
        slow = engine.submit([4, 4], SamplingParams(max_new_tokens=200))
        first = next(slow.tokens(timeout=TIMEOUT))
        slow.cancel()
        rest = list(slow.tokens(timeout=TIMEOUT))
        got = list(drawn.tokens(timeout=TIMEOUT))
    finally:
        engine.shutdown(timeout=TIMEOUT)
    want = sample(model, [prompt], max_new_tokens=10, temperature=0.9, top_p=0.9, seed=5)
    assert got == strip(want, model.config.eos_id)[0]
    assert slow.finish_reason == "cancelled" and len([first, *rest]) < 200
    assert engine.blocks.held == 0


def test_bad_requests_and_models_are_refused():
    model = _model("learned")
    engine = BatchingEngine(model, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="prompt must be a non-empty list"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="prompt must be a non-empty list"):
        engine.submit([5, 999], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        engine.submit([1] * 250, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="whole block pool"):
        engine.submit([1] * 10, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="paged cache does not express"):
        BatchingEngine(_model("alibi"))
    engine.start().shutdown(timeout=TIMEOUT)
    with pytest.raises(ValueError, match="shutting down"):
        engine.submit([1, 2], SamplingParams(max_new_tokens=4))


def test_a_request_whose_prefill_fails_ends_with_its_error_and_frees_its_blocks(monkeypatch):
    model = _model()
    engine = BatchingEngine(model, max_batch=4, block_size=4, num_blocks=32)
    real = engine._prefill

    def failing(run, budget):
        if run.request.prompt == [13, 13]:
            raise RuntimeError("boom")
        return real(run, budget)

    monkeypatch.setattr(engine, "_prefill", failing)
    engine.start()
    try:
        bad = engine.submit([13, 13], SamplingParams(max_new_tokens=5))
        good = engine.submit([7, 8, 9], SamplingParams(max_new_tokens=5))
        with pytest.raises(RuntimeError, match="boom"):
            list(bad.tokens(timeout=TIMEOUT))
        assert list(good.tokens(timeout=TIMEOUT)) == _alone(model, [7, 8, 9], 5, eos=None)
    finally:
        engine.shutdown(timeout=TIMEOUT)
    assert bad.finish_reason == "error" and engine.blocks.held == 0


@pytest.mark.parametrize("kernel", ["chunks", "triton"])
def test_tables_that_do_not_hold_the_batch_are_refused_before_attention_reads_them(kernel):
    """A block id outside the pool, an empty table or a table too short for the new tokens is
    refused on the host, naming the sequence: the Triton kernel would read past the pool or
    the table (on a GPU: another sequence's cache, or an illegal address)."""
    if kernel == "triton" and not triton_env.installed():
        pytest.skip("triton is not installed")
    cache = PagedKVCache(1, num_blocks=8, block_size=4, kv_heads=1, head_dim=8, kernel=kernel)
    for tables, lengths, message in [
        ([[0, 9]], [0], "sequence 0's block table holds 9, not a block id of this pool (0 .. 7)"),
        ([[0], []], [0, 0], "sequence 1's block table is empty"),
        ([[0]], [0, 1], "one table per length"),
        ([[0]], [-1], "sequence 0's length must be an int >= 0, got -1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            cache.set_batch(tables, lengths)
    cache.set_batch([[0, 1], [2]], [5, 1])  # room: 3 and 3 positions
    q = torch.randn(2, 2, 4, 8)
    k = v = torch.randn(2, 1, 4, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape(
            "sequence 0 of the batch has room for 3 more positions in its blocks, and this "
            "forward adds 4")):
        cache.layers[0].attend(q, k, v, scale=None)
    with torch.no_grad():
        assert cache.layers[0].attend(q[:, :, :3], k[:, :, :3], v[:, :, :3], None).shape == (
            2, 2, 3, 8)
