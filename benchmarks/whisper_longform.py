"""Long-form transcription with timestamps: qkv against faster-whisper and transformers.

Whisper tiny.en (the same CTranslate2 model.bin for all three), float32, greedy, timestamps
on, no previous text and no fallback (transformers' defaults, so the three decode the same
way), on espeak-ng clips of about 65 s (sentences with pauses). The runs alternate; the
best of ``--repeats`` is reported as audio seconds per second, with the CPU and threads.
qkv's time is then split into encoder and decoder (the encoder timed alone on the windows
the decoder actually visited).

    python -m benchmarks.whisper_longform [--clips 2] [--repeats 3] [--threads 2]
                                          [--batch-size 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from benchmarks.pretrained import WHISPER_SENTENCES as SENTENCES

import qkv.pretrained
from qkv.pretrained.speed import alternate, summarise
from qkv.pretrained.whisper import audio
from qkv.pretrained.whisper.options import TranscribeOptions


def clips(n: int) -> list[np.ndarray]:
    """``n`` clips of about 65 s: the sentences in turn with 0.5-2.5 s pauses."""
    with tempfile.TemporaryDirectory() as tmp:
        said = []
        for i, text in enumerate(SENTENCES):
            path = Path(tmp) / f"s{i}.wav"
            subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
            said.append(audio.load_audio(path))
    out = []
    for c in range(n):
        rng, parts = np.random.default_rng(c), []
        while sum(p.shape[0] for p in parts) < 16000 * 65:
            parts += [said[(c + len(parts)) % 5], np.zeros(int(16000 * rng.uniform(0.5, 2.5)),
                                                            np.float32)]  # fmt: skip
        out.append(np.concatenate(parts))
    return out


def hf_model(bundle):
    import transformers
    from benchmarks.pretrained import hf_whisper_from

    model = hf_whisper_from(bundle)
    model.generation_config.max_initial_timestamp_index = 50
    model.generation_config.max_new_tokens = None
    model.generation_config.max_length = 448
    return model, transformers.WhisperFeatureExtractor(feature_size=bundle.config.n_mels)


def encoder_share(bundle, samples: list[np.ndarray], o: TranscribeOptions) -> tuple[float, int]:
    """Seconds the encoder takes on the windows qkv's loop visits, and their count."""
    from qkv.pretrained.whisper.longform import Track, _step

    count = 0
    generator = torch.Generator().manual_seed(0)
    for x in samples:
        track = Track(x, bundle.config.n_mels)
        while not track.done:
            count += 1
            _step(bundle, [track], o, generator)
    windows = torch.randn(count, bundle.config.n_mels, 3000)
    start = time.perf_counter()
    with torch.no_grad():
        for w in windows:
            bundle.model.encode(w[None])
    return time.perf_counter() - start, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch-size", type=int, default=1,
                        help="qkv's recordings per batch (faster-whisper: one at a time)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bundle = qkv.pretrained.load("whisper-tiny.en")
    samples = clips(args.clips)
    seconds = sum(x.shape[0] for x in samples) / 16000
    o = TranscribeOptions.transformers()
    texts: dict[str, list[str]] = {}

    def ours() -> None:
        texts["qkv"] = [t.text for t in bundle.transcripts(samples, o,
                                                           batch_size=args.batch_size)]

    fns = {"qkv": ours}
    try:
        import faster_whisper

        fw = faster_whisper.WhisperModel(str(qkv.pretrained.locate("whisper-tiny.en")),
                                         device="cpu", compute_type="float32",
                                         cpu_threads=args.threads)  # fmt: skip

        def fast() -> None:
            texts["faster-whisper"] = ["".join(s.text for s in fw.transcribe(
                x, beam_size=1, language="en", condition_on_previous_text=False,
                temperature=0.0, vad_filter=False)[0]).strip() for x in samples]  # fmt: skip

        fns["faster-whisper"] = fast
    except ImportError:
        print("faster-whisper not installed (pip install 'qkv[bench]'): skipped")
    model, extractor = hf_model(bundle)

    def theirs() -> None:
        out = []
        for x in samples:
            f = extractor(x, sampling_rate=16000, return_tensors="pt", truncation=False,
                          padding="longest", return_attention_mask=True)  # fmt: skip
            with torch.no_grad():
                r = model.generate(f.input_features, attention_mask=f.attention_mask,
                                   return_timestamps=True, return_segments=True)  # fmt: skip
            out.append("".join(bundle.decode_text(s["tokens"].tolist())
                               for s in r["segments"][0]).strip())  # fmt: skip
        texts["transformers"] = out

    fns["transformers"] = theirs
    times = alternate(fns, args.repeats)
    rows = {name: summarise(t, seconds) for name, t in times.items()}
    enc, windows = encoder_share(bundle, samples, o)
    print(f"CPU: {platform.processor() or platform.machine()}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; "
          f"{len(samples)} clips, {seconds:.1f} s of audio; qkv batch size "
          f"{args.batch_size}")  # fmt: skip
    for name, r in rows.items():
        ratio = rows["qkv"]["best_per_s"] / r["best_per_s"]
        print(f"{name:15s} best {r['min_s']:.2f} s  {r['best_per_s']:6.1f} audio s/s   "
              f"qkv is {ratio:.2f}x")  # fmt: skip
    print(f"qkv: encoder {enc:.2f} s over {windows} windows of {rows['qkv']['min_s']:.2f} s "
          f"({enc / rows['qkv']['min_s']:.0%}); the rest is decoding and features")
    same = {n: texts[n] == texts["qkv"] for n in texts}
    print(f"texts equal to qkv's: {same}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "encoder_s": enc, "windows": windows,
                                         "texts_equal": same, "threads": args.threads,
                                         "batch_size": args.batch_size}, indent=2))


if __name__ == "__main__":
    main()
