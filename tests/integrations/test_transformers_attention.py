"""``attn_implementation="qkv"``: transformers models on qkv's attention core.

Random-weight BERT, GPT-2, Llama (grouped-query heads) and Mistral (sliding window) models are
built from tiny configs here; each runs under ``"qkv"`` and under transformers' ``"sdpa"`` with
the same weights, and the outputs (and, for Llama, the gradients) must agree to 1e-5 in
float32: on the backend ``auto`` picks, and with each layer's kernel call replaced by qkv's own
``flash`` and ``math`` backends. Captured weights are compared with the ``"eager"``
implementation's ``output_attentions``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import assert_close, max_error

transformers = pytest.importorskip("transformers")

import qkv.inspect  # noqa: E402
from qkv.attention.backends import flash as flash_backend  # noqa: E402
from qkv.attention.backends import math as math_backend  # noqa: E402
from qkv.integrations import transformers as qkv_hf  # noqa: E402

VOCAB, T = 40, 7


def _config(kind: str):
    common = dict(vocab_size=VOCAB)
    if kind == "bert":
        return transformers.BertConfig(
            **common, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=48, max_position_embeddings=32,
        )
    if kind == "gpt2":
        return transformers.GPT2Config(
            **common, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        )
    if kind == "llama":
        return transformers.LlamaConfig(
            **common, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        )
    assert kind == "mistral"
    return transformers.MistralConfig(
        **common, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
        sliding_window=3,
    )


def _model(kind: str, implementation: str, like=None):
    torch.manual_seed(0)
    auto = transformers.AutoModel if kind == "bert" else transformers.AutoModelForCausalLM
    model = auto.from_config(copy.deepcopy(_config(kind)), attn_implementation=implementation)
    if like is not None:
        model.load_state_dict(like.state_dict())
    return model.eval()


def _output(model, ids, mask):
    out = model(ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.fixture(scope="module", autouse=True)
def registered():
    return qkv_hf.register()


def _inputs(padded: bool):
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, T, dtype=torch.long)
    if padded:
        mask[1, :2] = 0  # left padding, as batched generation has it
    return ids, mask


def _set_kernel(model, kernel):
    for core in qkv_hf.attach(model).values():
        core.kernel = kernel


KERNELS = {"auto": None, "flash": flash_backend.run, "math": math_backend.run}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama", "mistral"])
def test_outputs_equal_sdpa(kind, padded, kernel):
    ours = _model(kind, "qkv")
    ref = _model(kind, "sdpa", like=ours)
    _set_kernel(ours, KERNELS[kernel])
    ids, mask = _inputs(padded)
    with torch.no_grad():
        got, want = _output(ours, ids, mask), _output(ref, ids, mask)
    keep = mask.bool()[..., None]  # padded positions are garbage in both: compare the rest
    assert_close(got * keep, want * keep, atol=1e-5, rtol=1e-5,
                 name=f"{kind} outputs ({kernel}, {'padded' if padded else 'full'})")


def test_llama_gradients_equal_sdpa():
    ours = _model("llama", "qkv")
    ref = _model("llama", "sdpa", like=ours)
    ids, mask = _inputs(True)
    for model in (ours, ref):
        (_output(model, ids, mask)[mask.bool()] ** 2).sum().backward()
    worst = max(
        max_error(a.grad, b.grad) for a, b in zip(ours.parameters(), ref.parameters(), strict=True)
    )
    assert worst <= 1e-5, f"parameter gradients differ by up to {worst:.3e}"


def test_the_model_really_runs_qkv():
    ours = _model("llama", "qkv")
    seen = []
    for core in qkv_hf.attach(ours).values():
        core.hook_q.add_hook(lambda q, _p: seen.append(tuple(q.shape)))
    with torch.no_grad():
        _output(ours, *_inputs(False))
    assert seen == [(2, 4, T, 8)] * 2, seen


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_capture_gives_eager_weights(kind):
    ours = _model(kind, "qkv")
    eager = _model(kind, "eager", like=ours)
    ids, mask = _inputs(True)
    names = list(qkv_hf.attach(ours))
    with qkv.inspect.capture(ours) as cap, torch.no_grad():
        returned = ours(ids, attention_mask=mask, output_attentions=True).attentions
        want = eager(ids, attention_mask=mask, output_attentions=True).attentions
    assert cap.layers == names
    rows = mask.bool()[:, None, :, None]  # (B, 1, T, 1): padded query rows differ by design
    for name, w, r in zip(names, want, returned, strict=True):
        assert_close(cap.weights[name] * rows, w * rows, atol=1e-6, name=f"{kind} {name}")
        assert_close(r * rows, w * rows, atol=1e-6, name=f"{kind} output_attentions {name}")
    if kind == "bert":
        assert set(cap.kinds.values()) == {"self"}, cap.kinds


def test_state_dict_unchanged_and_generate_equal_sdpa():
    ours = _model("llama", "qkv")
    keys = list(ours.state_dict())
    qkv_hf.attach(ours)
    assert list(ours.state_dict()) == keys, "the cores added state_dict keys"
    ref = _model("llama", "sdpa", like=ours)
    ids, mask = _inputs(True)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = ours.generate(ids, **kwargs)
    want = ref.generate(ids, **kwargs)
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"


def test_refusals_name_the_argument():
    module = torch.nn.Module()
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="'softcap'"):
        qkv_hf.attention_forward(module, q, q, q, None, softcap=30.0)
    with pytest.raises(ValueError, match="'position_bias'"):
        qkv_hf.attention_forward(module, q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="attention_mask"):
        qkv_hf.attention_forward(module, q, q, q, torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="name must be"):
        qkv_hf.register("sdpa")
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        qkv_hf.attach("model")
    with pytest.raises(ValueError, match="declares no attention modules"):
        qkv_hf.attach(torch.nn.Linear(2, 2))


def test_direct_call_matches_torch_sdpa_with_gqa_and_causal():
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    out, weights = qkv_hf.attention_forward(module, q, k, v, None, scaling=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.3, enable_gqa=True
    ).transpose(1, 2)  # (B, T, H, D)
    assert weights is None
    assert_close(out, want, atol=1e-6, name="attention_forward output (B, T, H, D)")
    assert isinstance(module.qkv_core, qkv_hf.HFAttentionCore)
    _, weights = qkv_hf.attention_forward(module, q, k, v, None, scaling=0.3,
                                          output_attentions=True)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-2, -1)) * 0.3  # (B, H, T, S)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    want_w = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    assert_close(weights, want_w, atol=1e-6, name="weights with output_attentions")


def test_viewer_on_a_transformers_model():
    ours = _model("llama", "qkv")
    names = list(qkv_hf.attach(ours))
    ids, _ = _inputs(False)
    view = qkv.inspect.view(ours, input_ids=ids[:1])
    text = json.dumps(view.data)
    assert all(name in text for name in names), f"viewer layers miss {names}"
