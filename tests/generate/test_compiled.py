"""The static KV cache and compiled decoding: the same logits and tokens as the dynamic cache."""

from __future__ import annotations

import pytest
import torch

from qkv.generate import compiled as compiled_mod
from qkv.generate import generate, greedy, sample
from qkv.generate.compiled import StaticDecoderSession
from qkv.generate.session import DecoderSession
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.nn.static_cache import StaticKVCache

# qkv against qkv (static and compiled sessions against the dynamic, eager ones): other kernels
# move both sides together, so make test's AVX2 pass leaves these to the first.
pytestmark = pytest.mark.self_check

V = 41
PROMPTS = [[3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]  # left-padded to one length
OTHER = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3], [4, 5]]  # other lengths, same batch size


def _model(style="llama", **kw):
    torch.manual_seed(0)
    make = DecoderLMConfig.llama_style if style == "llama" else DecoderLMConfig.gpt2_style
    extra = dict(num_kv_heads=2) if style == "llama" else {}
    return DecoderLM(make(V, d_model=32, num_layers=2, num_heads=4, max_len=64,
                          **{**extra, **kw})).eval()  # fmt: skip


@pytest.mark.parametrize("style", ["llama", "gpt2"])
@pytest.mark.parametrize("prompts", [PROMPTS, [[1, 2, 3, 4]]], ids=["padded", "single"])
def test_static_session_logits_equal_dynamic(style, prompts):
    model = _model(style)
    with torch.no_grad():
        dynamic = DecoderSession(model, prompts, 6)
        static = StaticDecoderSession(model, prompts, 6, compile=False)
        a, b = dynamic.first(), static.first()
        errors = [(a - b).abs().max().item()]
        for _ in range(5):
            tokens = a.argmax(-1)
            a, b = dynamic.next(tokens), static.next(tokens)
            errors.append((a - b).abs().max().item())
    assert max(errors) <= 1e-5, f"static vs dynamic cache, max logit error per step {errors}"


def test_compiled_greedy_equals_eager_and_compiles_once():
    model = _model()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # other tests in this process compiled too
    want = greedy(model, PROMPTS, max_new_tokens=8, eos_id=None)
    got = greedy(model, PROMPTS, max_new_tokens=8, eos_id=None, compile=True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = greedy(model, OTHER, max_new_tokens=9, eos_id=None, compile=True)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert torch.equal(again, greedy(model, OTHER, max_new_tokens=9, eos_id=None))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames == 1, (
        "the decode step must compile once (static shapes, another prompt length in the same "
        "capacity bucket), got "
        f"{torch._dynamo.utils.counters['stats']['unique_graphs']} graphs"
    )


def test_sampling_with_static_cache_equals_dynamic():
    model = _model("gpt2")
    want = sample(model, PROMPTS, max_new_tokens=6, temperature=0.8, seed=3, eos_id=None)
    session = StaticDecoderSession(model, PROMPTS, 6, compile=False)
    assert session.capacity == 256  # 6 + 6 rounded up to the bucket
    got = generate(model, PROMPTS, max_new_tokens=6, temperature=0.8, seed=3, eos_id=None,
                   compile=False)  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["decoder", "seq2seq"])
def test_failed_compile_warns_and_decodes_eagerly(kind, monkeypatch):
    model, inputs = (_model(), PROMPTS) if kind == "decoder" else (_seq2seq(), SOURCES)

    def broken(*args, **kwargs):
        def fail(*args, **kwargs):
            raise RuntimeError("no C++ compiler found")
        return fail

    monkeypatch.setattr(compiled_mod, "compiled_step", broken)
    monkeypatch.setattr(compiled_mod, "compiled_method", broken)
    want = greedy(model, inputs, max_new_tokens=5, eos_id=None)
    with pytest.warns(RuntimeWarning, match="needs a working C\\+\\+ compiler"):
        got = greedy(model, inputs, max_new_tokens=5, eos_id=None, compile=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("graphs", [False, True], ids=["compiled", "cuda-graph-rules"])
def test_a_later_failed_step_is_rerun_eagerly(graphs, monkeypatch):
    """A compiled step that fails after the first (a CUDA graph's recording, say) warns, runs
    that step again eagerly and every later one: the same tokens (the step rewrites its
    slots)."""
    model = _model()
    calls = []

    def flaky(model, **kwargs):
        def step(*args, **kw):
            calls.append(1)
            if len(calls) == 3:  # writes the cache first, then fails, as a graph might
                model(*args, **kw)
                raise RuntimeError("CUDA graph recording failed")
            return model(*args, **kw)
        return step

    monkeypatch.setattr(compiled_mod, "compiled_step", flaky)
    monkeypatch.setattr(compiled_mod, "uses_cuda_graphs", lambda device: graphs)
    want = greedy(model, PROMPTS, max_new_tokens=7, eos_id=None)
    with pytest.warns(RuntimeWarning, match="could not run the decoding step.*recording failed"):
        got = greedy(model, PROMPTS, max_new_tokens=7, eos_id=None, compile=True)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert len(calls) == 3, f"steps after the failure must run eagerly, got {len(calls)} calls"


def test_cuda_graph_sessions_share_one_zeroed_cache(monkeypatch):
    """With CUDA graphs (forced here; on the CPU ``reduce-overhead`` compiles without them),
    sessions of one shape reuse one cache kept with the model, at the same addresses, zeroed
    (the tokens of a second prompt set equal eager decoding), and a session still alive keeps
    its cache to itself."""
    model = _model()
    monkeypatch.setattr(compiled_mod, "uses_cuda_graphs", lambda device: True)
    torch._dynamo.reset()
    with torch.inference_mode():  # as generate() runs (a cache is made in one mode or not)
        a = StaticDecoderSession(model, PROMPTS, 8)
        assert a.cuda_graphs and a.compiled
        logits = a.first()
        for _ in range(3):
            logits = a.next(logits.argmax(-1))
        pointer = a.cache[0].k.data_ptr()
        b = StaticDecoderSession(model, OTHER, 8)  # a still alive: a cache of its own
    assert b.cache[0].k.data_ptr() != pointer
    del a, b
    got = greedy(model, OTHER, max_new_tokens=9, eos_id=None, compile=True)
    assert torch.equal(got, greedy(model, OTHER, max_new_tokens=9, eos_id=None))
    kept = [cache for cache, _ in model.__dict__["_qkv_static_caches"].values()]
    assert len(kept) <= compiled_mod.POOL
    assert any(c[0].k.data_ptr() == pointer for c in kept), "the first cache was not reused"
    with torch.inference_mode():
        session = StaticDecoderSession(model, PROMPTS, 8)  # the kept cache again, as new
    assert session.cache[0].k.data_ptr() in [c[0].k.data_ptr() for c in kept]
    assert all(int(layer.k.count_nonzero()) == int(layer.v.count_nonzero()) == 0
               for layer in session.cache), "a reused cache must be zeroed"
    assert session.cache.slots.tolist() == [0] and session.cache[0].static is None
    with torch.inference_mode():  # the model cast since: a cache of the new dtype
        model.double()
        cast = StaticDecoderSession(model, PROMPTS, 8)
        assert cast.cache[0].k.dtype == torch.float64
        model.float()
    assert compiled_mod.release_caches(model) == 2 and compiled_mod.release_caches(model) == 0


def test_cuda_graphs_only_on_cuda(monkeypatch):
    assert compiled_mod.uses_cuda_graphs(torch.device("cuda"))
    assert not compiled_mod.uses_cuda_graphs(torch.device("cpu"))
    monkeypatch.setattr(compiled_mod, "CUDA_GRAPHS", False)
    assert not compiled_mod.uses_cuda_graphs(torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decoding_equals_eager_on_the_gpu():
    """On a GPU the compiled step replays a CUDA graph (no skip) and gives eager's tokens, for
    a second prompt set too (the kept cache, re-zeroed), decoder-only and encoder-decoder."""
    decoder, seq2seq = _model().cuda(), _seq2seq().cuda()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for model, prompts, n in ((decoder, PROMPTS, 12), (decoder, OTHER, 9),
                              (seq2seq, SOURCES, 10), (seq2seq, OTHER_SOURCES, 10)):
        want = greedy(model, prompts, max_new_tokens=n, eos_id=None)
        got = greedy(model, prompts, max_new_tokens=n, eos_id=None, compile=True)
        assert torch.equal(got.cpu(), want.cpu()), (got.tolist(), want.tolist())
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    assert skips == 0, f"CUDA graphs were skipped {skips} times (see the cudagraphs log)"


def test_outputs_are_ordinary_tensors():
    """Decoding runs in inference mode but returns tensors a caller may edit in place."""
    out = greedy(_model(), PROMPTS, max_new_tokens=3)
    assert not out.is_inference()
    out[0, 0] = 1  # would raise on an inference tensor


def test_static_cache_errors():
    with pytest.raises(ValueError, match="static cache does not support sliding windows"):
        _model(window=4).new_cache(1, 8, static=True)
    with pytest.raises(ValueError, match="needs batch_size and max_len"):
        _model().new_cache(static=True)
    cache = _model().new_cache(2, 8, static=True)
    assert isinstance(cache, StaticKVCache) and cache[0].k.shape == (2, 2, 8, 8)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 8\)"):
        cache.set_slots(torch.tensor([8]))
    with pytest.raises(ValueError, match="one entry per new token"):
        cache.set_slots(torch.tensor([0, 1]))
        _model()(torch.tensor([[1, 2, 3], [1, 2, 3]]), cache=cache)
    alibi = Seq2SeqTransformer(Seq2SeqConfig(20, 20, d_model=16, num_heads=2, d_ff=32,
                                             bos_id=1, eos_id=2, positions="alibi"))  # fmt: skip
    with pytest.raises(ValueError, match="static cache does not support ALiBi"):
        greedy(alibi, [[3, 4, 2]], max_new_tokens=3, compile=True)
    with pytest.raises(ValueError, match="does not serve beam search"):
        generate(_model(), PROMPTS, beam_size=2, compile=True)
    with pytest.raises(ValueError, match="compile must be True or False"):
        greedy(_model(), PROMPTS, compile="yes")


# --- encoder-decoders ----------------------------------------------------------------------

SOURCES = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 2]]
OTHER_SOURCES = [[3, 4, 5, 2], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2]]


def _seq2seq(positions="sinusoidal"):
    torch.manual_seed(0)
    config = Seq2SeqConfig(40, 40, d_model=32, num_heads=4, num_encoder_layers=2,
                           num_decoder_layers=2, d_ff=64, pad_id=0, bos_id=1, eos_id=2,
                           max_len=300, positions=positions)  # fmt: skip
    return Seq2SeqTransformer(config).eval()


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rope"])
def test_static_seq2seq_logits_equal_dynamic(positions):
    from qkv.generate.compiled import StaticSeq2SeqSession
    from qkv.generate.session import Seq2SeqSession

    model = _seq2seq(positions)
    with torch.no_grad():
        dynamic = Seq2SeqSession(model, SOURCES, 8, 0, 1)
        static = StaticSeq2SeqSession(model, SOURCES, 8, 0, 1, compile=False)
        assert static.memory.shape[1] == 64 and static.capacity == 256  # the buckets
        a, b = dynamic.first(), static.first()
        errors = [(a - b).abs().max().item()]
        for _ in range(7):
            tokens = a.argmax(-1)
            a, b = dynamic.next(tokens), static.next(tokens)
            errors.append((a - b).abs().max().item())
    assert max(errors) < 1e-5, f"{positions}: static vs dynamic logits, max error {max(errors)}"


def test_compiled_seq2seq_greedy_equals_eager_and_compiles_once():
    model = _seq2seq()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    want = greedy(model, SOURCES, max_new_tokens=10, eos_id=None)
    got = greedy(model, SOURCES, max_new_tokens=10, eos_id=None, compile=True)
    again = greedy(model, OTHER_SOURCES, max_new_tokens=7, eos_id=None, compile=True)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert torch.equal(again, greedy(model, OTHER_SOURCES, max_new_tokens=7, eos_id=None))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 1, f"the decode step must compile once per bucket, got {graphs} graphs"


def test_static_caches_of_encoder_decoders_refuse_bad_use():
    from qkv.models.speech import SpeechSeq2Seq, SpeechSeq2SeqConfig

    speech = SpeechSeq2Seq(SpeechSeq2SeqConfig(
        vocab_size=50, n_mels=8, d_model=32, num_heads=4, num_encoder_layers=1,
        num_decoder_layers=1, d_ff=64, max_source_len=16, max_len=40, pad_id=49, bos_id=47,
        eos_id=49))  # fmt: skip
    for model in (_seq2seq(), speech):
        with pytest.raises(ValueError, match="needs batch_size and max_len"):
            model.new_cache(static=True)
    model = _seq2seq()
    cache = model.new_cache(8, static=True, batch_size=1)
    memory = model.encode(torch.tensor([[5, 6, 7]]))
    cache.set_slots(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"slots \(2,\) must have one entry per new token"):
        model.decode(torch.tensor([[1, 4, 5]]), memory, cache=cache)


# --- decoding from encoded inputs (speech) -------------------------------------------------


def test_static_memory_session_equals_dynamic_and_compiled_greedy_equals_eager():
    from qkv.generate.compiled import StaticMemorySession
    from qkv.generate.session import EncodedInputs, MemorySession
    from qkv.models.speech import SpeechSeq2Seq, SpeechSeq2SeqConfig

    torch.manual_seed(0)
    model = SpeechSeq2Seq(SpeechSeq2SeqConfig(
        vocab_size=50, n_mels=8, d_model=32, num_heads=4, num_encoder_layers=1,
        num_decoder_layers=2, d_ff=64, max_source_len=16, max_len=40, pad_id=49, bos_id=47,
        eos_id=49)).eval()  # fmt: skip
    memory = model.encode(torch.randn(2, 8, 30))  # (2, 15, 32)
    inputs = EncodedInputs(memory, [[47, 3, 4], [47, 5, 6]], suppress=[48])
    def error(a, b):  # suppressed tokens are -inf on both sides
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        return (a - b)[torch.isfinite(a)].abs().max().item()

    with torch.no_grad():
        dynamic = MemorySession(model, inputs, 10)
        static = StaticMemorySession(model, inputs, 10, compile=False)
        a, b = dynamic.first(), static.first()
        errors = [error(a, b)]
        for _ in range(6):
            tokens = a.argmax(-1)
            a, b = dynamic.next(tokens), static.next(tokens)
            errors.append(error(a, b))
    assert max(errors) < 1e-5, f"static vs dynamic logits, max error {max(errors)}"
    want = greedy(model, inputs, max_new_tokens=8, eos_id=None)
    got = greedy(model, inputs, max_new_tokens=8, eos_id=None, compile=True)
    assert torch.equal(got, want), (got.tolist(), want.tolist())


def _speech():
    from qkv.models.speech import SpeechSeq2Seq, SpeechSeq2SeqConfig

    torch.manual_seed(0)
    return SpeechSeq2Seq(SpeechSeq2SeqConfig(
        vocab_size=50, n_mels=8, d_model=32, num_heads=4, num_encoder_layers=1,
        num_decoder_layers=2, d_ff=64, max_source_len=16, max_len=40, pad_id=49, bos_id=47,
        eos_id=49)).eval()  # fmt: skip


@pytest.mark.parametrize("kind", ["seq2seq", "speech"])
def test_encoder_decoders_under_the_cuda_graph_rules(kind, monkeypatch):
    """Encoder-decoders and speech with CUDA graphs' rules (forced; the CPU compiles without
    graphs): two sessions of one shape share the kept cache, the second's cross-attention
    keys are its own (the tokens of other sources equal eager decoding)."""
    from qkv.generate.session import EncodedInputs

    monkeypatch.setattr(compiled_mod, "uses_cuda_graphs", lambda device: True)
    torch._dynamo.reset()
    if kind == "seq2seq":
        model, runs = _seq2seq(), [(SOURCES, 10), (OTHER_SOURCES, 10)]
    else:
        model = _speech()
        g = torch.Generator().manual_seed(1)
        runs = [(EncodedInputs(model.encode(torch.randn(2, 8, 30, generator=g)),
                               [[47, 3, 4], [47, 5, 6]], suppress=[48]), 8) for _ in range(2)]
    pointers = []
    for inputs, n in runs:
        want = greedy(model, inputs, max_new_tokens=n, eos_id=None)
        got = greedy(model, inputs, max_new_tokens=n, eos_id=None, compile=True)
        assert torch.equal(got, want), (kind, got.tolist(), want.tolist())
        (cache, _), = model.__dict__["_qkv_static_caches"].values()
        pointers.append(cache[0].k.data_ptr())
    assert pointers[0] == pointers[1], "the second session did not reuse the kept cache"


def test_a_static_cache_of_another_batch_size_is_named():
    """Issue 31: a batch-1 cache given a batch-3 input failed inside index_copy_."""
    cache = _model().new_cache(1, 8, static=True)
    cache.set_slots(torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"static cache holds .* batch_size=3"):
        _model()(torch.tensor([[1, 2, 3]] * 3), cache=cache)
