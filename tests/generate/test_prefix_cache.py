"""Prefix caching and chunked prefill in the batching engine (issue 45). References:
``qkv.generate.greedy`` / ``sample`` on each request alone (sharing blocks and reading a
prompt in chunks must not change a token); the registry's bookkeeping against hand-counted
cases; the order of the loop's prefill chunks and decoding steps, logged."""

from __future__ import annotations

import threading

import pytest
import torch

from qkv.generate import greedy, sample, strip
from qkv.generate.batching import BatchingEngine
from qkv.generate.engine import SamplingParams
from qkv.generate.prefix_cache import PrefixCache
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn.paged_cache import PagedKVCache

TIMEOUT = 60
pytestmark = pytest.mark.self_check  # the engine against qkv.generate alone
V = 211


def _model(kind: str = "llama") -> DecoderLM:
    torch.manual_seed(0)
    if kind == "llama":
        config = DecoderLMConfig.llama_style(vocab_size=V, d_model=64, num_layers=2,
                                             num_heads=4, num_kv_heads=2)  # fmt: skip
    else:
        config = DecoderLMConfig(vocab_size=V, d_model=64, num_layers=2, num_heads=4,
                                 positions="learned", max_len=256)  # fmt: skip
    return DecoderLM(config).eval()


def _alone(model, prompt, n, eos=None, **sampling):
    if sampling:
        return strip(sample(model, [prompt], max_new_tokens=n, eos_id=eos, **sampling), eos)[0]
    return strip(greedy(model, [prompt], max_new_tokens=n, eos_id=eos), eos)[0]


def _registry(blocks=8, size=4) -> PrefixCache:
    return PrefixCache(PagedKVCache(1, num_blocks=blocks, block_size=size, kv_heads=1,
                                    head_dim=2))  # fmt: skip


def test_blocks_are_shared_by_everything_before_their_end():
    r = _registry()
    a = list(range(10, 22))  # 12 tokens: 3 full blocks
    table, cached = r.acquire(a, 4)
    assert cached == 0 and r.held == 4
    r.register(table, a)
    r.release(table)
    assert (r.held, len(r.idle), len(r.cache.free)) == (0, 3, 5)
    # same first 8 tokens, then others: 2 blocks shared
    b = [*a[:8], 1, 2, 3, 4, 5]
    table_b, cached = r.acquire(b, 4)
    assert cached == 8 and table_b[:2] == table[:2] and len(set(table_b)) == 4
    # a prompt of exactly 3 full blocks shares 2: its last token is always computed
    table_c, cached = r.acquire(a, 3)
    assert cached == 8 and table_c[:2] == table[:2]
    assert r.refs[table[0]] == 2 and r.held == 5
    # the same tokens at another offset share nothing (the chain differs from block 0)
    assert r.acquire([99, *a], 3)[1] == 0
    assert r.hit_tokens == 16 and r.queried_tokens == 12 + 13 + 12 + 13


def test_idle_blocks_are_evicted_least_recently_used_first():
    r = _registry(blocks=4)
    first, second = [1] * 4 + [0], [2] * 4 + [0]
    for prompt in (first, second):
        table, _ = r.acquire(prompt, 2)
        r.register(table, prompt[:4])
        r.release(table)
    assert len(r.idle) == 2 and len(r.cache.free) == 2
    table, _ = r.acquire([3] * 9, 3)  # needs 3 new: both free, then the LRU idle (first's)
    assert r.acquire(first, 2) is None, "one block is left: too few for a request of 2"
    r.release(table)
    assert r.acquire(first, 1)[1] == 0, "the first prompt's block was evicted"
    assert r.acquire(second, 1)[1] == 4, "the second prompt's block was kept"


def test_a_block_whose_content_is_registered_stays_private():
    r = _registry()
    prompt = [5, 6, 7, 8, 9]
    one, _ = r.acquire(prompt, 2)
    two, _ = r.acquire(prompt, 2)  # both before either registered: no sharing
    r.register(one, prompt)
    r.register(two, prompt)
    assert two[0] not in r.hash_of and r.hash_of[one[0]]
    r.release(two)
    assert two[0] in r.cache.free and len(r.idle) == 0


def _run(engine, jobs):
    """Submit every ``(prompt, params)`` job, then start: the tokens of each."""
    submitted = [engine.submit(p, params) for p, params in jobs]
    engine.start()
    try:
        return [list(r.tokens(timeout=TIMEOUT)) for r in submitted], submitted
    finally:
        engine.shutdown(timeout=TIMEOUT)


def _run_one(engine, prompt, n, **sampling):
    """One request on a started engine: its tokens and the request."""
    engine.start()
    request = engine.submit(prompt, SamplingParams(max_new_tokens=n, **sampling))
    return list(request.tokens(timeout=TIMEOUT)), request


@pytest.mark.parametrize("kind", ["llama", "learned"])
def test_shared_prefixes_give_each_request_its_tokens_alone(kind):
    model = _model(kind)
    torch.manual_seed(2)
    system = torch.randint(3, V, (37,)).tolist()
    tails = [[], [5], [9, 9, 9, 9, 9, 9], torch.randint(3, V, (13,)).tolist()]
    prompts = [system + t for t in tails] + [[*system[:20], 7, 7], system[:3]]
    engine = BatchingEngine(model, eos_id=None, max_batch=3, block_size=4, num_blocks=80)
    # one after the other: each finds the blocks of those before
    outs = [_run_one(engine, p, 9)[0] for p in prompts]
    engine.shutdown(timeout=TIMEOUT)
    assert outs == [_alone(model, p, 9) for p in prompts]
    # the system prompt's 9 full blocks (36 positions) for the three that hold it all, its
    # first 5 (20) for the partial overlap, none for the 3-token prompt
    assert engine.blocks.hit_tokens == 3 * 36 + 20, engine.blocks.hit_tokens
    assert engine.blocks.held == 0


def test_concurrent_sampled_requests_on_one_prefix_draw_as_alone():
    model = _model()
    system = list(range(20, 60))
    jobs = [([*system, i], SamplingParams(max_new_tokens=8, temperature=0.8, seed=i))
            for i in range(6)]  # fmt: skip
    engine = BatchingEngine(model, max_batch=4, block_size=8, num_blocks=64)
    outs, _ = _run(engine, jobs)
    eos = model.config.eos_id
    assert outs == [_alone(model, p, 8, eos=eos, temperature=0.8, seed=s.seed) for p, s in jobs]
    assert engine.blocks.hit_tokens >= 5 * 40, "the later requests did not share the prefix"


def test_a_chat_s_next_turn_reads_the_answer_it_was_given():
    """The blocks a request's answer filled are shareable too: the next turn (prompt +
    answer + more) reads them."""
    model = _model()
    engine = BatchingEngine(model, eos_id=None, max_batch=2, block_size=4, num_blocks=40)
    first_prompt = list(range(30, 45))
    answer, _ = _run_one(engine, first_prompt, 20)
    second = first_prompt + answer + [3, 4, 5]
    before = engine.blocks.hit_tokens
    again, _ = _run_one(engine, second, 6)
    engine.shutdown(timeout=TIMEOUT)
    assert again == _alone(model, second, 6)
    # positions 0 .. 33 were written (15 + 19 fed back): 8 full blocks
    assert engine.blocks.hit_tokens - before == 32


def test_eviction_under_pressure_keeps_every_answer():
    model = _model()
    torch.manual_seed(3)
    prefixes = [torch.randint(3, V, (16,)).tolist() for _ in range(3)]
    prompts = [[*prefixes[k], i] for i, k in enumerate([0, 0, 1, 0, 2, 2, 0, 1, 1])]
    engine = BatchingEngine(model, eos_id=None, max_batch=2, block_size=4, num_blocks=14)
    outs = [_run_one(engine, p, 10)[0] for p in prompts]
    engine.shutdown(timeout=TIMEOUT)
    assert outs == [_alone(model, p, 10) for p in prompts]
    assert engine.blocks.evicted > 0 and engine.blocks.hit_tokens > 0, "no pressure, or no hit"
    assert engine.blocks.held == 0 and len(engine.blocks.idle) + len(engine.cache.free) == 14


def test_without_prefix_caching_nothing_is_shared():
    model = _model()
    prompt = list(range(3, 40))
    engine = BatchingEngine(model, eos_id=None, block_size=4, num_blocks=40, prefix_cache=False)
    outs = [_run_one(engine, prompt, 5)[0] for _ in range(2)]
    engine.shutdown(timeout=TIMEOUT)
    assert outs == [_alone(model, prompt, 5)] * 2
    assert engine.blocks.hit_tokens == 0 and not engine.blocks.idle


def test_a_long_prompt_is_read_in_chunks_while_the_others_decode():
    model = _model()
    engine = BatchingEngine(model, eos_id=None, max_batch=4, block_size=4, num_blocks=80,
                            prefill_chunk=8)  # fmt: skip
    log, lock = [], threading.Lock()
    prefill, step = engine._prefill, engine._step

    def logged_prefill(run, budget):
        n = prefill(run, budget)
        with lock:
            log.append(("prefill", run.request.id, n))
        return n

    def logged_step():
        with lock:
            log.append(("step", tuple(r.request.id for r in engine.running), 0))
        step()

    engine._prefill, engine._step = logged_prefill, logged_step
    long_prompt = list(range(3, 63))  # 60 positions
    # Both queued before the loop starts: no race with the loop's speed. The first turn reads
    # the short prompt (3) and 5 of the long one, each later turn 8, then the rest (7).
    running = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=30))
    newcomer = engine.submit(long_prompt, SamplingParams(max_new_tokens=4))
    engine.start()
    try:
        got = list(newcomer.tokens(timeout=TIMEOUT))
        list(running.tokens(timeout=TIMEOUT))
    finally:
        engine.shutdown(timeout=TIMEOUT)
    assert got == _alone(model, long_prompt, 4)
    chunks = [i for i, (kind, rid, _) in enumerate(log) if kind == "prefill" and rid == newcomer.id]
    assert [log[i][2] for i in chunks] == [5, 8, 8, 8, 8, 8, 8, 7], log
    between = [e for e in log[chunks[0] : chunks[-1]] if e[0] == "step"]
    assert len(between) == 7 and all(running.id in e[1] for e in between), log
