"""Context-parallel cases run on a real gloo process group; results written as JSON.

Run as ``python cp_workers.py --world N --out FILE [--only a,b]``: spawns ``N`` processes,
each joins one gloo group (with a timeout), runs every case and rank 0 writes ``{case: {name:
max error}}`` (or ``{"error": message}`` for cases that must raise). Every case compares with
single-process attention on the full sequence computed on every rank from the same seed.
The tests in ``test_context_parallel.py`` read the file and assert per case.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qkv
from qkv.attention.call import make_call
from qkv.distributed import (
    all_to_all_attention,
    context_parallel,
    gather_sequence,
    ring_attention,
    shard_sequence,
)
from qkv.distributed.ring import ring_call
from qkv.distributed.ulysses import all_to_all_call
from qkv.models import DecoderLM, DecoderLMConfig, Encoder, EncoderConfig

METHODS = {"ring": ring_attention, "all_to_all": all_to_all_attention}
CALLS = {"ring": ring_call, "all_to_all": all_to_all_call}

# (name, method, B, H, Hkv, T, D, causal, dtype). T takes values not divisible by 2N.
KERNEL_CASES = [
    (f"{m}-{tag}", m, *shape)
    for m in ("ring", "all_to_all")
    for tag, shape in {
        "plain-f64": (2, 4, 4, 24, 8, False, "float64"),
        "causal-f64": (2, 4, 4, 24, 8, True, "float64"),
        "gqa-causal-f64": (1, 4, 2, 29, 8, True, "float64"),
        "mqa-f64": (1, 4, 1, 19, 16, False, "float64"),
        "odd-T-causal-f64": (2, 4, 4, 13, 4, True, "float64"),
        "causal-f32": (2, 4, 4, 40, 16, True, "float32"),
        "gqa-f32": (1, 8, 2, 33, 8, False, "float32"),
        "h6-gqa-causal-f64": (1, 6, 3, 25, 8, True, "float64"),
        "empty-batch-f64": (0, 4, 2, 24, 8, True, "float64"),  # an empty result, as torch
    }.items()
]
# Mask parts a model sends through the kernel: ALiBi, windows, key padding.
FEATURE_CASES = [
    f"{m}-{f}" for m in ("ring", "all_to_all")
    for f in ("alibi-causal", "alibi", "window", "key-mask", "key-mask-causal-gqa")
]
MODEL_CASES = [
    f"{m}-{f}" for m in ("ring", "all_to_all")
    for f in ("decoder-rope-gqa", "decoder-learned", "decoder-alibi", "encoder-learned-pad",
              "encoder-alibi")
]
ERROR_CASES = ["too-short", "all-to-all-heads", "dense-mask", "dropout", "no-cache",
               "uneven-shards", "all-to-all-uneven", "other-sizes"]
ALL = [c[0] for c in KERNEL_CASES] + FEATURE_CASES + MODEL_CASES + ERROR_CASES


def cases_for(world: int) -> list[str]:
    """The cases that apply on ``world`` ranks: all-to-all needs H (4 in the fixed cases)
    divisible by the world size."""
    heads = {c[0]: c[3] for c in KERNEL_CASES}
    keep = []
    for name in ALL:
        if name.startswith("all_to_all") and heads.get(name, 4) % world:
            continue
        keep.append(name)
    return keep


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def kernel_case(name, method, B, H, Hkv, T, D, causal, dtype):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=dt) for h in (H, Hkv, Hkv))
    dout = torch.randn(B, H, T, D, generator=g, dtype=dt)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = qkv.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=H != Hkv)
    ref.backward(dout)
    local = [shard_sequence(t, 2).requires_grad_() for t in (q, k, v)]
    out = METHODS[method](*local, is_causal=causal, enable_gqa=H != Hkv)
    out.backward(shard_sequence(dout, 2))
    res = {"out": _err(gather_sequence(out, 2), ref)}
    for n, loc, f in zip("qkv", local, full, strict=True):
        res[f"d{n}"] = _err(gather_sequence(loc.grad, 2), f.grad)
    return res


def feature_case(name):
    method, feature = name.split("-", 1)
    g = torch.Generator().manual_seed(7)
    B, H, T, D = 2, 4, 23, 8
    Hkv = 2 if feature.endswith("gqa") else H
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    dout = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    kw = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=H != Hkv,
              need_weights=False)
    if feature.startswith("alibi"):
        kw["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        kw["is_causal"] = feature == "alibi-causal"
    elif feature == "window":
        kw.update(is_causal=True, window=5)
    else:
        keep = torch.rand(B, T, generator=g) > 0.3
        keep[:, 0] = True
        kw["attn_mask"] = keep[:, None, None, :]  # (B, 1, 1, S)
        kw["is_causal"] = "causal" in feature
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = qkv.attention.sdpa.run_call(make_call(*full, **kw))
    ref.backward(dout)
    local = [shard_sequence(t, 2).requires_grad_() for t in (q, k, v)]
    if kw["attn_mask"] is not None:
        kw["attn_mask"] = shard_sequence(kw["attn_mask"], 3)
    out, _ = CALLS[method](make_call(*local, **kw))
    out.backward(shard_sequence(dout, 2))
    res = {"out": _err(gather_sequence(out, 2), ref)}
    for n, loc, f in zip("qkv", local, full, strict=True):
        res[f"d{n}"] = _err(gather_sequence(loc.grad, 2), f.grad)
    return res


def _model(feature):
    torch.manual_seed(3)
    if feature.startswith("decoder"):
        pos = feature.split("-")[1]
        cfg = DecoderLMConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4,
                              num_kv_heads=2 if "gqa" in feature else None, max_len=64,
                              positions=pos, norm_kind="rmsnorm" if pos == "rope" else
                              "layernorm")
        return DecoderLM(cfg).double()
    pos = feature.split("-")[1]
    cfg = EncoderConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4, max_len=64,
                        dropout=0.0, positions=pos, pad_id=0 if "pad" in feature else None,
                        norm="pre")
    return Encoder(cfg).double()


def model_case(name, rank, size):
    method, feature = name.split("-", 1)
    model = _model(feature)
    g = torch.Generator().manual_seed(11)
    B, T = 2, 31
    ids = torch.randint(1, 50, (B, T), generator=g)
    if "pad" in feature:
        ids[1, 20:] = 0  # padding at the end of row 1: a key mask crossing ranks
    out_ref = model(ids)
    w = torch.randn(out_ref.shape, generator=g, dtype=out_ref.dtype)
    (out_ref * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with context_parallel(model, method=method) as cp:
        out = model(cp.shard(ids))
        (out * cp.shard(w)).sum().backward()
        full = cp.gather(out.detach())
    res = {"out": _err(full, out_ref)}
    worst = 0.0
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)  # each rank holds its positions' share of the gradient
        worst = max(worst, _err(p.grad, ref_grads[n]))
    res["param_grads"] = worst
    return res


def error_case(name, rank, size):
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    try:
        if name == "too-short":
            ring_attention(q[:, :, :1], q[:, :, :1], q[:, :, :1])
        elif name == "all-to-all-heads":
            all_to_all_attention(q[:, :3], q[:, :3], q[:, :3])
        elif name == "dense-mask":
            ring_call(make_call(q, q, q, torch.ones(2, 2, dtype=torch.bool), 0.0, False, None,
                                False, False))
        elif name == "dropout":
            ring_call(make_call(q, q, q, None, 0.5, False, None, False, False))
        elif name in ("uneven-shards", "all-to-all-uneven"):  # 4 positions on rank 0, 3 after
            x = torch.randn(1, 4, 4 if rank == 0 else 3, 8, dtype=torch.float64)
            fn = ring_attention if name == "uneven-shards" else all_to_all_attention
            fn(x, x, x)
        elif name == "other-sizes":  # rank 0's heads are 8 wide, the others' 16
            x = torch.randn(1, 4, 4, 8 if rank == 0 else 16, dtype=torch.float64)
            ring_attention(x, x, x)
        elif name == "no-cache":
            model = _model("decoder-learned")
            with context_parallel(model):
                model(torch.ones(1, 8, dtype=torch.long), cache=model.new_cache())
    except (ValueError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def run(rank: int, size: int, port: int, out: str, only: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    results = {}
    for case in KERNEL_CASES:
        if case[0] in only:
            results[case[0]] = kernel_case(*case)
    for name in FEATURE_CASES:
        if name in only:
            results[name] = feature_case(name)
    for name in MODEL_CASES:
        if name in only:
            results[name] = model_case(name, rank, size)
    for name in ERROR_CASES:
        if name in only:
            results[name] = error_case(name, rank, size)
    if rank == 0:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, out)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None)
    a = p.parse_args(argv)
    only = cases_for(a.world) if a.only is None else a.only.split(",")
    mp.spawn(run, args=(a.world, free_port(), a.out, only), nprocs=a.world)


if __name__ == "__main__":
    sys.exit(main())
