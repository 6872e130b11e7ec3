"""Benchmark the pretrained models on qkv against their reference libraries, side by side.

Usage::

    .venv/bin/python benchmarks/pretrained.py            # full run, a few minutes on 2 threads
    .venv/bin/python benchmarks/pretrained.py --quick    # small sizes: checks the script

Two measurements, float32 on the CPU, the same thread count for both sides (``--threads``):

1. **all-MiniLM-L6-v2 sentence encoding**: 256 varied sentences (short and long, punctuation,
   accents, CJK, emoji), batch 32, qkv's ``EncoderBundle.encode`` against
   sentence-transformers' ``SentenceTransformer.encode`` on the same model folder. Both sort
   by length, pad per batch, truncate at 256 tokens, mean-pool and normalise.
2. **SmolLM2-135M-Instruct greedy generation**: a 32-token prompt, 128 new tokens, qkv's
   ``qkv.generate.greedy`` (KV cache) on the GGUF loaded by ``qkv.pretrained.load`` against
   transformers' ``generate`` (``do_sample=False``, its default attention, KV cache) on the
   same GGUF loaded by transformers, float32. EOS is disabled on both sides (qkv: an id the
   model never produces; transformers: ``min_new_tokens``) so both produce exactly 128 tokens;
   the time includes the prompt's prefill. The tokens of both are compared. In the same
   alternating rounds (``--variants``): qkv with ``compile=True`` (a static cache, the step
   through ``torch.compile``; the compile time is measured apart, before the rounds) and qkv
   on weight-only int8 / int4 copies (``load(..., quantize=)``), each compared with qkv eager.
   Then the per-token decode time after 128 and after 2048 tokens of context (``context``).
3. **Whisper tiny.en transcription**: the same clips (espeak-ng speech: five sentences, and
   one ~45 s clip of all of them with pauses, decoded as two 30 s windows), greedy, without
   timestamps, from 16 kHz samples: qkv's ``SpeechBundle.transcribe`` against transformers'
   ``WhisperFeatureExtractor`` + ``WhisperForConditionalGeneration.generate`` holding the same
   weights (qkv's tensors under transformers' names; same suppressed tokens) and, when it is
   installed, faster-whisper (CTranslate2, float32) on the same model.bin folder. Throughput
   is audio seconds per wall second; the texts are compared.

The two sides alternate run by run, so drift on a shared machine hits both alike; the best
(min) and median of ``--repeats`` runs are reported, and the ratio qkv / reference of the
throughputs (> 1 means qkv is faster). Results go to a rich table and to
``benchmarks/results/pretrained.json`` (``--quick`` writes ``pretrained-quick.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console

import qkv.pretrained
from qkv.pretrained.speed import (
    alternate,
    bench_context,
    bench_minilm,
    bench_smollm2,
    report,
    summarise,
)

RESULTS = Path(__file__).resolve().parent / "results"
WHISPER_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things from the store.",
    "She sells fresh fruit and vegetables at the market every Saturday morning.",
    "We will meet at the library after lunch to finish the project.",
    "Artificial intelligence is changing how people work and learn.",
]
_HF_NAMES = [  # qkv SpeechSeq2Seq state-dict names -> transformers' Whisper names
    (r"^conv(\d)\.", r"model.encoder.conv\1."),
    (r"^encoder_pos$", "model.encoder.embed_positions.weight"),
    (r"^encoder_norm\.", "model.encoder.layer_norm."),
    (r"^decoder_norm\.", "model.decoder.layer_norm."),
    (r"^tgt_embed\.", "model.decoder.embed_tokens."),
    (r"^tgt_pos\.", "model.decoder.embed_positions."),
    (r"^lm_head\.", "proj_out."), (r"^(en|de)coder_blocks\.", r"model.\1coder.layers."),
    (r"\.cross_attn\.", ".encoder_attn."), (r"\.attn_norm\.", ".self_attn_layer_norm."),
    (r"\.cross_norm\.", ".encoder_attn_layer_norm."), (r"\.ffn_norm\.", ".final_layer_norm."),
    (r"\.ffn\.linear1\.", ".fc1."), (r"\.ffn\.linear2\.", ".fc2."),
]


def hf_whisper_from(bundle) -> object:
    """transformers' WhisperForConditionalGeneration holding ``bundle.model``'s tensors."""
    import re

    import transformers

    c = bundle.config
    config = transformers.WhisperConfig(
        vocab_size=c.vocab_size, num_mel_bins=c.n_mels, d_model=c.d_model,
        encoder_layers=c.num_encoder_layers, decoder_layers=c.num_decoder_layers,
        encoder_attention_heads=c.num_heads, decoder_attention_heads=c.num_heads,
        encoder_ffn_dim=c.d_ff, decoder_ffn_dim=c.d_ff, max_source_positions=c.max_source_len,
        max_target_positions=c.max_len, scale_embedding=False, pad_token_id=c.pad_id,
        bos_token_id=c.bos_id, eos_token_id=c.eos_id, decoder_start_token_id=c.bos_id)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    state = {}
    for name, t in bundle.model.state_dict().items():
        for pattern, repl in _HF_NAMES:
            name = re.sub(pattern, repl, name)
        state[name] = t
    model.load_state_dict(state, strict=True)
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=c.bos_id, eos_token_id=c.eos_id, pad_token_id=c.pad_id,
        no_timestamps_token_id=bundle.prompt[-1], suppress_tokens=list(bundle.suppress),
        begin_suppress_tokens=list(bundle.suppress_first), is_multilingual=False,
        max_new_tokens=224)
    return model


def whisper_clips(folder: Path, quick: bool) -> list:
    """espeak-ng speech as 16 kHz samples: each sentence, then all of them with pauses."""
    import subprocess

    import numpy as np

    from qkv.pretrained.whisper.audio import waveform

    clips = []
    for i, text in enumerate(WHISPER_SENTENCES[: 2 if quick else None]):
        path = folder / f"s{i}.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
        clips.append(waveform(path))
    if not quick:
        pause = np.zeros(16000 * 5, dtype=np.float32)
        clips.append(np.concatenate([x for c in clips for x in (c, pause)]))
    return clips


def bench_whisper(repeats: int, threads: int, quick: bool) -> dict:
    import tempfile

    import transformers

    from qkv.pretrained.whisper.audio import SAMPLE_RATE, log_mel, split_windows

    bundle = qkv.pretrained.load("whisper-tiny.en")
    ref = hf_whisper_from(bundle)
    extractor = transformers.WhisperFeatureExtractor(feature_size=bundle.config.n_mels)
    with tempfile.TemporaryDirectory() as tmp:
        clips = whisper_clips(Path(tmp), quick)
    seconds = sum(c.shape[0] for c in clips) / SAMPLE_RATE
    out: dict[str, list[str]] = {}

    def ours() -> None:
        out["qkv"] = [bundle.transcribe(c) for c in clips]

    def theirs() -> None:
        texts = []
        for c in clips:
            windows = [w.numpy() if hasattr(w, "numpy") else w for w in split_windows(c)]
            feats = extractor(windows, sampling_rate=SAMPLE_RATE, return_tensors="pt")
            with torch.no_grad():
                ids = ref.generate(feats.input_features, return_timestamps=False)
            texts.append(" ".join(t for t in (bundle.text(r) for r in ids.tolist()) if t))
        out["transformers"] = texts

    fns: dict[str, Callable[[], object]] = {"qkv": ours, "transformers": theirs}
    fw_name = None
    try:
        import faster_whisper

        fw = faster_whisper.WhisperModel(str(qkv.pretrained.locate("whisper-tiny.en")),
                                         device="cpu", compute_type="float32", cpu_threads=threads)

        def fast() -> None:
            out["faster-whisper"] = [" ".join(s.text.strip() for s in fw.transcribe(
                c, beam_size=1, language="en", without_timestamps=True, vad_filter=False,
                condition_on_previous_text=False)[0]) for c in clips]  # fmt: skip

        fns["faster-whisper"] = fast
        fw_name = f"faster-whisper {faster_whisper.__version__}, float32"
    except ImportError:
        pass
    times = alternate(fns, repeats)
    record = {
        "label": f"Whisper tiny.en greedy, {len(clips)} clips {seconds:.0f} s (audio s/s)",
        "what": f"whisper-tiny.en: transcribe {len(clips)} espeak-ng clips, {seconds:.1f} s "
                "of audio, greedy, no timestamps (audio seconds per second)",
        "qkv": summarise(times["qkv"], seconds),
        "reference": summarise(times["transformers"], seconds),
        "reference_name": f"transformers {transformers.__version__} generate, "
                          f"{ref.config._attn_implementation}",
        "texts_equal": out["qkv"] == out["transformers"],
        "log_mel_max_abs_diff": float((log_mel(clips[0]) - extractor(
            clips[0], sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features).abs().max()),
    }
    if fw_name is not None:
        record["faster_whisper"] = summarise(times["faster-whisper"], seconds)
        record["faster_whisper_name"] = fw_name
        record["texts_equal_faster_whisper"] = out["qkv"] == out["faster-whisper"]
        record["qkv_over_faster_whisper_best"] = (
            record["qkv"]["best_per_s"] / record["faster_whisper"]["best_per_s"])
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads for both sides (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs each (3; quick 1)")
    parser.add_argument("--only", choices=("minilm", "smollm2", "context", "whisper"),
                        default=None)  # fmt: skip
    parser.add_argument("--variants", default="compiled,int8,int4",
                        help="extra qkv generation variants, comma-separated: compiled, int8, "
                             "int4 (empty: none)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 3)
    config = {"threads": args.threads, "repeats": repeats, "quick": args.quick,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    records = []
    if args.only in (None, "minilm"):
        records.append(bench_minilm(32 if args.quick else 256, repeats))
    if args.only in (None, "smollm2"):
        variants = [v for v in args.variants.split(",") if v]
        records.append(bench_smollm2(32, 8 if args.quick else 128, repeats, variants))
    if args.only in (None, "context"):
        contexts = (128, 512) if args.quick else (128, 2048)
        records.append(bench_context(contexts, 4 if args.quick else 16, repeats))
    if args.only in (None, "whisper"):
        records.append(bench_whisper(repeats, args.threads, args.quick))
    report(Console(width=160), config, records)
    out = args.out or RESULTS / ("pretrained-quick.json" if args.quick else "pretrained.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "results": records}, indent=2))


if __name__ == "__main__":
    main()
