"""The torch drop-ins and the single heads sit on the one attention core: qkv.inspect captures,
hooks and views them as it does qkv's own models, weights equal to torch's, outputs unchanged."""

from __future__ import annotations

import pytest
import torch

import qkv.inspect as qi
import qkv.nn as qnn
from helpers import assert_close

E, H, T, S, N = 16, 4, 5, 7, 2


def _torch_weights(tmodel: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list]:
    """Per-head weights of every torch MultiheadAttention call, recomputed with weights on."""
    found: dict[str, torch.Tensor] = {}

    def hook(name):
        def on_call(module, args, kwargs, out):
            kw = dict(kwargs, need_weights=True, average_attn_weights=False)
            kw.pop("is_causal", None)
            with torch.no_grad():
                found[name] = module.forward(*args, **kw)[1]  # (N, H, T, S)
        return on_call

    handles = [
        m.register_forward_hook(hook(name), with_kwargs=True)
        for name, m in tmodel.named_modules() if isinstance(m, torch.nn.MultiheadAttention)
    ]
    return found, handles


def _pair(dtype=torch.float64):
    torch.manual_seed(0)
    kw = dict(d_model=E, nhead=H, num_encoder_layers=2, num_decoder_layers=2,
              dim_feedforward=24, dropout=0.0, batch_first=True, dtype=dtype)
    theirs = torch.nn.Transformer(**kw).eval()
    ours = qnn.Transformer(**kw).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def test_capture_a_torch_style_transformer_equals_torch_weights_and_changes_nothing():
    ours, theirs = _pair()
    src, tgt = torch.randn(N, S, E, dtype=torch.float64), torch.randn(N, T, E, dtype=torch.float64)
    tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    pad = torch.zeros(N, S, dtype=torch.bool)
    pad[1, -2:] = True  # the second source has two padding positions
    args = dict(tgt_mask=tgt_mask, memory_key_padding_mask=pad)
    expected, handles = _torch_weights(theirs)
    with torch.no_grad():
        ref = theirs(src, tgt, **args)
    for h in handles:
        h.remove()
    with torch.no_grad():
        plain = ours(src, tgt, **args)
        with qi.capture(ours) as cap:
            captured_out = ours(src, tgt, **args)
    assert torch.equal(plain, captured_out), "capture changed the outputs"
    assert_close(plain, ref, atol=1e-12, name="Transformer output vs torch")
    assert set(cap.layers) == set(expected), (cap.layers, list(expected))
    assert cap.kinds["decoder.layers.0.multihead_attn"] == "cross"
    assert cap.kinds["encoder.layers.1.self_attn"] == "self"
    for name, weights in expected.items():
        assert_close(cap.weights[name], weights, atol=1e-12, name=name)


def test_capture_standalone_multihead_attention_with_gqa_free_defaults():
    torch.manual_seed(1)
    theirs = torch.nn.MultiheadAttention(E, H, kdim=6, vdim=9)
    ours = qnn.MultiheadAttention(E, H, kdim=6, vdim=9)
    ours.load_state_dict(theirs.state_dict())
    q, k, v = torch.randn(T, N, E), torch.randn(S, N, 6), torch.randn(S, N, 9)
    _, ref = theirs(q, k, v, average_attn_weights=False)
    with qi.capture(ours) as cap:
        _, w = ours(q, k, v, average_attn_weights=False)
    assert_close(w, ref, atol=1e-6, name="MHA weights vs torch")
    assert_close(cap[0], ref, atol=1e-6, name="captured MHA weights vs torch")
    assert cap.kinds[cap.layers[0]] == "cross"


def test_ablating_a_head_of_a_dropin_through_hooks_equals_zeroing_its_columns():
    torch.manual_seed(2)
    layer = qnn.TransformerEncoderLayer(E, H, dim_feedforward=8, dropout=0.0,
                                        dtype=torch.float64).eval()
    x = torch.randn(T, N, E, dtype=torch.float64)
    D, head = E // H, 2

    def zero_head(out, _point):
        out = out.clone()
        out[:, head] = 0.0  # (N, H, T, D)
        return out

    with qi.hooks(layer, {"self_attn.hook_out": zero_head}):
        ablated = layer(x)
    with torch.no_grad():
        layer.self_attn.out_proj.weight[:, head * D:(head + 1) * D] = 0.0
    assert_close(ablated, layer(x), atol=1e-12, name="hook ablation vs zeroed columns")


def test_scores_hook_on_a_dropin_runs_the_math_path_with_equal_outputs():
    torch.manual_seed(3)
    mha = qnn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(N, T, E)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(T)
    plain, w = mha(x, x, x, attn_mask=mask)
    seen = []
    with qi.hooks(mha, {"hook_scores": lambda s, _p: seen.append(s.shape)}):
        hooked, hw = mha(x, x, x, attn_mask=mask)
    assert seen == [(N, H, T, T)]
    assert_close(hooked, plain, atol=1e-6, name="math path output")
    assert_close(hw, w, atol=1e-6, name="math path weights")


@pytest.mark.parametrize("causal", [False, True])
def test_head_list_heads_are_captured_one_head_each(causal):
    torch.manual_seed(4)
    heads = qnn.HeadList(E, H, causal=causal)
    x = torch.randn(N, T, E)
    with qi.capture(heads) as cap:
        _, weights = heads(x)
    assert cap.layers == [f"heads.{h}" for h in range(H)]
    for h in range(H):
        assert_close(cap.weights[f"heads.{h}"][:, 0], weights[:, h], atol=1e-6, name=f"head {h}")
    assert cap.kinds["heads.0"] == "self"  # the causal tril is a mask, not is_causal


def test_view_of_a_captured_dropin_transformer(tmp_path):
    ours, _ = _pair(torch.float32)
    src, tgt = torch.randn(1, S, E), torch.randn(1, T, E)
    with qi.capture(ours) as cap, torch.no_grad():
        ours(src, tgt)
    page = qi.view(cap, [f"s{i}" for i in range(S)], tmp_path / "v.html",
                   target_tokens=[f"t{i}" for i in range(T)])
    html = (tmp_path / "v.html").read_text()
    assert "decoder.layers.1.multihead_attn" in html and "encoder.layers.0.self_attn" in html
    assert page is not None


def test_view_runs_a_dropin_transformer_itself(tmp_path):
    ours, _ = _pair(torch.float32)
    src, tgt = torch.randn(1, S, E), torch.randn(1, T, E)
    with qi.capture(ours) as cap, torch.no_grad():
        ours(src, tgt)
    page = qi.view(ours, [f"s{i}" for i in range(S)], input_ids=src, target=tgt,
                   target_tokens=[f"t{i}" for i in range(T)])
    from_capture = qi.view(cap, [f"s{i}" for i in range(S)],
                           target_tokens=[f"t{i}" for i in range(T)])
    def layers(view):
        return [(layer["name"], layer["kind"]) for g in view.data["groups"] for layer in g["layers"]]

    assert layers(page) == layers(from_capture)
    assert {kind for _, kind in layers(page)} == {"self", "cross"}
    titles = [g["title"] for g in page.data["groups"]]
    assert titles == ["encoder self-attention", "decoder self-attention",
                      "decoder cross-attention"], titles
