"""The decoding step's compiler pass: one-row float32 matmuls rewritten as reductions, the
same products within a float32 dot product's rounding, and nothing else touched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from helpers import dot_rounding_bound
from qkv.generate import gemv_pass, greedy
from qkv.generate.gemv_pass import DecodeGemv, compile_options
from qkv.models import DecoderLM, DecoderLMConfig


def _linear(*args):
    return F.linear(*args)


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("shape", [(1, 7), (37, 53), (3, 1), (200, 576)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (1, 1)], ids=["2d", "3d"])
def test_one_row_products_become_reductions_and_agree(shape, bias, lead):
    torch.manual_seed(0)
    N, K = shape
    x, w = torch.randn(*lead, K), torch.randn(N, K)
    args = (x, w, torch.randn(N)) if bias else (x, w)
    gm = make_fx(_linear, tracing_mode="fake")(*args)
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    assert matmuls & set(_targets(gm)), f"expected a matmul to rewrite, got {_targets(gm)}"
    DecodeGemv()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert not matmuls & set(_targets(gm)), f"a one-row matmul was left: {_targets(gm)}"
    got, want = gm(*args), _linear(*args)
    want64 = F.linear(*(a.double() for a in args))
    err = (got.double() - want64).abs()
    bound = dot_rounding_bound(x.reshape(1, K), w).reshape(err.shape) * 2
    assert got.shape == want.shape and got.dtype == torch.float32
    assert bool((err <= bound).all()), (f"max error {err.max().item():.3g} past the rounding "
                                        f"bound {bound.max().item():.3g}")  # fmt: skip


@pytest.mark.parametrize("case", ["two rows", "float64", "bfloat16"])
def test_other_products_are_left_to_inductor(case):
    rows, dtype = (2, torch.float32) if case == "two rows" else (1, getattr(torch, case))
    x, w = torch.randn(rows, 9, dtype=dtype), torch.randn(5, 9, dtype=dtype)
    gm = make_fx(_linear, tracing_mode="fake")(x, w)
    before = _targets(gm)
    DecodeGemv()(gm.graph)
    assert _targets(gm) == before, f"{case}: the graph changed to {_targets(gm)}"


def test_options_only_on_the_cpu_while_enabled(monkeypatch):
    assert isinstance(compile_options(torch.device("cpu"))["post_grad_custom_pre_pass"],
                      DecodeGemv)  # fmt: skip
    assert compile_options(torch.device("cuda")) is None
    monkeypatch.setattr(gemv_pass, "ENABLED", False)
    assert compile_options(torch.device("cpu")) is None


def test_the_uuid_names_the_pass_for_inductor_caches():
    assert DecodeGemv().uuid() == DecodeGemv().uuid() and DecodeGemv().uuid()


class _Counting(DecodeGemv):
    rewritten = 0

    def __call__(self, graph):
        before = sum(n.target is torch.ops.aten.mm.default for n in graph.nodes)
        super().__call__(graph)
        after = sum(n.target is torch.ops.aten.mm.default for n in graph.nodes)
        type(self).rewritten += before - after


@pytest.mark.self_check  # a compiled qkv step against the eager one
def test_a_compiled_one_row_greedy_runs_the_pass_and_equals_eager(monkeypatch):
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama_style(37, d_model=24, num_layers=1, num_heads=4,
                                                  num_kv_heads=2, max_len=64)).eval()  # fmt: skip
    monkeypatch.setattr(gemv_pass, "DecodeGemv", _Counting)
    prompt = [[5, 6, 7, 8, 9]]
    want = greedy(model, prompt, max_new_tokens=6, eos_id=None)
    # (a graph found in inductor's cache skips the passes: this one compiles afresh)
    import torch._inductor.config as inductor_config

    with inductor_config.patch(force_disable_caches=True):
        got = greedy(model, prompt, max_new_tokens=6, eos_id=None, compile=True)
    # per layer: q, k, v, out, gate, up, down; and the head
    assert _Counting.rewritten == 7 + 1, f"{_Counting.rewritten} matmuls rewritten"
    assert torch.equal(got, want), (got.tolist(), want.tolist())
