"""Compile the triton backend's kernels for NVIDIA GPUs without one: Triton's front end and
LLVM down to PTX (and ptxas to a cubin where Triton ships it), for Hopper (sm_90) and Ampere
(sm_80). The interpreter that runs the kernels on CPU never compiles them, so an error only a
compiler sees (a value that has no IR type, a shape that does not lower) would otherwise first
show on a GPU. Run as a script (tests/attention/test_triton.py runs it without
TRITON_INTERPRET); prints one line per variant and exits non-zero on the first failure.
"""

from __future__ import annotations

import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qkv.attention.triton import backward as KB
from qkv.attention.triton import kernels as K

FLAGS = ("MASK_KIND", "IS_CAUSAL", "HAS_WINDOW", "HAS_ALIBI", "DROPOUT")
POINTERS = {"KEEP": "*u8", "SLOPES": "*fp32", "L": "*fp32", "LSE": "*fp32",
            "DELTA": "*fp32"}
FLOATS = {"scale", "keep_scale", "cap"}


TENSORS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV_"}  # in the inputs' dtype
CONSTEXPRS = {"BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV", "PRECISION", "UPCAST", "EVEN_D",
              *FLAGS}
INTS = {"H", "G", "T", "S", "D", "DV", "split_len", "causal", "window", "alibi_shift"}


def _signature(fn, dtype: str, mask_kind: int, dropout: int = 0) -> dict[str, str]:
    """Triton's type of each argument: pointers, 32-bit sizes, 64-bit strides, floats."""
    sig = {}
    for name in fn.arg_names:
        if name in CONSTEXPRS:
            sig[name] = "constexpr"
        elif name == "M":
            sig[name] = {0: dtype, 1: "*u8", 2: "*fp32"}[mask_kind]
        elif name == "KEEP":  # a keep mask, or the Philox state (seed, threshold)
            sig[name] = "*i64" if dropout == 2 else "*u8"
        elif name in TENSORS:
            sig[name] = dtype
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name in INTS:
            sig[name] = "i32"
        else:
            sig[name] = "fp32" if name in FLOATS else "i64"
    return sig


def variants():
    """(kernel, dtype, flags, tiles): every flag on and off across a few variants, each on
    the tiles, warps and stages qkv launches it with on a GPU (``triton.plan.tiles``, D = 128,
    T = 4096): 64 × 64 float32 tiles, which qkv never launches, took 67 of the check's 142 s."""
    import torch

    from qkv.attention.triton import plan as triton_plan

    # DROPOUT 2 (the Philox mask computed in the kernel) with every flag on, 1 (a keep mask
    # read by tile) in float32.
    combos = [(0, 0, 0, 0, 0), (1, 1, 1, 1, 2), (2, 1, 0, 1, 0), (0, 1, 0, 0, 1)]
    kernels = (K.attention_forward, KB.attention_backward_dq, KB.attention_backward_dkdv)
    dtypes = {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp32": torch.float32}
    for fn, (dtype, flags) in itertools.product(
        kernels, [("*bf16", combos[0]), ("*bf16", combos[1]), ("*fp16", combos[2]),
                  ("*fp32", combos[3])]
    ):
        kind = "forward" if fn is K.attention_forward else "backward"
        extras = flags[0] > 0 or flags[3] > 0 or flags[4] > 0  # a mask, ALiBi or dropout
        tiles = triton_plan.tiles(kind, 4096, 128, dtypes[dtype], extras=extras,
                                  dropout=flags[4] > 0)
        yield fn, dtype, dict(zip(FLAGS, flags, strict=True)), tiles


def _merge(target) -> str:
    """Compile the split merge (float32 partials into bfloat16); its label."""
    sig = {"O_PART": "*fp32", "L_PART": "*fp32", "O": "*bf16", "L": "*fp32", "n": "i32",
           "rows": "i32", "DV": "i32", "BLOCK_R": "constexpr", "BLOCK_DV": "constexpr",
           "BLOCK_S": "constexpr"}
    src = ASTSource(K.merge_splits, sig, dict(BLOCK_R=4, BLOCK_DV=128, BLOCK_S=16))
    triton.compile(src, target=target, options=dict(num_warps=4))
    return f"sm_{target.arch} merge_splits bf16"


def _flex_calls():
    """``(label, call)``: flex forward and backward on the GPU's tiles, bf16, D = 128: a
    document mask (full blocks only), causal with ALiBi, soft-cap and T5's relative bias,
    and learned ALiBi slopes and tables (partial blocks, a score mod in the kernel)."""
    import torch

    import qkv
    from qkv.attention.flex import triton_path as flex_triton
    from qkv.attention.score_mods import alibi, relative_bias, soft_cap
    from qkv.attention.triton import launch as L

    T, D = 1024, 128
    doc = torch.arange(T) // 256
    masks = {"document": (lambda b, h, i, j: doc[i] == doc[j], None),
             "causal alibi": (lambda b, h, i, j: j <= i, alibi(torch.ones(4))),
             "causal softcap": (lambda b, h, i, j: j <= i, soft_cap(30.0)),
             "causal relative": (lambda b, h, i, j: j <= i,
                                 relative_bias(torch.zeros(32, 4), 32, 128, False)),
             "causal learned relative": (lambda b, h, i, j: j <= i, relative_bias(
                 torch.zeros(32, 4, requires_grad=True), 32, 128, False)),
             "causal learned alibi": (lambda b, h, i, j: j <= i,
                                      alibi(torch.ones(4, requires_grad=True))),
             "document dropout": (lambda b, h, i, j: doc[i] == doc[j], None)}
    for label, (mask_mod, score_mod) in masks.items():
        learned = "learned" in label
        # dropout: the Philox state (seed, threshold), the mask computed in the kernels
        drop = torch.tensor([1234, round(0.1 * 2**16)]) if "dropout" in label else None

        def call(mask_mod=mask_mod, score_mod=score_mod, learned=learned, drop=drop):
            bm = qkv.create_block_mask(mask_mod, None, None, T, T)
            q, k, v = (torch.empty(1, 4, T, D, dtype=torch.bfloat16) for _ in range(3))
            tab, mod = flex_triton.tables(bm, q.device), flex_triton.score_mod_params(
                score_mod, q, T)
            out, lse = L.flex_forward(q, k, v, tab, bm, D ** -0.5, mod, drop, 0.1)
            L.flex_backward(q, k, v, out, lse, torch.empty_like(out), None, tab, bm,
                            D ** -0.5, mod, grad_mod=learned, drop=drop, dropout_p=0.1)
        yield label, call


def _dense_calls():
    """``(label, call)``: the dense forward and backward (T = S = 4096, plain, causal, and
    causal with dropout's Philox mask computed in the kernels), a
    decoding step (one query, H = 32 over Hkv = 8, S = 32768) and a paged decoding step (8
    sequences of 4096 positions in pages of 16) as qkv launches them, bf16, D = 128."""
    import torch

    from qkv.attention.backends.triton_kernel import _Spec
    from qkv.attention.triton import launch as L

    def dense(causal, dropout_p=0.0):
        q, k, v = (torch.empty(1, 4, 4096, 128, dtype=torch.bfloat16) for _ in range(3))
        spec = _Spec(128 ** -0.5, 0 if causal else None, None, 0, dropout_p)
        keep = torch.tensor([1234, round(dropout_p * 2**16)]) if dropout_p else None  # Philox
        out, lse = L.forward(q, k, v, None, None, keep, spec)
        L.backward(q, k, v, out, lse, torch.empty_like(out), None, None, None, keep, spec)

    def decode():
        q = torch.empty(4, 32, 1, 128, dtype=torch.bfloat16)
        k, v = (torch.empty(4, 8, 32768, 128, dtype=torch.bfloat16) for _ in range(2))
        L.forward(q, k, v, None, None, None, _Spec(128 ** -0.5, None, None, 0, 0.0))

    def paged():  # a decoding step over pages of 16: 8 sequences, 4096 positions each
        from qkv.nn.paged_cache import PagedKVCache

        cache = PagedKVCache(1, num_blocks=8 * 256, block_size=16, kv_heads=8, head_dim=128,
                             dtype=torch.bfloat16, kernel="chunks")
        tables = torch.arange(8 * 256).reshape(8, 256)
        positions = torch.full((8, 1), 4095)
        q = torch.empty(8, 32, 1, 128, dtype=torch.bfloat16)
        layer = cache.layers[0]
        L.paged_forward(q, layer.k_pool, layer.v_pool, tables, positions, 128 ** -0.5)

    return [("dense", lambda: dense(False)), ("causal", lambda: dense(True)),
            ("dropout", lambda: dense(True, 0.1)), ("decode", decode), ("paged", paged)]


# Kernels with no loop over tiles (nothing to pipeline): the split merge, the backward's δ.
LOOPLESS = {"merge_splits", "row_deltas"}


def _bad(c) -> bool:
    """A launch that spills (more than 256 bytes a thread; any, without a loop) or whose
    loop over tiles does not pipeline its loads."""
    if c.kernel in LOOPLESS:
        return c.spill_bytes > 0
    return c.spill_bytes > 256 or not c.pipelined


def _launched() -> list[str]:
    """Compile the dense and decoding launches for Hopper as qkv makes them: every kernel
    pipelines its loads and spills at most 256 bytes a thread; the decoding step's split
    kernel spills nothing and leaves room for the programs its key splits count on."""
    import torch

    from qkv.attention.triton import plan as triton_plan
    from qkv.bench.triton_static import compiled_launches

    labels = []
    for label, call in _dense_calls():
        for c in compiled_launches(call, arch=90):
            line = (f"sm_90 {label} {c.kernel} grid {c.grid}: {c.registers} registers, "
                    f"{c.spill_bytes} bytes spilled, {c.programs_per_sm()} programs a "
                    f"multiprocessor, pipelined {c.pipelined}")
            bad = _bad(c)
            if label in ("decode", "paged") and c.kernel not in LOOPLESS:
                t = triton_plan.tiles("forward" if label == "decode" else label, 4, 128,
                                      torch.bfloat16)
                bad = bad or c.spill_bytes > 0 or c.programs_per_sm() < t.resident
            if bad:
                raise AssertionError(line)
            labels.append(line)
    return labels


def _flex() -> list[str]:
    """Compile the three block-sparse flex kernels as qkv launches them on an H100/H200
    (Triton's own JIT and argument specialisation, a stand-in driver); each must pipeline its
    loads and spill at most 256 bytes a thread (128 × 128 tiles spilled 1 KiB in dK/dV).
    Their labels; raises on the first that does not."""
    from qkv.bench.triton_static import compiled_launches

    labels = []
    for label, call in _flex_calls():
        for c in compiled_launches(call, arch=90):
            line = (f"sm_90 flex {c.kernel} {label}: {c.registers} registers, "
                    f"{c.spill_bytes} bytes spilled, pipelined {c.pipelined}")
            if _bad(c):
                raise AssertionError(line)
            labels.append(line)
    return labels


def _fast() -> list[str]:
    """qkv's kept launches (:mod:`qkv.attention.triton.fast`) against Triton's own: for the
    merge kernel with aligned and unaligned pointers and integers equal to 1, divisible by 16
    and past 32 bits, the launch a kept kernel makes must be the one Triton's binding makes
    (the same compiled kernel, the same arguments to its launcher); and the specialisation
    key must split values as Triton's does (stand-in sm_90 driver: nothing runs)."""
    import torch

    from qkv.attention.triton import fast as triton_fast
    from qkv.bench.triton_static import launches_recorded

    calls = []  # (a compiled kernel's launcher records, with no GPU to load it on)
    labels = []
    with launches_recorded(90, lambda compiled, args: calls.append((compiled, args))):
        o = torch.empty(3 * 64 * 64 + 8)
        options = dict(BLOCK_R=4, BLOCK_DV=64, BLOCK_S=16, num_warps=4, num_stages=3)
        cases = [("aligned", 0, 2, 64, 64), ("offset pointer", 1, 2, 64, 64),
                 ("n=1", 0, 1, 64, 64), ("rows=17", 0, 2, 17, 64), ("dv=1", 0, 2, 64, 1),
                 ("rows past 32 bits", 0, 2, 2**31 + 16, 64), ("rows=16", 0, 2, 16, 16)]
        for label, shift, n, rows, dv in cases:
            part = o[shift:]
            args = (part, part, part, part, n, rows, dv)
            K.merge_splits[(1,)](*args, **options)  # Triton's own binding and lookup
            want = calls[-1]
            triton_fast.launch(K.merge_splits, (1,), args, options)  # kept (or found)
            triton_fast.launch(K.merge_splits, (1,), args, options)  # the kept launch
            got = calls[-1]
            same = got[0] is want[0] and got[1][:6] == want[1][:6] and got[1][9:] == want[1][9:]
            if not same:
                raise AssertionError(f"{label}: the kept launch (kernel {got[0].hash[:10]}) "
                                     f"is not Triton's (kernel {want[0].hash[:10]})")
            labels.append(f"fast {label}: {want[0].hash[:10]}")
    return labels + _fast_keys()


def _fast_keys() -> list[str]:
    """The specialisation key splits values exactly as Triton's own specialisation does."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from qkv.attention.triton import fast as triton_fast

    base = torch.empty(64, dtype=torch.bfloat16)
    values = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31, 2**31 + 16, -(2**31),
              -(2**31) - 16, 2**40, 2**63, 2**63 + 16, 0.5, 1.0, True, False, None, base,
              base[1:], base[8:], base.float(), base.float()[1:], base.half()]
    theirs = [native_specialize_impl(CUDABackend, v, False, True, True) for v in values]
    ours = [triton_fast.specialisation((v,)) for v in values]
    for i, j in itertools.combinations(range(len(values)), 2):
        if (ours[i] == ours[j]) != (theirs[i] == theirs[j]):
            raise AssertionError(f"{values[i]!r:.40} and {values[j]!r:.40}: Triton "
                                 f"{theirs[i]} / {theirs[j]}, qkv {ours[i]} / {ours[j]}")
    return [f"fast keys of {len(values)} values split as Triton's"]


def _ptx_only(*args):
    """Triton's stage hook: the flag variants compile down to PTX and skip ptxas (40 of the
    check's 120 s on a cold cache). ptxas still assembles every kernel qkv launches, in
    ``--launched`` and ``--flex``, where its register and spill counts are checked. Called
    with no arguments, the hook names itself in the cache key, so a PTX-only entry is never
    taken for a whole compile."""
    if not args:
        return "qkv-compile-check-ptx-only", "ptx-only"
    _backend, stages, _options, _language, _capability = args
    stages["cubin"] = lambda src, metadata: b""


def main() -> int:
    if "--flex" in sys.argv or "--launched" in sys.argv or "--fast" in sys.argv:
        checks = {"--flex": _flex, "--launched": _launched, "--fast": _fast}
        try:
            for label in checks[sys.argv[1]]():
                print(f"ok {label}")
        except Exception as e:
            print(f"FAILED {sys.argv[1]}: {type(e).__name__}: {e}")
            return 1
        return 0
    hopper, ampere = GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)
    triton.knobs.runtime.add_stages_inspection_hook = _ptx_only
    every = list(variants())
    # Hopper: each kernel with every flag on, and float32; Ampere: every flag on. Every flag
    # off in bfloat16 is the plain dense launch, which --launched compiles through ptxas.
    chosen_hopper = [v for n, v in enumerate(every) if n % 4 in (1, 3)]
    for target, chosen in ((hopper, chosen_hopper), (ampere, every[1::4])):
        for fn, dtype, flags, tiles in chosen:
            constexprs = dict(flags, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                              BLOCK_D=128, BLOCK_DV=128,
                              PRECISION="ieee" if dtype == "*fp32" else "tf32", UPCAST=False,
                              EVEN_D=flags["MASK_KIND"] != 2)
            constexprs["IS_CAUSAL"] = bool(constexprs["IS_CAUSAL"])
            for f in ("HAS_WINDOW", "HAS_ALIBI"):
                constexprs[f] = bool(constexprs[f])
            sig = _signature(fn, dtype, flags["MASK_KIND"], flags["DROPOUT"])
            src = ASTSource(fn, sig, constexprs)
            label = f"sm_{target.arch} {fn.__name__} {dtype[1:]} {flags}"
            try:
                triton.compile(src, target=target, options=dict(num_warps=tiles.warps,
                                                                num_stages=tiles.stages))
            except Exception as e:
                print(f"FAILED {label}: {type(e).__name__}: {e}")
                return 1
            print(f"ok {label}")
    try:
        print(f"ok {_merge(hopper)}")
    except Exception as e:
        print(f"FAILED merge_splits: {type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
