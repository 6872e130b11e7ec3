"""Hook points: where they are, reading and replacing through them, ablation equals by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from inspect_refs import build

import qkv.inspect as qi
from helpers import assert_close
from qkv.nn import FeedForward, SwiGLU, TransformerBlock
from qkv.nn.hooks import HookPoint

ATTN_POINTS = ["hook_q", "hook_k", "hook_v", "hook_inputs", "hook_scores", "hook_weights",
               "hook_out"]  # fmt: skip
BLOCK_POINTS = ["hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_ffn_out",
                "hook_resid_post"]  # fmt: skip


def test_every_block_and_attention_has_its_hook_points():
    model, _ = build("seq2seq")
    names = set(qi.hook_points(model))
    for stack, n in (("encoder_blocks", 2), ("decoder_blocks", 2)):
        for i in range(n):
            for p in [*BLOCK_POINTS, "ffn.hook_hidden"]:
                assert f"{stack}.{i}.{p}" in names
            for p in ATTN_POINTS:
                assert f"{stack}.{i}.self_attn.{p}" in names
    assert "decoder_blocks.0.cross_attn.hook_weights" in names
    assert "decoder_blocks.0.hook_resid_cross" in names
    assert "encoder_blocks.0.hook_resid_cross" not in names
    # Hook points hold no parameters or buffers: state_dict keys are what they were.
    assert not any("hook_" in k for k in model.state_dict())


def test_hook_point_is_identity_and_listening_tracks_hooks():
    p = HookPoint()
    x = torch.randn(3)
    assert p(x) is x and not p.listening
    handle = p.add_hook(lambda v, hp: v * 2)
    assert p.listening and torch.equal(p(x), x * 2)
    handle.remove()
    assert not p.listening
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        p.add_hook(3)


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "encoder", "seq2seq"])
def test_reading_scores_runs_math_path_with_equal_outputs(kind, spy_backends):
    """A reader on hook_scores forces that layer's math path (the only place scores exist);
    the output stays equal to the fused path, and other layers keep their backend."""
    model, run = build(kind, torch.float64)
    with torch.no_grad():
        plain = run()
    n_plain = len(spy_backends)
    seen = {}
    name = next(iter(qi.attention_layers(model))) + ".hook_scores"
    with qi.hooks(model, {name: lambda v, n: seen.setdefault(n, v)}), torch.no_grad():
        out = run()
    assert_close(out, plain, atol=1e-10, name=f"{kind} output via the explicit path")
    assert len(spy_backends) == 2 * n_plain - 1, "only the hooked layer leaves SDPA"
    scores = seen[name]
    assert scores.dim() == 4 and scores.dtype == torch.float64


def test_idle_hook_points_change_nothing(spy_backends):
    """Hooks on q, k, v, inputs, out and the residual stream that return None leave the
    output bitwise equal and every call on its fused backend."""
    model, run = build("llama_gqa")
    with torch.no_grad():
        plain = run()
    before = list(spy_backends)
    spy_backends.clear()
    count = {"n": 0}

    def read(v, n):
        count["n"] += 1

    points = ["hook_q", "hook_k", "hook_v", "hook_inputs", "hook_out", *BLOCK_POINTS,
              "ffn.hook_hidden"]  # fmt: skip
    patterns = {f"*.{p}": read for p in points}
    with qi.hooks(model, patterns) as hooked, torch.no_grad():
        out = run()
    assert torch.equal(out, plain) and spy_backends == before
    assert count["n"] == len(hooked) == 2 * 11


def _zero_head(h: int):
    def fn(w, name):
        w = w.clone()
        w[:, h] = 0
        return w

    return fn


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "seq2seq"])
@pytest.mark.parametrize("point", ["hook_weights", "hook_out"])
def test_zeroing_a_head_equals_the_same_ablation_by_hand(kind, point):
    """Zero weights (or output) of head h in one layer == a copy of the model whose out_proj
    ignores head h (its columns h·D .. (h+1)·D set to zero)."""
    model, run = build(kind, torch.float64)
    layer = list(qi.attention_layers(model))[-1]
    h = 1
    with qi.hooks(model, {f"{layer}.{point}": _zero_head(h)}), torch.no_grad():
        ablated = run()
    by_hand = copy.deepcopy(model)
    attn = dict(by_hand.named_modules())[layer]
    D = attn.d_head
    with torch.no_grad():
        attn.out_proj.weight[:, h * D : (h + 1) * D] = 0
    with torch.no_grad():
        expected, plain = run(by_hand), run()
    assert_close(ablated, expected, atol=1e-10, name=f"{kind} {point} ablation")
    assert float((ablated - plain).abs().max()) > 1e-6, "the ablation changed nothing"


@pytest.mark.parametrize("ffn", [FeedForward(8, 12, activation="gelu"), SwiGLU(8, 12, bias=True)])
def test_ffn_hidden_hook_reads_and_replaces(ffn):
    x = torch.randn(2, 5, 8)
    seen = []
    ffn.hook_hidden.add_hook(lambda v, p: seen.append(v))
    ffn(x)
    assert seen[0].shape == (2, 5, 12)
    ffn.hook_hidden.add_hook(lambda v, p: torch.zeros_like(v))
    bias = ffn.linear2.bias if isinstance(ffn, FeedForward) else ffn.down_proj.bias
    assert_close(ffn(x), bias.expand(2, 5, 8), atol=0, name="ffn with zero hidden")


def test_residual_hooks_replace_the_stream():
    blk = TransformerBlock(8, 2, 16, norm="pre").eval()
    x = torch.randn(1, 4, 8)
    with qi.hooks(blk, {"hook_attn_out": lambda v, n: torch.zeros_like(v),
                        "hook_ffn_out": lambda v, n: torch.zeros_like(v)}):  # fmt: skip
        out = blk(x)
    assert_close(out, x, atol=0, name="pre-norm block with both branches zeroed")


def test_hooks_errors_name_the_pattern():
    model, _ = build("gpt2")
    with pytest.raises(ValueError, match=r"hook point 'blocks\.9\.\*' matches no name"), qi.hooks(
        model, {"blocks.9.*": lambda v, n: None}
    ):
        pass
    with pytest.raises(
        TypeError, match=r"the function for 'blocks\.0\.hook_resid_pre' must be callable"
    ), qi.hooks(model, {"blocks.0.hook_resid_pre": None}):
        pass
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got int"):
        qi.hook_points(3)
