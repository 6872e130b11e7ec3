"""The cases of the GPU benchmark suite (:mod:`qkv.bench.gpu` runs them): per case its
shapes and, built on the device, its inputs, the implementations compared (each a function of
``(q, k, v)``, or the reason it is not run) and a float64 reference.

Shapes ``q (B, H, T, D)``, ``k``/``v`` ``(B, Hkv, S, D)``, bfloat16; the groups are listed
in :mod:`qkv.bench.gpu`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import qkv
from qkv.bench.measure import available_memory_bytes

__all__ = ["SkipError", "cases"]

_SDPA = qkv.scaled_dot_product_attention


class SkipError(Exception):
    """An implementation or case that is not run, with the reason."""


def _fits(nbytes: int, dev: torch.device) -> None:
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else available_memory_bytes()
    if nbytes > 0.4 * free:
        raise SkipError(f"dense mask needs {nbytes / 2**30:.1f} GiB, over 40% of free memory")


def _qkv(dev, sh, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    return tuple(torch.randn(sh["B"], h, n, sh["D"], generator=g, device=dev,
                             dtype=torch.bfloat16)
                 for h, n in ((sh["H"], sh["T"]), (sh["Hkv"], sh["S"]), (sh["Hkv"], sh["S"])))


def _math(q, k, v, **kw):  # the float64 reference
    return _SDPA(q.double(), k.double(), v.double(), backend="math", **kw)


def _pinned(kind):
    """Maker of torch SDPA pinned to ``SDPBackend.<kind>`` (its refusal is recorded)."""
    def make(dev, sh, kw):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run(q, k, v):
            with sdpa_kernel(getattr(SDPBackend, kind)):
                return F.scaled_dot_product_attention(q, k, v, is_causal=kw["is_causal"],
                                                      dropout_p=kw.get("dropout_p", 0.0))
        return run
    return make


def _compiled_flex(dev, mask_mod, T, S, score_mod=None):
    """``torch.compile(flex_attention)`` with torch's block mask of ``mask_mod`` (or None)
    and ``score_mod``."""
    if dev.type != "cuda":
        raise SkipError("torch.compile(flex_attention) is only benchmarked on CUDA")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # each case compiles afresh: no recompile limit, no stale guards
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, T, S, device=dev)
    fn = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: fn(q, k, v, score_mod=score_mod, block_mask=bm)


def _torch_dense(dev, sh, kw):
    """torch SDPA given the mask of qkv keywords ``kw`` (causal, window, ALiBi) materialised:
    a ``(1, H, T, S)`` bfloat16 bias with ALiBi, else a ``(T, S)`` bool mask."""
    T, slopes = sh["T"], kw.get("alibi_slopes")
    _fits(T * T * (1 if slopes is None else 6 * sh["H"]), dev)  # ALiBi: built in float32
    i, j = torch.arange(T, device=dev)[:, None], torch.arange(T, device=dev)[None, :]
    keep = (j <= i) if kw.get("is_causal") else torch.ones(T, T, dtype=torch.bool, device=dev)
    if kw.get("window") is not None:
        keep &= i - j < kw["window"]
    if slopes is not None:
        bias = -slopes[:, None, None] * (i - j).abs().float()  # (H, T, S)
        keep = bias.masked_fill(~keep, float("-inf")).to(torch.bfloat16)[None]  # (1, H, T, S)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _guard(make, *args):
    try:
        return make(*args)
    except SkipError as e:
        return str(e)


def _standard(kw, extra):
    """A case's ``build(dev, shapes)``: triton and auto with qkv keywords ``kw`` (or
    ``kw(dev, shapes)``), plus torch's implementations made by ``extra[name](dev, sh, kw)``."""
    def build(dev, sh):
        q, k, v = _qkv(dev, sh)
        kws = kw(dev, sh) if callable(kw) else kw
        impls = {b: (lambda q, k, v, b=b: _SDPA(q, k, v, backend=b, **kws))
                 for b in ("triton", "auto")}
        impls |= {name: _guard(make, dev, sh, kws) for name, make in extra.items()}
        return (q, k, v), impls, lambda: _math(q, k, v, **kws)
    return build


def _document(dev, sh, docs=8):
    (q, k, v), T = _qkv(dev, sh), sh["T"]
    doc = torch.arange(T, device=dev) // -(-T // docs)  # (T,) document of each position

    def mod(b, h, i, j):
        return doc[i] == doc[j]
    bm = qkv.create_block_mask(mod, None, None, T, T, device=dev)
    impls = {"qkv_flex": lambda q, k, v: qkv.flex_attention(q, k, v, block_mask=bm),
             "torch_flex_compiled": _guard(_compiled_flex, dev, mod, T, T),
             "triton": _guard(lambda: _fits(T * T, dev) or (  # mask (T, S) built after the check
                 lambda q, k, v, m=doc[:, None] == doc[None, :]: _SDPA(
                     q, k, v, attn_mask=m, backend="triton")))}
    return (q, k, v), impls, lambda: _math(q, k, v, attn_mask=doc[:, None] == doc[None, :])


def _causal(b, h, i, j):
    return j <= i


def _causal_flex(dev, sh, score_mod, reference_mod):
    """Causal flex with ``score_mod``: qkv's flex and compiled flex; the reference is the
    tile loop in float64 with ``reference_mod`` (the same mod, its data in float64)."""
    (q, k, v), T = _qkv(dev, sh), sh["T"]
    bm = qkv.create_block_mask(_causal, None, None, T, T, device=dev)
    impls = {"qkv_flex": lambda q, k, v: qkv.flex_attention(q, k, v, score_mod, bm),
             "torch_flex_compiled": _guard(_compiled_flex, dev, _causal, T, T, score_mod)}
    return (q, k, v), impls, lambda: qkv.flex_attention(
        q.double(), k.double(), v.double(), reference_mod, bm,
        kernel_options={"backend": "tiles"})


def _relative(dev, sh):
    """Causal attention with T5's relative bias, its table learned (32 buckets, distances to
    128): qkv's flex on Triton (the gradient from its dQ kernel) and compiled flex."""
    from qkv.attention.score_mods import relative_bias

    table = (0.1 * torch.randn(32, sh["H"], device=dev)).requires_grad_()
    return _causal_flex(dev, sh, relative_bias(table, 32, 128, bidirectional=False),
                        relative_bias(table.double(), 32, 128, False))


def _python_mod(dev, sh):
    """Causal attention with a Python score_mod qkv's kernels cannot run (a head bias on the
    past keys): qkv's flex (on a GPU through torch's compiled kernels) and compiled flex
    called directly, so the ratio is qkv's own cost around the same kernel."""
    bias = torch.linspace(-1.0, 1.0, sh["H"], device=dev)

    def biased(score, b, h, i, j):
        return score + bias[h] * (j < i)
    return _causal_flex(dev, sh, biased, biased)


def _paged(dev, sh, page=16):
    """A paged decoding step (write the new key and value, attend): the Triton kernel reading
    pages in place, the chunked gather, and torch's SDPA on the same cache unpaged."""
    from qkv.nn.paged_cache import PagedKVCache

    (q, k, v), (B, Hkv, S, D) = _qkv(dev, sh), (sh["B"], sh["Hkv"], sh["S"], sh["D"])

    def pages(t):  # (pages, Hkv, page, D): sequence b's pages in order
        return t.reshape(B, Hkv, S // page, page, D).transpose(1, 2).reshape(
            B * S // page, Hkv, page, D)
    tables = torch.arange(B * S // page).reshape(B, S // page).tolist()
    new = (k[:, :, -1:], v[:, :, -1:])  # the step writes what is there: the cache unchanged

    def paged(kernel):
        cache = PagedKVCache(1, num_blocks=B * S // page, block_size=page, kv_heads=Hkv,
                             head_dim=D, dtype=q.dtype, device=dev, kernel=kernel)
        layer = cache.layers[0]
        layer.k_pool, layer.v_pool = pages(k), pages(v)
        cache.set_batch(tables, [S - 1] * B)
        return lambda q, k, v: layer.attend(q, *new, scale=None)
    impls = {"triton": paged("triton"), "chunks": paged("chunks"),
             "torch_sdpa_unpaged": lambda q, k, v: F.scaled_dot_product_attention(
                 q, k, v, enable_gqa=True)}
    return (q, k, v), impls, lambda: _math(q, k, v, enable_gqa=True)


def _weights(dev, sh, heads, n_rows):
    from qkv.attention.weights import attention_weights

    (q, k, v), T = _qkv(dev, sh), sh["T"]
    rows, flash = slice(T - n_rows, T), _pinned("FLASH_ATTENTION")(dev, sh, {"is_causal": True})

    def triton(q, k, v):
        _, lse = _SDPA(q, k, v, is_causal=True, backend="triton", return_lse=True)
        return attention_weights(q, k, lse, is_causal=True, heads=heads, rows=rows)

    def by_hand(q, k, v, dtype=torch.float32):  # weights (B, 2, n_rows, S)
        s = q[:, heads, rows].to(dtype) @ k[:, heads].to(dtype).transpose(-2, -1)
        hide = torch.arange(T, device=dev) > torch.arange(T, device=dev)[rows, None]
        return (s / math.sqrt(sh["D"])).masked_fill(hide, float("-inf")).softmax(-1)
    impls = {"triton": triton, "torch_flash_by_hand": lambda q, k, v: (
        flash(q, k, v), by_hand(q, k, v).to(q.dtype))[1]}  # output, then the slice by hand
    return (q, k, v), impls, lambda: by_hand(q, k, v, torch.float64)


def cases(quick: bool) -> list[dict]:
    """The suite: ``{name, group, shapes, bwd, build, base}`` per case; ``build(dev, shapes)``
    gives ``(inputs, {impl: fn(q, k, v) or skip reason}, float64 reference thunk)``."""
    B, H, D = (1, 2, 32) if quick else (4, 16, 128)
    out = []

    def add(name, group, build, bwd=False, base="triton", **shapes):
        sh = dict(B=B, H=H, Hkv=H, D=D) | shapes
        out.append(dict(name=name, group=group, shapes=sh, bwd=bwd, build=build, base=base))
    dense = {"torch_flash": _pinned("FLASH_ATTENTION"),
             "torch_efficient": _pinned("EFFICIENT_ATTENTION"),
             "torch_flex_compiled": lambda dev, sh, kw: _compiled_flex(
                 dev, (lambda b, h, i, j: i >= j) if kw["is_causal"] else None, sh["T"], sh["S"])}
    def dense_cases(lengths):
        for T in lengths:
            for c in (False, True):
                for bwd in (False, True):
                    impls = dense if T == 4096 or quick else {  # compiled flex: T=4096 only
                        k: f for k, f in dense.items() if k != "torch_flex_compiled"}
                    add(f"dense{' causal' if c else ''} T={T} {'fwd+bwd' if bwd else 'fwd'}",
                        "dense", _standard({"is_causal": c}, impls), bwd, T=T, S=T)
    dense_cases([64] if quick else [4096])  # the rest after the other groups (a budget cut)
    gqa = {"torch_sdpa": lambda dev, sh, kw: lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, enable_gqa=True)}
    for S in [64, 128] if quick else [4096, 32768]:
        add(f"decode S={S}", "decode", _standard({"enable_gqa": True}, gqa),
            H=2 if quick else 32, Hkv=1 if quick else 8, T=1, S=S)
    add(f"paged decode S={64 if quick else 4096}", "paged", _paged, H=2 if quick else 32,
        Hkv=1 if quick else 8, B=2 if quick else 8, T=1, S=64 if quick else 4096)
    T = 64 if quick else 4096
    alibi = _standard(lambda dev, sh: {"is_causal": True, "alibi_slopes": 2.0 ** (
        -8.0 * torch.arange(1, sh["H"] + 1, device=dev) / sh["H"])},  # (H,) Press et al.
        {"torch_dense_bias": _torch_dense})
    add(f"alibi causal T={T}", "alibi", alibi, T=T, S=T)
    # Dropout inside the kernels (qkv's Philox mask; torch's kernels draw their own).
    add(f"dropout 0.1 causal T={T} fwd+bwd", "dropout", _standard(
        {"is_causal": True, "dropout_p": 0.1},
        {k: dense[k] for k in ("torch_flash", "torch_efficient")}), True, T=T, S=T)
    w = 16 if quick else 1024
    for T in [64, 128] if quick else [4096, 16384]:
        add(f"window {w} causal T={T}", "window", _standard(
            {"is_causal": True, "window": w}, {"torch_dense_mask": _torch_dense}), T=T, S=T)
    T = 64 if quick else 16384
    for bwd in (False, True):
        add(f"document x8 T={T} {'fwd+bwd' if bwd else 'fwd'}", "document", _document, bwd,
            base="qkv_flex", B=1 if quick else 2, T=T, S=T)
    T = 64 if quick else 4096
    add(f"relative bias (T5, learned) causal T={T} fwd+bwd", "relative", _relative, True,
        base="qkv_flex", T=T, S=T)
    add(f"python score_mod causal T={T} fwd+bwd", "python-mod", _python_mod, True,
        base="qkv_flex", T=T, S=T)
    T, n, heads = (128, 16, [0, 1]) if quick else (16384, 64, [3, 11])
    add(f"weights 2 heads {n} rows T={T}", "weights",
        lambda dev, sh: _weights(dev, sh, heads, n), T=T, S=T)
    dense_cases([] if quick else [16384, 1024])
    return out
