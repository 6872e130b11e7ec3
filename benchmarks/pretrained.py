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
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import qkv.pretrained
from qkv.generate import greedy

RESULTS = Path(__file__).resolve().parent / "results"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_PIECES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention weighs every token against every other one",
    "Café naïve résumé, Ångström and façade",
    "中文句子，日本語の文章、한국어 문장",
    "emoji 🙂👍🏽🎉 and flags 🇫🇷🇯🇵",
    "Punctuation!?... «quotes» — (parens) [brackets]",
    "Numbers like 3.14159 and 2024-01-01 appear too",
    "a rather long clause that keeps going about transformers, keys, queries and values",
]


def sentences(n: int) -> list[str]:
    """``n`` deterministic varied sentences: 1 to 12 pieces each (a few past 256 tokens)."""
    out = []
    for i in range(n):
        k = 1 + (i * 7) % 12 if i % 16 else 40  # every 16th one is long
        out.append(" ".join(_PIECES[(i + j) % len(_PIECES)] for j in range(k)))
    return out


def alternate(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Run each function ``repeats`` times, alternating, after one untimed warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def summarise(times: list[float], items: int) -> dict:
    return {"items": items, "min_s": min(times), "median_s": statistics.median(times),
            "best_per_s": items / min(times), "median_per_s": items / statistics.median(times)}


def bench_minilm(n: int, repeats: int) -> dict:
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    texts = sentences(n)
    bundle = qkv.pretrained.load("all-MiniLM-L6-v2")
    st = SentenceTransformer(str(qkv.pretrained.locate("all-MiniLM-L6-v2")), device="cpu")
    times = alternate({
        "qkv": lambda: bundle.encode(texts, batch_size=32),
        "sentence-transformers": lambda: st.encode(texts, batch_size=32, convert_to_tensor=True),
    }, repeats)  # fmt: skip
    ours, ref = bundle.encode(texts), st.encode(texts, batch_size=32, convert_to_tensor=True)
    return {
        "label": f"MiniLM encode {n}, batch 32 (sentences/s)",
        "what": f"all-MiniLM-L6-v2: encode {n} sentences, batch 32 (sentences/s)",
        "qkv": summarise(times["qkv"], n),
        "reference": summarise(times["sentence-transformers"], n),
        "reference_name": f"sentence-transformers {sentence_transformers.__version__}",
        "max_abs_diff": float((ours - ref).abs().max()),
    }


def bench_smollm2(prompt_len: int, new: int, repeats: int, variants: Sequence[str]) -> dict:
    """Greedy generation, qkv eager against transformers, plus each of ``variants``
    (``"compiled"``: ``compile=True``; ``"int8"``/``"int4"``: weight-only quantised copies)
    in the same alternating rounds. Compile time is measured apart (the first call)."""
    import transformers

    bundle = qkv.pretrained.load("SmolLM2-135M-Instruct")
    folder = str(qkv.pretrained.locate("SmolLM2-135M-Instruct").parent)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=torch.float32).eval()  # fmt: skip
    text = "Once upon a time, in a quiet harbour town, there lived an old sailor who " * 4
    prompt = bundle.tokenizer.encode(text)[:prompt_len]
    # EOS off: the last id of the vocabulary (an unused byte-level piece) ends nothing in
    # practice; every run is checked to have produced exactly `new` tokens.
    never = bundle.config.vocab_size - 1
    out: dict[str, list[int]] = {}

    def run(name: str, model: torch.nn.Module, **options: object) -> Callable[[], None]:
        def go() -> None:
            out[name] = greedy(model, [prompt], max_new_tokens=new, eos_id=never,
                               **options)[0].tolist()  # fmt: skip
            if len(out[name]) != new or never in out[name]:
                raise RuntimeError(f"{name} stopped early: {len(out[name])} of {new} tokens")
        return go

    def theirs() -> None:
        with torch.no_grad():
            ids = ref.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)  # fmt: skip
        out["transformers"] = ids[0, len(prompt):].tolist()

    fns: dict[str, Callable[[], None]] = {"qkv": run("qkv", bundle.model), "transformers": theirs}
    extra: dict[str, object] = {}
    if "compiled" in variants:
        fns["qkv compiled"] = run("qkv compiled", bundle.model, compile=True)
        start = time.perf_counter()
        fns["qkv compiled"]()  # compiles (the timed rounds reuse it)
        extra["compile_s"] = time.perf_counter() - start
    for mode in ("int8", "int4"):
        if mode in variants:
            model = qkv.pretrained.load("SmolLM2-135M-Instruct", quantize=mode).model
            fns[f"qkv {mode}"] = run(f"qkv {mode}", model)
    times = alternate(fns, repeats)

    def agree(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))

    record = {
        "label": f"SmolLM2 greedy {len(prompt)} -> {new} (tokens/s)",
        "what": f"SmolLM2-135M-Instruct: greedy, prompt {len(prompt)} -> {new} new tokens "
                "(tokens/s)",
        "qkv": summarise(times["qkv"], new),
        "reference": summarise(times["transformers"], new),
        "reference_name": f"transformers {transformers.__version__} generate, "
                          f"{ref.config._attn_implementation}",
        "tokens_equal_prefix": agree(out["qkv"], out["transformers"]),
        "variants": {},
        **extra,
    }
    for name in fns:
        if name.startswith("qkv "):
            record["variants"][name] = {**summarise(times[name], new),
                                        "tokens_equal_prefix": agree(out[name], out["qkv"])}
    return record


def bench_context(contexts: Sequence[int], steps: int, repeats: int) -> dict:
    """Per-token decode time of SmolLM2 (eager, one row) after ``contexts`` tokens of cache:
    the ratio of the longest to the shortest says how flat decoding stays in context."""
    from qkv.generate.session import DecoderSession

    model = qkv.pretrained.load("SmolLM2-135M-Instruct").model
    per_token: dict[int, list[float]] = {n: [] for n in contexts}
    sessions = {}
    with torch.inference_mode():
        for n in contexts:
            prompt = [(i * 37) % 1000 + 10 for i in range(n)]
            sessions[n] = DecoderSession(model, [prompt], steps * (repeats + 1) + 1)
            sessions[n].first()
        token = torch.tensor([42])
        for n in contexts:  # warm-up
            for _ in range(steps):
                sessions[n].next(token)
        for _ in range(repeats):
            for n in contexts:  # alternating, as every other measurement here
                start = time.perf_counter()
                for _ in range(steps):
                    sessions[n].next(token)
                per_token[n].append((time.perf_counter() - start) / steps)
    lo, hi = min(contexts), max(contexts)
    return {
        "label": f"SmolLM2 decode step, context {lo} vs {hi} (ms/token)",
        "ms_per_token": {n: {"min": 1e3 * min(v), "median": 1e3 * statistics.median(v)}
                         for n, v in per_token.items()},
        "ratio_longest_over_shortest_min": min(per_token[hi]) / min(per_token[lo]),
        "ratio_longest_over_shortest_median": (statistics.median(per_token[hi])
                                               / statistics.median(per_token[lo])),
    }


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

    from qkv.pretrained.audio import waveform

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

    from qkv.pretrained.audio import SAMPLE_RATE, log_mel, split_windows

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


def report(console: Console, config: dict, records: list[dict]) -> None:
    table = Table(title=f"qkv.pretrained vs references ({config['threads']} threads, float32)")
    for col in ("benchmark", "reference", "qkv best", "ref best", "ratio best", "qkv median",
                "ref median", "ratio median"):
        table.add_column(col, justify="left" if col in ("benchmark", "reference") else "right")
    compared = [r for r in records if "reference" in r]
    for r in compared:
        q, ref = r["qkv"], r["reference"]
        table.add_row(
            r["label"], r["reference_name"], f"{q['best_per_s']:.1f}", f"{ref['best_per_s']:.1f}",
            f"{q['best_per_s'] / ref['best_per_s']:.2f}x", f"{q['median_per_s']:.1f}",
            f"{ref['median_per_s']:.1f}", f"{q['median_per_s'] / ref['median_per_s']:.2f}x",
        )
    if compared:
        console.print(table)
    for r in records:
        if "ms_per_token" in r:  # bench_context
            steps = ", ".join(f"{n}: {v['min']:.1f} (median {v['median']:.1f})"
                              for n, v in r["ms_per_token"].items())  # fmt: skip
            console.print(f"{r['label']}: {steps}; longest/shortest "
                          f"{r['ratio_longest_over_shortest_min']:.2f}x (min), "
                          f"{r['ratio_longest_over_shortest_median']:.2f}x (median)")
            continue
        ref = r["reference"]
        keys = ("max_abs_diff", "tokens_equal_prefix", "texts_equal", "log_mel_max_abs_diff",
                "faster_whisper_name", "texts_equal_faster_whisper",
                "qkv_over_faster_whisper_best", "compile_s")
        extra = {k: r[k] for k in keys if k in r}
        console.print(f"{r['what']}: {extra}")
        for name, v in r.get("variants", {}).items():
            console.print(
                f"  {name}: best {v['best_per_s']:.1f}/s "
                f"({v['best_per_s'] / ref['best_per_s']:.2f}x transformers), "
                f"median {v['median_per_s']:.1f}/s "
                f"({v['median_per_s'] / ref['median_per_s']:.2f}x); tokens equal to qkv eager "
                f"for the first {v['tokens_equal_prefix']}")


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
