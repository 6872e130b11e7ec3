"""qkv.inspect.capture: exact weights for every layer kind, outputs and backends untouched."""

from __future__ import annotations

import pytest
import torch
from inspect_refs import KINDS, V, build, math_weights

import qkv
import qkv.inspect as qi
from helpers import assert_close
from qkv.generate import greedy
from qkv.models import DecoderLM, DecoderLMConfig

TOL = {torch.float32: 1e-6, torch.float64: 1e-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_captured_equals_math_backend_weights(kind, dtype):
    model, run = build(kind, dtype)
    expected = math_weights(model, run)
    with qi.capture(model) as cap, torch.no_grad():
        run()
    assert set(cap.layers) == set(expected) == set(qi.attention_layers(model))
    for name, calls in expected.items():
        assert len(cap.calls[name]) == len(calls) == 1
        got = cap.weights[name]
        assert got.dtype == dtype
        assert_close(got, calls[0], atol=TOL[dtype], name=f"{kind} {name}")


def test_bfloat16_capture_is_close_to_the_math_backend():
    model, run = build("llama_gqa", torch.bfloat16)
    expected = math_weights(model, run)
    with qi.capture(model) as cap, torch.no_grad():
        run()
    for name, calls in expected.items():
        assert cap.weights[name].dtype == torch.bfloat16
        # Both round float32 weights to bfloat16 once (8 bits of mantissa): 2^-8 apart at most.
        assert_close(cap.weights[name].float(), calls[0].float(), atol=2**-8, name=name)


def test_kinds_name_self_causal_and_cross():
    model, run = build("seq2seq")
    with qi.capture(model) as cap, torch.no_grad():
        run()
    assert cap.kinds == {
        "encoder_blocks.0.self_attn": "self", "encoder_blocks.1.self_attn": "self",
        "decoder_blocks.0.self_attn": "causal self", "decoder_blocks.0.cross_attn": "cross",
        "decoder_blocks.1.self_attn": "causal self", "decoder_blocks.1.cross_attn": "cross",
    }
    assert cap.weights["decoder_blocks.1.cross_attn"].shape == (2, 3, 7, 9)


def test_equals_the_modules_own_need_weights_path():
    """An independent reference: the block's Attention called with need_weights=True on the
    block input recorded by its hook point (post-norm: the attention's input is the stream)."""
    model, run = build("encoder", torch.float64)
    with qi.capture(model, record="blocks.1.hook_resid_pre") as cap, torch.no_grad():
        run()
    x = cap.values["blocks.1.hook_resid_pre"][0]
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, 7:] = False  # the padding of build("encoder"), which pad_id 0 hides
    with torch.no_grad():
        _, w = model.blocks[1].self_attn(x, mask=keep[:, None, None, :], need_weights=True)
    assert_close(cap.weights["blocks.1.self_attn"], w, atol=1e-10, name="module need_weights")


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "seq2seq"])
def test_outputs_bitwise_unchanged_and_backend_unchanged(kind, spy_backends):
    model, run = build(kind)
    with torch.no_grad():
        plain = run()
    plain_calls = list(spy_backends)
    spy_backends.clear()
    with qi.capture(model, record="*.hook_resid_post") as cap, torch.no_grad():
        captured = run()
    assert torch.equal(plain, captured), "capturing changed the model's output"
    assert spy_backends == plain_calls, f"backends changed: {plain_calls} -> {spy_backends}"
    assert all(not nw for _, nw in spy_backends), "the model's own call asked for weights"
    assert {b for b, _ in spy_backends} <= {"torch", "flash"}, spy_backends
    assert cap.layers and cap.values


def test_heads_and_rows_are_slices_of_the_full_capture():
    model, run = build("llama_gqa")
    with qi.capture(model) as full, torch.no_grad():
        run()
    with qi.capture(model, layers=[-1, "blocks.0.*"], heads=[3, 0], rows=slice(-5, -1)) as part, (
        torch.no_grad()
    ):
        run()
    for name in ("blocks.0.self_attn", "blocks.1.self_attn"):
        expected = full.weights[name][:, [3, 0], -5:-1]
        assert part.heads[name] == [3, 0]
        assert_close(part.weights[name], expected, atol=1e-6, name=name)
    with qi.capture(model, layers=0, heads=1, rows=-1) as one, torch.no_grad():
        run()
    assert one.layers == ["blocks.0.self_attn"]
    assert_close(one[0], full.weights["blocks.0.self_attn"][:, [1], -1:], atol=1e-6, name="[0]")


@pytest.mark.parametrize("config", [
    DecoderLMConfig.llama_style(V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2),
    DecoderLMConfig(V, d_model=32, num_layers=2, num_heads=4, positions="alibi"),
], ids=["llama_gqa_rope", "alibi"])  # fmt: skip
def test_generation_with_kv_cache_equals_full_recompute(config):
    """Each generated token's attention over the prompt and the earlier outputs, recorded with
    the cache on, equals one forward pass over the final sequence. (A cached ALiBi step is
    not causal-flagged, so its distances come as a dense bias: a different mask path.)"""
    torch.manual_seed(0)
    m = DecoderLM(config).eval()
    prompt = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(1))
    with qi.capture(m) as gen:
        new = greedy(m, prompt, max_new_tokens=6)
    assert [len(c) for c in gen.calls.values()] == [6, 6]  # the prompt, then 5 cached steps
    assert gen.kinds["blocks.0.self_attn"] == "causal self"
    full = torch.cat([prompt, new[:, :-1]], dim=1)  # the last token is never fed back
    with qi.capture(m) as ref, torch.no_grad():
        m(full)
    for name in ref.layers:
        assert gen.weights[name].shape == (2, 4, 10, 10)
        assert_close(gen.weights[name], ref.weights[name], atol=1e-6, name=name)


def test_seq2seq_cached_decoding_equals_full_recompute():
    model, _ = build("seq2seq")
    src = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(3))
    with qi.capture(model, layers="decoder_blocks.*") as gen:
        new = greedy(model, src, max_new_tokens=5, eos_id=None)
    tgt = torch.cat([torch.tensor([[model.config.bos_id]]), new[:, :-1]], dim=1)
    with qi.capture(model, layers="decoder_blocks.*") as ref, torch.no_grad():
        model(src, tgt)
    for name in ref.layers:
        assert_close(gen.weights[name], ref.weights[name], atol=1e-6, name=name)
    assert gen.weights["decoder_blocks.0.cross_attn"].shape == (1, 3, 5, 6)


def test_capture_sees_an_ablation_made_through_a_hook():
    model, run = build("gpt2")

    def zero_head_1(w, name):
        w = w.clone()
        w[:, 1] = 0
        return w

    with qi.hooks(model, {"blocks.0.self_attn.hook_weights": zero_head_1}), qi.capture(
        model
    ) as cap, torch.no_grad():
        run()
    w0 = cap.weights["blocks.0.self_attn"]
    assert bool((w0[:, 1] == 0).all()) and float(w0[:, 0].sum()) > 0
    row_sums = cap.weights["blocks.1.self_attn"].sum(-1)
    assert_close(row_sums, torch.ones_like(row_sums), atol=1e-5, name="untouched layer rows")


def test_join_calls_pads_keys_and_refuses_mixed_batches():
    a, b = torch.ones(1, 2, 3, 3), torch.full((1, 2, 1, 4), 0.5)
    joined = qi.join_calls([a, b])
    assert joined.shape == (1, 2, 4, 4) and float(joined[0, 0, 0, 3]) == 0.0
    with pytest.raises(ValueError, match="different batch or head counts"):
        qi.join_calls([a, torch.ones(2, 2, 1, 4)], "blocks.0.self_attn")
    with pytest.raises(ValueError, match="never called"):
        qi.join_calls([], "x")


def test_errors_name_the_argument():
    model, run = build("gpt2")
    cases = [
        (ValueError, r"layers 'decoder\*' matches no name; available: blocks.0", {"layers": "decoder*"}),
        (ValueError, r"layers index 5 is out of range: the model has 2", {"layers": 5}),
        (ValueError, r"heads holds 3, but blocks\.0\.self_attn has H=3 heads", {"heads": [0, 3]}),
        (ValueError, r"must not repeat", {"heads": [1, -2]}),
        (TypeError, r"heads must be None, an int or a sequence of ints", {"heads": "0"}),
        (ValueError, r"rows must be a slice with step 1, got step 2", {"rows": slice(0, 4, 2)}),
        (ValueError, r"record 'nope' matches no name", {"record": "nope"}),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error, match=message), qi.capture(model, **kwargs):
            pass
    with pytest.raises(ValueError, match=r"rows=20 is out of range for T=11"), qi.capture(
        model, rows=20
    ), torch.no_grad():
        run()
    with pytest.raises(ValueError, match=r"Linear has no qkv attention modules"), qi.capture(
        torch.nn.Linear(2, 2)
    ):
        pass
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got str"), qi.capture(
        "gpt2"
    ):
        pass
    with qi.capture(model) as cap, torch.no_grad():
        run()
    with pytest.raises(KeyError, match=r"no captured layer 'x'"):
        cap["x"]


def test_weights_of_one_call_and_all_masked_rows():
    """Rows with no visible key give zero weights, as SDPA does."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    keep = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    keep[..., 2, :] = False
    inputs = qkv.nn.hooks.AttentionInputs(q, k, k, attn_mask=keep)
    _, ref = qkv.scaled_dot_product_attention(q, k, k, keep, need_weights=True, backend="math")
    assert_close(qi.weights_of(inputs), ref, atol=1e-12, name="weights_of")
    assert bool((qi.weights_of(inputs, rows=2) == 0).all())
    assert qi.weights_of(inputs, rows=slice(3, 3)).shape == (1, 2, 0, 6)


@pytest.mark.parametrize("is_causal", [False, True, "bottom-right"])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("rows", [None, slice(2, 9), -1])
def test_weights_of_rows_heads_with_every_mask_part(is_causal, alibi, rows):
    """Row blocks are calls of their own (the causal diagonal and ALiBi shift with them);
    every mask part, a per-row float mask included, gives the math backend's weights."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, S, D = 2, 4, 2, 11, 13, 59
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    mask = torch.randn(B, 1, T, S, generator=g, dtype=torch.float64)
    mask[0, 0, 3, 5:] = float("-inf")
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    inputs = qkv.nn.hooks.AttentionInputs(q, k, k, attn_mask=mask, is_causal=is_causal,
                                          alibi_slopes=slopes, enable_gqa=True)  # fmt: skip
    _, ref = qkv.scaled_dot_product_attention(
        q, k, k, mask, is_causal=is_causal, enable_gqa=True, alibi_slopes=slopes,
        need_weights=True, backend="math",
    )
    span = slice(None) if rows is None else rows if isinstance(rows, slice) else slice(-1, None)
    got = qi.weights_of(inputs, heads=[3, 1], rows=rows)
    assert_close(got, ref[:, [3, 1], span], atol=1e-12, name=f"causal={is_causal} alibi={alibi}")
    blocks = list(qi.weights.weight_blocks(inputs, heads=[3, 1], rows=rows, block_rows=3))
    assert_close(torch.cat([w for _, w in blocks], 2), got, atol=1e-12, name="in blocks of 3")


def test_captures_in_several_threads_at_once_each_record_their_own_calls():
    """Issue 31: 8 threads capturing one model at once all got captures that differed from
    the sequential ones (the hooks are the model's, shared); a capture now records only the
    calls of the thread that opened it."""
    import threading

    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt2_style(V, d_model=32, num_layers=2, num_heads=2,
                                                 max_len=32)).eval()
    inputs = [torch.randint(0, V, (1, 5 + i)) for i in range(6)]

    def run(ids):
        with torch.no_grad(), qi.capture(model) as cap:
            for _ in range(3):  # several calls, so the threads interleave
                model(ids)
        return cap

    sequential = [run(ids) for ids in inputs]
    results: list = [None] * len(inputs)
    barrier = threading.Barrier(len(inputs))

    def worker(i):
        barrier.wait()
        results[i] = run(inputs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i, (got, want) in enumerate(zip(results, sequential, strict=True)):
        assert got is not None, f"thread {i} did not finish"
        for name, calls in want.calls.items():
            assert len(got.calls[name]) == len(calls) == 3, f"thread {i} {name}"
            for a, b in zip(got.calls[name], calls, strict=True):
                assert_close(a, b, atol=0, name=f"thread {i} {name}")


def test_weights_too_large_to_keep_are_refused_before_the_call(monkeypatch):
    """Issue 31: capturing a 100k-token input of a RoPE model (no length limit) ran for minutes
    toward (B, H, T, S) weights no machine holds; it is refused at once, and heads=/rows= let
    a capture take less."""
    import importlib

    capture_module = importlib.import_module("qkv.inspect.capture")  # (the module, not the fn)
    monkeypatch.setattr(capture_module, "_memory_bytes", lambda: 1 << 20)  # a 1 MiB machine
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama_style(V, d_model=32, num_layers=1, num_heads=2,
                                                  max_len=16)).eval()
    ids = torch.randint(0, V, (1, 300))  # 2 heads x 300 x 300 x 4 bytes = 0.7 MiB > 0.5
    with pytest.raises(ValueError, match=r"needs 0.0 GiB .* pass heads= or rows="), \
            torch.no_grad(), qi.capture(model):
        model(ids)
    with torch.no_grad(), qi.capture(model, rows=-1) as cap:
        model(ids)
    assert next(iter(cap.calls.values()))[0].shape == (1, 2, 1, 300)
