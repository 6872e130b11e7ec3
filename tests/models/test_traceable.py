"""Every model traces: ``torch.compile(fullgraph=True)``, ``torch.export``, ONNX export (dynamo,
run by onnxruntime) and the meta device, each equal to eager (or shape-correct on meta).

Value checks (ids in range, 0/1 masks) read tensor values, which a trace cannot: they are
skipped while tracing (:func:`qkv.checks.values_unknown`) and still run in eager, tested last.
"""

from __future__ import annotations

import pytest
import torch

from qkv.models import (
    DecoderLM,
    DecoderLMConfig,
    Encoder,
    EncoderConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
    ViT,
    ViTConfig,
)
from qkv.models.speech import SpeechSeq2Seq, SpeechSeq2SeqConfig

V = 37


def _decoder(**kw):
    return DecoderLM(DecoderLMConfig(V, d_model=32, num_layers=2, num_heads=4, max_len=64, **kw))


def _ids(B, T, high=V, seed=0):
    return torch.randint(0, high, (B, T), generator=torch.Generator().manual_seed(seed))


# name -> (model factory, inputs factory): every model kind and positional scheme.
CASES = {
    "gpt2": (lambda: DecoderLM(DecoderLMConfig.gpt2_style(V, d_model=32, num_layers=2,
                                                          num_heads=4, max_len=64)),
             lambda: (_ids(2, 7),)),
    "llama-gqa": (lambda: DecoderLM(DecoderLMConfig.llama_style(
        V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=64)),
        lambda: (_ids(2, 7),)),
    "alibi": (lambda: _decoder(positions="alibi"), lambda: (_ids(1, 9),)),
    "sinusoidal": (lambda: _decoder(positions="sinusoidal"), lambda: (_ids(1, 9),)),
    "relative": (lambda: _decoder(positions="relative"), lambda: (_ids(2, 5),)),
    "window-softcap": (lambda: _decoder(positions="rope", window=3, attn_softcap=20.0,
                                        logit_softcap=10.0, qk_norm="rmsnorm"),
                       lambda: (_ids(1, 8),)),
    "encoder": (lambda: Encoder(EncoderConfig(V, d_model=32, num_layers=2, num_heads=4,
                                              d_ff=48, max_len=24)),
                lambda: (_ids(2, 6),)),
    "seq2seq": (lambda: Seq2SeqTransformer(Seq2SeqConfig(29, 31, d_model=32, num_heads=4,
                                                         d_ff=48, max_len=40)),
                lambda: (_ids(2, 6, 29), _ids(2, 5, 31, seed=1))),
    "vit": (lambda: ViT(ViTConfig(image_size=12, patch_size=4, channels=3, num_classes=5,
                                  d_model=32, num_layers=2, num_heads=4, d_ff=48)),
            lambda: (torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0)),)),
    "speech": (lambda: SpeechSeq2Seq(SpeechSeq2SeqConfig(
        vocab_size=50, n_mels=8, d_model=32, num_heads=4, num_encoder_layers=1,
        num_decoder_layers=1, d_ff=48, max_source_len=8, max_len=16, pad_id=0, bos_id=1,
        eos_id=2)),
        lambda: (torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(0)),
                 _ids(1, 4, 50))),
}


def _model(name):
    torch.manual_seed(0)
    return CASES[name][0]().eval()


def _err(a, b):
    return (a - b).abs().max().item()


def _bound(want) -> float:
    """A traced forward runs the same ops, but its linear layers take BLAS where eager
    inference takes oneDNN (qkv.nn.linear: traced calls are left to the tracer), which sum in
    another order: 16 float32 ulps of the largest output (measured: 4 on AVX2 kernels)."""
    return 16 * torch.finfo(torch.float32).eps * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("name", list(CASES))
def test_compile_fullgraph_equals_eager(name):
    """No graph break anywhere in a forward (``backend="eager"`` traces with dynamo exactly as
    inductor would, without the C++ compile); the traced forward equals eager."""
    model, inputs = _model(name), CASES[name][1]()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        want, got = model(*inputs), compiled(*inputs)
    assert _err(got, want) <= _bound(want), (
        f"{name}: compiled vs eager max error {_err(got, want):.3g} (bound {_bound(want):.3g})")


@pytest.mark.parametrize("name", list(CASES))
def test_export_equals_eager(name):
    model, inputs = _model(name), CASES[name][1]()
    program = torch.export.export(model, inputs)
    with torch.no_grad():
        want, got = model(*inputs), program.module()(*inputs)
    assert _err(got, want) <= _bound(want), (
        f"{name}: exported vs eager max error {_err(got, want):.3g} (bound {_bound(want):.3g})")


@pytest.mark.parametrize("name", list(CASES))
def test_meta_device(name):
    """The model is built and run on the meta device: shapes only, nothing allocated."""
    model, inputs = _model(name), CASES[name][1]()
    with torch.no_grad():
        want = model(*inputs)
    with torch.device("meta"):
        meta_model = CASES[name][0]().eval()
    assert all(p.device.type == "meta" for p in meta_model.parameters())
    with torch.no_grad():
        got = meta_model(*(x.to("meta") for x in inputs))
    assert got.device.type == "meta" and got.shape == want.shape, (got.shape, want.shape)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_onnx_export_runs_in_onnxruntime(name, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model, inputs = _model(name), CASES[name][1]()
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, inputs, str(path), dynamo=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs, strict=True)}
    got = torch.from_numpy(session.run(None, feeds)[0])
    with torch.no_grad():
        want = model(*inputs)
    assert _err(got, want) <= 1e-4, f"{name}: onnxruntime vs eager max error {_err(got, want):.3g}"


def test_eager_still_checks_values():
    """The skipped checks are only skipped while tracing: eager calls still reject bad ids."""
    model = _model("gpt2")
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=37\)"):
        model(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match="attention_mask must be boolean or hold only 0 and 1"):
        model(_ids(1, 3), attention_mask=torch.tensor([[1, 2, 1]]))
