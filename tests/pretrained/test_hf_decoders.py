"""Today's decoder families from Hugging Face folders, against transformers on the same weights.

For each family transformers creates a tiny random model (2-3 layers, hidden 64, GQA, a
sliding window shorter than the inputs where the family has one), saves it with
``save_pretrained`` (safetensors) and qkv loads the folder. Checked: logits (float32,
<= 1e-4), attention weights captured by :func:`qkv.inspect.capture` against transformers'
``output_attentions`` (eager), greedy tokens against ``generate(do_sample=False)``, and the
KV-cached decode against full recompute (or, for dynamic NTK RoPE, whose cached keys keep the
frequencies of their step by design, against transformers' own cached decode).
"""

from __future__ import annotations

import json

import pytest
import torch
from pretrained_refs import need

import qkv.inspect as qi
import qkv.pretrained
from helpers import assert_close
from qkv.generate import generate
from qkv.models import DecoderLM, DecoderLMConfig

V, E, L = 128, 64, 3
SIZES = dict(vocab_size=V, hidden_size=E, intermediate_size=96, num_hidden_layers=L,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)  # fmt: skip


def _llama_rope(kind: str, **params):
    return lambda t: t.LlamaConfig(**SIZES, rope_parameters={
        "rope_type": kind, "rope_theta": 10000.0, **params})  # fmt: skip


FAMILIES = {
    "mistral": lambda t: t.MistralConfig(**SIZES, sliding_window=5, head_dim=16),
    "qwen2": lambda t: t.Qwen2Config(**SIZES),
    "qwen2-sliding": lambda t: t.Qwen2Config(**{**SIZES, "num_hidden_layers": 3},
                                             use_sliding_window=True, sliding_window=4,
                                             max_window_layers=1),
    "qwen3": lambda t: t.Qwen3Config(**SIZES, head_dim=32),
    "gemma2": lambda t: t.Gemma2Config(**{**SIZES, "tie_word_embeddings": True}, head_dim=16,
                                       sliding_window=5, query_pre_attn_scalar=24,
                                       attn_logit_softcapping=4.0,
                                       final_logit_softcapping=3.0),
    "phi3": lambda t: t.Phi3Config(**SIZES, sliding_window=6),
    "phi3-partial": lambda t: t.Phi3Config(**{**SIZES, "num_key_value_heads": 4},
                                           rope_parameters={"rope_type": "default",
                                                            "rope_theta": 500.0,
                                                            "partial_rotary_factor": 0.5}),
    "llama-llama3": _llama_rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=16),
    "llama-linear": _llama_rope("linear", factor=4.0),
    "llama-dynamic": lambda t: t.LlamaConfig(**{**SIZES, "max_position_embeddings": 8},
                                             rope_parameters={"rope_type": "dynamic",
                                                              "rope_theta": 100.0,
                                                              "factor": 3.0}),
    "llama-yarn": _llama_rope("yarn", factor=4.0, original_max_position_embeddings=16),
    "llama-bias": lambda t: t.LlamaConfig(**SIZES, attention_bias=True),
}


def _reference(kind: str, folder) -> torch.nn.Module:
    """transformers' model of ``kind``, its weights randomised, saved to ``folder``."""
    transformers = need("transformers")
    torch.manual_seed(0)
    config = FAMILIES[kind](transformers)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # Large enough weights that every option moves the logits; norms and biases not at
        # their initial ones and zeros.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "bias" in name else 0.08))
    model.eval().save_pretrained(folder)
    return model


def _ids(T: int = 12) -> torch.Tensor:
    return torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_matches_transformers(tmp_path, kind):
    ref = _reference(kind, tmp_path)
    bundle = qkv.pretrained.load(tmp_path)
    model = bundle.model
    assert isinstance(model, DecoderLM) and bundle.tokenizer is None
    ids = _ids()

    # 1) Logits of the whole sequence, and the attention weights of every layer.
    with torch.no_grad(), qi.capture(model) as cap:
        ours = model(ids)
    with torch.no_grad():
        out = ref(ids, output_attentions=True)
    assert_close(ours, out.logits, atol=1e-4, name=f"{kind} logits")
    assert len(cap.layers) == L
    for i, name in enumerate(cap.layers):
        w = cap[name]
        assert_close(w.sum(-1), torch.ones_like(w.sum(-1)), atol=1e-5, name=f"{name} row sums")
        assert_close(w, out.attentions[i], atol=1e-5, name=f"{kind} {name} weights")

    # 2) Greedy decoding with qkv's KV cache (rolling for windowed layers).
    prompt = ids[:1, :6]
    tokens = generate(model, prompt, max_new_tokens=10)[0].tolist()
    with torch.no_grad():
        theirs = ref.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, 6:].tolist()  # fmt: skip
    assert tokens == theirs, f"{kind}: greedy tokens {tokens} != transformers' {theirs}"

    # 3) The cached decode: prefill 5, then one token at a time.
    with torch.no_grad():
        cache = model.new_cache()
        steps = [model(ids[:, :5], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(5, ids.shape[1])]
        cached = torch.cat(steps, 1)
        if kind == "llama-dynamic":
            past = ref(ids[:, :5], use_cache=True)
            expect = [past.logits]
            for t in range(5, ids.shape[1]):
                past = ref(ids[:, t : t + 1], past_key_values=past.past_key_values,
                           use_cache=True)  # fmt: skip
                expect.append(past.logits)
            assert_close(cached, torch.cat(expect, 1), atol=1e-4,
                         name=f"{kind} cached decode vs transformers' cached decode")
        else:
            assert_close(cached, ours, atol=1e-4, name=f"{kind} cached decode vs recompute")


def test_options_read_from_each_config(tmp_path):
    """The config translation, option by option (the parity test shows they are right)."""
    expect = {
        "mistral": dict(window=5, layer_windows=None, d_head=16),
        "qwen2": dict(qkv_bias=True, out_bias=False, window=None),
        "qwen2-sliding": dict(layer_windows=(None, 4, 4)),
        "qwen3": dict(qk_norm="rmsnorm", d_head=32),
        "gemma2": dict(layer_windows=(5, None, 5), attn_softcap=4.0, logit_softcap=3.0,
                       sandwich_norm=True, activation="geglu", attn_scale=24**-0.5,
                       embed_scale=8.0, tie_embeddings=True),
        "phi3-partial": dict(rope_dim=8, rope_base=500.0),
        "llama-llama3": dict(rope_scaling={
            "kind": "llama3", "factor": 8.0, "original_max_len": 16, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "attention_factor": None, "truncate": True}),
        "llama-bias": dict(qkv_bias=True, out_bias=True, bias=False),
    }
    # Files written before transformers had layer_types: the family's rule picks the layers.
    old = {"gemma2": dict(layer_windows=(5, None, 5)), "qwen2-sliding": dict(
        layer_windows=(None, 4, 4)), "qwen2": dict(window=None, layer_windows=None)}
    transformers = need("transformers")
    from qkv.pretrained.hf.folder import _config

    for kinds, drop in ((expect, ()), (old, ("layer_types",))):
        for kind, fields in kinds.items():
            hf = {k: v for k, v in FAMILIES[kind](transformers).to_dict().items()
                  if k not in drop}  # fmt: skip
            config, _ = _config(hf["model_type"], hf, tmp_path, tmp_path / "config.json")
            got = {k: getattr(config, k) for k in fields}
            assert got == fields, f"{kind} (without {drop}): {got} != {fields}"


@pytest.mark.parametrize(("edit", "match"), [
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0]}),
     r"RoPE scaling 'longrope' is not supported; known: \['dynamic', 'linear', 'llama3', "),
    (dict(mlp_bias=True), r"mlp_bias=True is not supported"),
    (dict(model_type="gemma2", hidden_activation="gelu"),
     r"hidden_activation='gelu' is not supported for a gated feed-forward"),
    (dict(model_type="falcon"), r"model_type='falcon' is not supported; known: \('bert', "
                                r"'gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', "
                                r"'phi3', 'bart', 't5', 'marian'\)"),
])
def test_unsupported_options_say_why(tmp_path, edit, match):
    transformers = need("transformers")
    hf = transformers.LlamaConfig(**SIZES).to_dict()
    if edit.get("model_type") == "gemma2":
        hf = transformers.Gemma2Config(**SIZES).to_dict()
    hf.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        qkv.pretrained.load(tmp_path)


def test_rope_settings_read_old_and_new_config_forms():
    from qkv.pretrained.hf.llama import rope_settings

    old = {"rope_theta": 5e5, "max_position_embeddings": 64,
           "rope_scaling": {"type": "dynamic", "factor": 2.0}}  # transformers 4
    assert rope_settings(old, "x", 16) == {"rope_base": 5e5, "rope_dim": None, "rope_scaling": {
        "kind": "dynamic", "factor": 2.0, "original_max_len": 64}}  # fmt: skip
    new = {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": None,
        "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5}}  # fmt: skip
    assert rope_settings(new, "x", 16) == {"rope_base": 1e4, "rope_dim": 8, "rope_scaling": {
        "kind": "yarn", "factor": 4.0, "original_max_len": 16}}  # fmt: skip
    with pytest.raises(ValueError, match=r"x: RoPE scaling parameters \['short_factor'\] are not"):
        rope_settings({"rope_scaling": {"rope_type": "linear", "factor": 2.0,
                                        "short_factor": [1.0]}}, "x", 16)  # fmt: skip
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.2 gives a rotary width of 3"):
        rope_settings({"partial_rotary_factor": 0.2}, "x", 16)


@pytest.mark.parametrize("window", [0, -4, True, 2.5, "8"])
def test_a_sliding_window_of_no_key_is_refused(window):
    """Issue 31: ``sliding_window: 0`` loaded for Qwen2 and Gemma 2 where transformers
    refuses it."""
    from qkv.pretrained.hf.llama import hf_windows

    with pytest.raises(ValueError, match="sliding_window must be a positive int or null"):
        hf_windows({"sliding_window": window, "use_sliding_window": False}, 2)
    assert hf_windows({"sliding_window": None}, 2) == {}


@pytest.mark.parametrize("family", ["Qwen2", "Mistral"])
def test_a_folder_that_says_tied_but_stores_another_head_loads_as_transformers_does(
        family, tmp_path):
    """Issue 31: ``tie_word_embeddings: true`` with a distinct ``lm_head.weight`` loaded tied
    (logits 2.0-2.7 from transformers'); transformers keeps the stored head, and so does qkv
    now, with a warning naming the file."""
    transformers = pytest.importorskip("transformers")
    import json
    import warnings

    from qkv.pretrained import load

    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        max_position_embeddings=64)
    torch.manual_seed(0)
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    hf_config["tie_word_embeddings"] = True  # the lie
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match="tie_word_embeddings is true but lm_head.weight"):
        bundle = load(str(tmp_path))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert_close(bundle.model(ids), reference(ids).logits, atol=1e-4, name=family)


def test_a_tokenizer_file_that_is_a_folder_is_named(tmp_path):
    """Issue 31: a Phi-3 folder whose tokenizer.json was a directory loaded with no tokenizer
    and no word."""
    from qkv.data.files import BadFileError
    from qkv.pretrained.hf.tokenizer import tokenizer_from_folder

    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(BadFileError, match=r"tokenizer\.json: expected a file, found a folder"):
        tokenizer_from_folder(tmp_path)
    assert tokenizer_from_folder(tmp_path / "tokenizer.json") is None  # no tokenizer files


def test_rotary_models_generate_past_max_position_embeddings(tmp_path, monkeypatch):
    """Issue 31: generate refused a prompt plus new tokens past ``max_position_embeddings``
    on a rotary model whose forward takes any length, where transformers generates. Now
    the tokens equal transformers' (6 + 14 tokens with a limit of 8); a learned position
    table (GPT-2) still refuses, naming its size."""
    monkeypatch.setitem(FAMILIES, "qwen2-short", lambda t: t.Qwen2Config(
        **{**SIZES, "max_position_embeddings": 8}))
    ref = _reference("qwen2-short", tmp_path)
    model = qkv.pretrained.load(tmp_path).model
    prompt = _ids()[:1, :6]
    tokens = generate(model, prompt, max_new_tokens=14)[0].tolist()
    with torch.no_grad():
        theirs = ref.generate(prompt, max_new_tokens=14, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, 6:].tolist()  # fmt: skip
    assert tokens == theirs, f"greedy tokens {tokens} != transformers' {theirs}"
    gpt2 = DecoderLM(DecoderLMConfig.gpt2_style(V, d_model=32, num_layers=1, num_heads=2,
                                                max_len=8)).eval()
    with pytest.raises(ValueError, match=r"exceeds the model's max_len=8 \(learned positions\)"):
        generate(gpt2, prompt, max_new_tokens=3)


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_half_precision_folder_loads_as_transformers_loads_it_in_float32(tmp_path, kind):
    """Issue 31: a Gemma 2 folder stored in float16 gave logits 1e-2 from transformers'
    (both in float32): qkv added Gemma's ``1 + w`` in the file's float16 before widening.
    Transforms now run in the wider dtype, so every family's fp16 folder loads as exactly as
    its float32 one (qkv computes in float32; transformers 5 by default in the stored
    dtype: docs/pretrained.md)."""
    transformers = need("transformers")
    _reference(kind, tmp_path / "f32").half().save_pretrained(tmp_path / "f16")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "f16", attn_implementation="eager", dtype=torch.float32).eval()
    model = qkv.pretrained.load(tmp_path / "f16").model
    ids = _ids()
    with torch.no_grad():
        assert_close(model(ids), ref(ids).logits, atol=1e-4, name=f"{kind} fp16 folder logits")


def test_labels_give_transformers_loss(tmp_path):
    """``model(ids, labels=labels).loss`` is transformers' number on the same weights, -100
    positions included (issue 27)."""
    ref = _reference("qwen2", tmp_path)
    model = qkv.pretrained.load(tmp_path).model
    ids = _ids()
    labels = ids.clone()
    labels[1, 3:6] = -100
    with torch.no_grad():
        ours, theirs = model(ids, labels=labels), ref(ids, labels=labels)
    assert_close(ours.loss, theirs.loss, atol=1e-5, name="loss")
    assert_close(ours.logits, theirs.logits, atol=1e-4, name="logits")
