"""Benchmark qkv's models against plain PyTorch: training throughput and cached decoding.

Usage::

    .venv/bin/python benchmarks/models.py            # full run, about 2-3 minutes on 1 thread
    .venv/bin/python benchmarks/models.py --quick    # tiny sizes, seconds: checks the script

Three measurements, float32 on the CPU, one thread by default (``--threads``):

1. **Seq2Seq training step**: ``qkv.models.Seq2SeqTransformer`` against an equal-size
   ``torch.nn.Transformer`` wrapped in the same embeddings (``·√E`` + sinusoids) and output
   projection. A step is forward, cross-entropy, backward and AdamW; dropout 0.1 in both;
   source padding masks in both. Tokens/s counts source + target tokens.
2. **Decoder LM training step**: ``qkv.models.DecoderLM`` (GPT-2 style) against a plain
   PyTorch GPT-2 written below (nanoGPT style: fused ``c_attn``,
   ``F.scaled_dot_product_attention(is_causal=True)``, tied head). Tokens/s counts inputs.
3. **Incremental decoding** with the GPT-2 style model, batch 1, after a prompt of ``C``
   tokens (C = 128, 512, 2048): greedy steps with the KV cache (one token in, cached keys
   reused) and without it (the whole sequence recomputed at every step). The prompt's prefill
   is not timed; the per-token time is the median over the steps.

The two implementations of each comparison alternate step by step, so drift on a shared
machine hits both alike; the median step time is reported. Results go to a rich table and to
``benchmarks/results/models.json`` (``--quick`` writes ``models-quick.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import qkv
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.nn import sinusoidal_table

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {
    "full": dict(E=256, H=4, layers=4, ff=1024, V=2000, s2s_B=16, s2s_L=64, lm_B=8, lm_T=128,
                 contexts=(128, 512, 2048), cache_steps=64, nocache_steps=4, train_steps=10),
    "quick": dict(E=64, H=4, layers=2, ff=128, V=200, s2s_B=4, s2s_L=16, lm_B=2, lm_T=32,
                  contexts=(16, 64), cache_steps=8, nocache_steps=2, train_steps=2),
}
PAD = 0
WARMUP_STEPS = 4  # untimed decoding steps before the timed ones, at every context


# --- references written with torch alone -----------------------------------------------------


class TorchSeq2Seq(nn.Module):
    """``torch.nn.Transformer`` with the embeddings and head qkv's Seq2SeqTransformer has."""

    pe: torch.Tensor

    def __init__(self, V: int, E: int, H: int, layers: int, ff: int, max_len: int) -> None:
        super().__init__()
        self.E = E
        self.src_embed, self.tgt_embed = nn.Embedding(V, E), nn.Embedding(V, E)
        self.register_buffer("pe", sinusoidal_table(max_len, E), persistent=False)
        self.drop = nn.Dropout(0.1)
        self.transformer = nn.Transformer(E, H, layers // 2, layers // 2, ff, dropout=0.1,
                                          batch_first=True)
        self.lm_head = nn.Linear(E, V)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        S, T = src.shape[1], tgt.shape[1]
        x = self.drop(self.src_embed(src) * math.sqrt(self.E) + self.pe[:S])  # (B, S, E)
        y = self.drop(self.tgt_embed(tgt) * math.sqrt(self.E) + self.pe[:T])  # (B, T, E)
        pad = src == PAD
        causal = nn.Transformer.generate_square_subsequent_mask(T)
        out = self.transformer(x, y, tgt_mask=causal, src_key_padding_mask=pad,
                               memory_key_padding_mask=pad, tgt_is_causal=True)
        return self.lm_head(out)  # (B, T, V)


class PlainGPTBlock(nn.Module):
    def __init__(self, E: int, H: int) -> None:
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.c_attn, self.c_proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.c_fc, self.mlp_proj = nn.Linear(E, 4 * E), nn.Linear(4 * E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, E = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(E, dim=2)  # (B, T, E) each
        q, k, v = (t.view(B, T, self.H, E // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, E))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2 in plain PyTorch: learned positions, pre-norm blocks, tied head."""

    def __init__(self, V: int, E: int, H: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, E), nn.Embedding(max_len, E)
        self.h = nn.ModuleList(PlainGPTBlock(E, H) for _ in range(layers))
        self.ln_f = nn.LayerNorm(E)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe.weight[: ids.shape[1]]  # (B, T, E)
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # (B, T, V)


# --- timing ----------------------------------------------------------------------------------


def train_step_fn(model: nn.Module, batch: Callable[[], tuple], loss_fn: Callable) -> Callable:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, *batch()).backward()
        opt.step()

    return step


def interleaved(steps: dict[str, Callable[[], None]], warmup: int, repeats: int) -> dict:
    """Median and min seconds per call of each function, calls alternating between them."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + repeats):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {n: {"median_s": statistics.median(t), "min_s": min(t)} for n, t in times.items()}


def bench_seq2seq(s: dict) -> dict:
    torch.manual_seed(0)
    B, L, V = s["s2s_B"], s["s2s_L"], s["V"]
    ours = Seq2SeqTransformer(Seq2SeqConfig(
        V, V, d_model=s["E"], num_heads=s["H"], num_encoder_layers=s["layers"] // 2,
        num_decoder_layers=s["layers"] // 2, d_ff=s["ff"], dropout=0.1, max_len=L)).train()
    ref = TorchSeq2Seq(V, s["E"], s["H"], s["layers"], s["ff"], L).train()
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, V, (B, L), generator=g)
    src[: B // 2, L - L // 4 :] = PAD  # half the rows padded
    tgt = torch.randint(3, V, (B, L + 1), generator=g)

    def loss(model, src, tgt):
        logits = model(src, tgt[:, :-1])
        return F.cross_entropy(logits.reshape(-1, V), tgt[:, 1:].reshape(-1))

    batch = lambda: (src, tgt)  # noqa: E731
    times = interleaved(
        {"qkv Seq2SeqTransformer": train_step_fn(ours, batch, loss),
         "torch.nn.Transformer": train_step_fn(ref, batch, loss)},
        warmup=1, repeats=s["train_steps"])
    tokens = B * 2 * L
    params = {"qkv Seq2SeqTransformer": ours.num_parameters(),
              "torch.nn.Transformer": sum(p.numel() for p in ref.parameters())}
    return {n: {**t, "tokens_per_s": tokens / t["median_s"], "parameters": params[n]}
            for n, t in times.items()}


def gpt_config(s: dict, max_len: int) -> DecoderLMConfig:
    return DecoderLMConfig.gpt2_style(s["V"], d_model=s["E"], num_layers=s["layers"],
                                      num_heads=s["H"], d_ff=4 * s["E"], max_len=max_len)


def bench_decoder_lm(s: dict) -> dict:
    torch.manual_seed(0)
    B, T, V = s["lm_B"], s["lm_T"], s["V"]
    ours = DecoderLM(gpt_config(s, T)).train()
    ref = PlainGPT(V, s["E"], s["H"], s["layers"], T).train()
    ids = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(2))

    def loss(model, ids):
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))

    batch = lambda: (ids,)  # noqa: E731
    times = interleaved(
        {"qkv DecoderLM (gpt2)": train_step_fn(ours, batch, loss),
         "plain PyTorch GPT": train_step_fn(ref, batch, loss)},
        warmup=1, repeats=s["train_steps"])
    params = {"qkv DecoderLM (gpt2)": ours.num_parameters(),
              "plain PyTorch GPT": sum(p.numel() for p in ref.parameters())}
    return {n: {**t, "tokens_per_s": B * T / t["median_s"], "parameters": params[n]}
            for n, t in times.items()}


@torch.no_grad()
def bench_decoding(s: dict) -> list[dict]:
    torch.manual_seed(0)
    contexts = s["contexts"]
    model = DecoderLM(gpt_config(s, max(contexts) + WARMUP_STEPS + s["cache_steps"] + 1))
    model.eval()
    g = torch.Generator().manual_seed(3)
    records = []
    for C in contexts:
        prompt = torch.randint(0, s["V"], (1, C), generator=g)
        # With the cache: prefill (untimed), then one token per step.
        cache = model.new_cache(max_len=C + WARMUP_STEPS + s["cache_steps"] + 1)
        token = model(prompt, cache=cache)[:, -1:].argmax(-1)  # (1, 1)
        for _ in range(WARMUP_STEPS):  # untimed: first calls of a new shape are slower
            token = model(token, cache=cache)[:, -1:].argmax(-1)
        cached = []
        for _ in range(s["cache_steps"]):
            start = time.perf_counter()
            token = model(token, cache=cache)[:, -1:].argmax(-1)
            cached.append(time.perf_counter() - start)
        # Without: the whole sequence again at every step.
        seq, full = prompt, []
        for i in range(s["nocache_steps"] + 1):
            start = time.perf_counter()
            token = model(seq)[:, -1:].argmax(-1)
            if i:  # the first (untimed) step warms up
                full.append(time.perf_counter() - start)
            seq = torch.cat([seq, token], 1)
        records.append({
            "context": C,
            "cache_ms_per_token": statistics.median(cached) * 1e3,
            "nocache_ms_per_token": statistics.median(full) * 1e3,
        })
    base = records[0]["cache_ms_per_token"]
    for r in records:
        r["cache_tokens_per_s"] = 1e3 / r["cache_ms_per_token"]
        r["nocache_tokens_per_s"] = 1e3 / r["nocache_ms_per_token"]
        r["cache_speedup"] = r["nocache_ms_per_token"] / r["cache_ms_per_token"]
        r["cache_time_vs_first_context"] = r["cache_ms_per_token"] / base
    return records


def report(console: Console, config: dict, results: dict) -> None:
    s = config["sizes"]
    console.print(
        f"float32, threads={config['threads']}, torch {config['torch']}; E={s['E']}, "
        f"H={s['H']}, layers={s['layers']}, V={s['V']}"
    )
    for key, title, what in (
        ("seq2seq", f"Seq2Seq training step (B={s['s2s_B']}, S=T={s['s2s_L']})", "src+tgt"),
        ("decoder_lm", f"Decoder LM training step (B={s['lm_B']}, T={s['lm_T']})", "input"),
    ):
        rows = results[key]
        table = Table("model", "parameters", "median ms", "min ms", f"{what} tokens/s",
                      "speed vs reference", title=title)
        ref = list(rows.values())[1]["tokens_per_s"]
        for name, r in rows.items():
            table.add_row(name, f"{r['parameters']:,}", f"{r['median_s'] * 1e3:.1f}",
                          f"{r['min_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                          f"{r['tokens_per_s'] / ref:.2f}x")
        console.print(table)
    table = Table("context", "cache ms/token", "cache tokens/s", "no cache ms/token",
                  "no cache tokens/s", "cache speed-up", "cache time vs first context",
                  title=f"Incremental decoding, GPT-2 style, batch 1 ({s['cache_steps']} cached "
                        f"steps, {s['nocache_steps']} uncached)")
    for r in results["decoding"]:
        table.add_row(str(r["context"]), f"{r['cache_ms_per_token']:.2f}",
                      f"{r['cache_tokens_per_s']:.0f}", f"{r['nocache_ms_per_token']:.1f}",
                      f"{r['nocache_tokens_per_s']:.1f}", f"{r['cache_speedup']:.1f}x",
                      f"{r['cache_time_vs_first_context']:.2f}x")
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    sizes = SIZES["quick" if args.quick else "full"]
    out = args.out or RESULTS / ("models-quick.json" if args.quick else "models.json")
    config = {"sizes": sizes, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "qkv": qkv.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "dtype": "float32"}
    console = Console(width=max(Console().width, 120))
    start = time.perf_counter()
    results = {"seq2seq": bench_seq2seq(sizes), "decoder_lm": bench_decoder_lm(sizes),
               "decoding": bench_decoding(sizes)}
    config["wall_s"] = round(time.perf_counter() - start, 1)
    report(console, config, results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "results": results}, indent=2))
    console.print(f"wrote {out} ({config['wall_s']} s)")


if __name__ == "__main__":
    main()
