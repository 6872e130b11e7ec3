"""The ready mods (qkv.attention.mods, score_mods) against qkv's existing path for the same thing
(is_causal, window=, alibi_slopes=, dense bool and float masks), torch's flex_attention and its
block masks, and a dense autograd reference for captured tensors (T5 table, ALiBi slopes)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import qkv
from helpers import max_error
from qkv.attention import mods
from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.flex.blocks import and_masks, create_block_mask, tile_keep

B, H, HKV, D, BLOCK = 2, 4, 2, 8, 16  # GQA: two query heads per key/value head
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
GEN = torch.Generator().manual_seed(0)
IDS = torch.sort(torch.randint(0, 5, (B, 45), generator=GEN), dim=1).values  # (B, T) packed docs
SHARED_IDS = torch.sort(torch.randint(0, 4, (45,), generator=GEN)).values  # (T,)
KEEP = torch.rand(B, 53, generator=GEN) > 0.3  # (B, S): real keys anywhere
KEEP[:, 0] = True  # every row sees a key
SLOPES = torch.rand(H, generator=GEN).float()  # float32: qkv's alibi_slopes= path rounds to it
TABLE = torch.randn(16, H, generator=GEN, dtype=torch.float64)  # (num_buckets, H)


def loop_mask(T, S, rule):
    """Dense keep ``(B, 1, T, S)`` from a per-entry rule, by explicit loops."""
    return torch.tensor([[[rule(b, i, j) for j in range(S)] for i in range(T)]
                         for b in range(B)], dtype=torch.bool)[:, None]


def t5_bias(T, S, bidirectional):
    """Float mask ``(1, H, T, S)`` as Hugging Face's T5 builds it: table[bucket].permute."""
    rel = torch.arange(S)[None, :] - torch.arange(T)[:, None]  # (T, S): memory - query
    bucket = mods.relative_position_bucket(rel, 16, 40, bidirectional)
    return TABLE[bucket].permute(2, 0, 1)[None]  # (1, H, T, S)


def capped_reference(q, k, v, cap, keep):
    """Scores materialised and capped as Gemma-2 writes it, masked, softmaxed."""
    G = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(G, 1).transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    s = (cap * torch.tanh(s / cap)).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(G, 1)  # (B, H, T, D)


# name: (T, S, mask_mod, score_mod, keyword arguments of qkv's existing path, or a reference)
CASES = {
    "causal": (37, 53, mods.causal_mask, None, dict(is_causal=True)),
    "window": (37, 53, mods.sliding_window_mask(7), None, dict(is_causal=True, window=7)),
    "window-bottom-right": (37, 53, mods.sliding_window_mask(7, offset=16), None,
                            dict(is_causal="bottom-right", window=7)),
    "prefix": (45, 45, mods.prefix_lm(11), None,
               dict(attn_mask=loop_mask(45, 45, lambda b, i, j: j < 11 or j <= i))),
    "prefix-per-row": (45, 45, mods.prefix_lm(torch.tensor([0, 20])), None,
                       dict(attn_mask=loop_mask(45, 45, lambda b, i, j: j < (0, 20)[b] or j <= i))),
    "document-causal": (45, 45, and_masks(mods.causal_mask, mods.document_mask(IDS)), None,
                        dict(attn_mask=loop_mask(45, 45, lambda b, i, j: bool(
                            IDS[b, i] == IDS[b, j]) and j <= i))),
    "document-shared": (45, 45, mods.document_mask(SHARED_IDS), None,
                        dict(attn_mask=loop_mask(45, 45, lambda b, i, j: bool(
                            SHARED_IDS[i] == SHARED_IDS[j])))),
    "dilated": (37, 53, mods.dilated(3), None,
                dict(attn_mask=loop_mask(37, 53, lambda b, i, j: j <= i and (i - j) % 3 == 0))),
    "padding": (37, 53, mods.padding_mask(torch.tensor([53, 20])), None,
                dict(attn_mask=qkv.masks.padding(torch.tensor([53, 20]), 53))),
    "padding-keep": (37, 53, mods.padding_mask(KEEP), None, dict(attn_mask=KEEP[:, None, None])),
    "alibi-causal": (37, 53, mods.causal_mask, mods.alibi(SLOPES), dict(is_causal=True,
                                                                        alibi_slopes=SLOPES)),
    "alibi": (37, 53, None, mods.alibi(SLOPES, offset=16), dict(alibi_slopes=SLOPES)),
    "alibi-bottom-right": (37, 53, mods.sliding_window_mask(53, offset=16),
                           mods.alibi(SLOPES, offset=16),
                           dict(is_causal="bottom-right", alibi_slopes=SLOPES)),
    "t5": (37, 53, None, mods.relative_bias(TABLE, 16, 40), dict(attn_mask=t5_bias(37, 53, True))),
    "t5-causal": (45, 45, mods.causal_mask, mods.relative_bias(TABLE, 16, 40, bidirectional=False),
                  dict(is_causal=True, attn_mask=t5_bias(45, 45, False))),
    "soft-cap": (37, 53, mods.causal_mask, mods.soft_cap(2.5), "capped"),
}


def _inputs(T, S, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(B, H, T, D, generator=g, dtype=torch.float64)  # large: caps matter
    k, v = (torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_mod_equals_qkvs_existing_path(case, dtype):
    T, S, mask_mod, score_mod, ref = CASES[case]
    q, k, v = _inputs(T, S, dtype)
    bm = None if mask_mod is None else create_block_mask(mask_mod, B, H, T, S, BLOCK_SIZE=BLOCK)
    got = qkv.flex_attention(q, k, v, score_mod, bm, enable_gqa=True)
    if ref == "capped":
        keep = torch.ones(T, S, dtype=torch.bool).tril()
        want = capped_reference(q, k, v, 2.5, keep)
    else:
        ref = {n: (m.to(dtype) if n == "attn_mask" and m.is_floating_point() else m)
               for n, m in ref.items()}
        want = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="math", **ref)
    tol = TOL[dtype]
    err = max_error(got, want)
    assert err <= tol, f"{case} out: max error {err:.3e}"
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    wants = torch.autograd.grad(want, (q, k, v), dout)
    for name, a, b in zip("qkv", grads, wants, strict=True):
        err = max_error(a, b)
        assert err <= tol, f"{case} d{name}: max error {err:.3e}"


@pytest.mark.parametrize("case", CASES)
def test_mod_equals_torch_flex_attention_and_block_mask(case):
    T, S, mask_mod, score_mod, _ = CASES[case]
    q, k, v = (t.detach() for t in _inputs(T, S, torch.float64, seed=3))
    ours = theirs = None
    if mask_mod is not None:
        ours = create_block_mask(mask_mod, B, H, T, S, BLOCK_SIZE=BLOCK)
        theirs = torch_flex.create_block_mask(mask_mod, B, H, T, S, device="cpu",
                                              BLOCK_SIZE=BLOCK)
        nq, nk = ours.state.shape[2:]
        assert torch.equal(ours.to_dense(), theirs.to_dense()[..., :nq, :nk].bool()), case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that eager flex is slow
        want = torch_flex.flex_attention(q, k, v, score_mod, theirs, enable_gqa=True)
    got = qkv.flex_attention(q, k, v, score_mod, ours, enable_gqa=True)
    err = max_error(got, want)
    assert err <= 1e-10, f"{case}: max error {err:.3e} against torch's flex_attention"


def dense_reference(q, k, v, score_mod, mask_mod):
    """Scores materialised with the same mods on full index grids; softmax; matmul."""
    T, S = q.shape[2], k.shape[2]
    G = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(G, 1).transpose(-2, -1) / math.sqrt(D)  # (B, H, T, S)
    idx = (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
           torch.arange(T).view(1, 1, T, 1), torch.arange(S).view(1, 1, 1, S))
    s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx), float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(G, 1)  # (B, H, T, D)


@pytest.mark.parametrize(("captured", "mask"), [("table", None), ("table", "causal"),
                                                ("slopes", "causal")])
def test_captured_table_and_slopes_get_the_dense_gradient(captured, mask):
    T, S = (37, 53) if mask is None else (45, 45)
    q, k, v = _inputs(T, S, torch.float64, seed=4)
    if captured == "table":
        param = TABLE.clone().requires_grad_()
        score_mod = mods.relative_bias(param, 16, 40, bidirectional=mask is None)
    else:
        param = SLOPES.double().requires_grad_()
        score_mod = mods.alibi(param)
    mask_mod = None if mask is None else mods.causal_mask
    bm = None if mask is None else create_block_mask(mask_mod, None, None, T, S, BLOCK_SIZE=BLOCK)
    got = qkv.flex_attention(q, k, v, score_mod, bm, enable_gqa=True)
    want = dense_reference(q, k, v, score_mod, mask_mod)
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(5), dtype=got.dtype)
    grads = torch.autograd.grad(got, (q, k, v, param), dout)
    wants = torch.autograd.grad(want, (q, k, v, param), dout)
    assert max_error(got, want) <= 1e-10, f"out: max error {max_error(got, want):.3e}"
    for name, a, b in zip(("q", "k", "v", captured), grads, wants, strict=True):
        assert max_error(a, b) <= 1e-10, f"d{name}: max error {max_error(a, b):.3e}"
    if captured == "table":  # exactly the buckets the (T, S) grid reaches get a gradient
        rel = torch.arange(S)[None, :] - torch.arange(T)[:, None]  # (T, S)
        used = torch.zeros(16, dtype=torch.bool)
        used[mods.relative_position_bucket(rel, 16, 40, mask is None)] = True
        assert torch.equal((grads[3] != 0).all(dim=1), used), "table rows with a gradient"
        assert not bool((grads[3][~used] != 0).any())
    else:
        assert bool((grads[3] != 0).all()), "every slope gets a gradient"


def test_relative_position_bucket_follows_t5():
    # T5's defaults (32 buckets, max distance 128), worked by hand from the definition:
    # keys before the query (rel < 0) take buckets 0..15, after it 16..31; 8 exact buckets,
    # then 8 + floor(log(n / 8) / log(16) * 8), the last bucket from n = 128 on.
    rel = torch.tensor([0, -1, 1, -7, -8, -12, -16, -32, -64, -127, -128, -500, 16, 128])
    want = [0, 1, 17, 7, 8, 9, 10, 12, 14, 15, 15, 15, 26, 31]
    assert mods.relative_position_bucket(rel).tolist() == want
    causal = mods.relative_position_bucket(rel, bidirectional=False).tolist()
    # Causal: 32 buckets for keys at or before the query, 16 exact, then
    # 16 + floor(log(n / 16) / log(8) * 16); keys after the query share bucket 0.
    assert causal == [0, 1, 0, 7, 8, 12, 16, 21, 26, 31, 31, 31, 0, 0]


def test_relative_position_bucket_equals_hugging_face_t5():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5",
                             reason="the parity extra: pip install 'qkv[parity]'")
    rel = torch.arange(-700, 701)
    for buckets, distance, bidirectional in [(32, 128, True), (32, 128, False), (8, 20, True),
                                             (33, 50, True), (6, 7, True), (2, 2, False)]:
        want = t5.T5Attention._relative_position_bucket(
            rel, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance)
        got = mods.relative_position_bucket(rel, buckets, distance, bidirectional)
        bad = int((got != want).sum())
        assert bad == 0, f"{bad} buckets differ for {(buckets, distance, bidirectional)}"


def _keep(mask_mod, T, S, batch=B):
    return tile_keep(mask_mod, batch, 1, range(T), range(S))  # (B, 1, T, S)


def test_special_cases_are_causal():
    causal = _keep(mods.causal_mask, 37, 53)
    for name, mod in [("dilated(1)", mods.dilated(1)), ("prefix_lm(0)", mods.prefix_lm(0)),
                      ("window 53", mods.sliding_window_mask(53)),
                      ("prefix rows 0", mods.prefix_lm(torch.zeros(B, dtype=torch.long)))]:
        assert torch.equal(_keep(mod, 37, 53), causal), name
    assert torch.equal(_keep(mods.sliding_window_mask(1), 37, 53)[0, 0],
                       torch.eye(37, 53, dtype=torch.bool))
    # Every query of a prefix of 11 sees the same 11 keys and nothing else.
    assert bool(_keep(mods.prefix_lm(11), 11, 53)[..., :11].all())
    assert not bool(_keep(mods.prefix_lm(11), 11, 53)[..., 11:].any())


def test_modules_export_the_mods():
    for name in mods.__all__:
        assert getattr(qkv.masks, name) is getattr(mods, name), name
    assert qkv.attention.score_mods.alibi is mods.alibi
    assert torch.equal(qkv.masks.sliding_window(3, window=2), torch.tensor(
        [[True, False, False], [True, True, False], [False, True, True]]))  # the dense builder


def test_bad_arguments_are_named():
    cases = [
        (lambda: mods.sliding_window_mask(0), AttentionArgumentError, "window must be an int >= 1"),
        (lambda: mods.sliding_window_mask(True), AttentionArgumentError, "window"),
        (lambda: mods.sliding_window_mask(4, offset=1.5), AttentionTypeError, "offset"),
        (lambda: mods.dilated(0), AttentionArgumentError, "dilation must be an int >= 1, got 0"),
        (lambda: mods.dilated(2.0), AttentionArgumentError, "dilation"),
        (lambda: mods.prefix_lm(-1), AttentionArgumentError, "prefix_length"),
        (lambda: mods.prefix_lm(torch.tensor([3, -1])), AttentionArgumentError, "prefix_length"),
        (lambda: mods.prefix_lm(torch.tensor([[3]])), AttentionArgumentError, r"\(B,\)"),
        (lambda: mods.prefix_lm(torch.tensor([1.5])), AttentionTypeError, "integer tensor"),
        (lambda: mods.document_mask(torch.zeros(4)), AttentionTypeError, "document_ids"),
        (lambda: mods.document_mask(torch.zeros(1, 2, 3, dtype=torch.long)),
         AttentionArgumentError, r"\(1, 2, 3\)"),
        (lambda: mods.document_mask("abc"), AttentionTypeError, "document_ids"),
        (lambda: mods.padding_mask(torch.tensor([2, -1])), AttentionArgumentError, "lengths"),
        (lambda: mods.padding_mask(torch.ones(2, 3, 4, dtype=torch.bool)),
         AttentionArgumentError, r"\(B, S\)"),
        (lambda: mods.padding_mask(torch.ones(2)), AttentionTypeError, "lengths"),
        (lambda: mods.alibi(torch.tensor([1, 2])), AttentionTypeError, "slopes"),
        (lambda: mods.alibi(torch.ones(2, 2)), AttentionArgumentError, r"\(H,\)"),
        (lambda: mods.alibi(torch.tensor([1.0, math.nan])), AttentionArgumentError, "finite"),
        (lambda: mods.alibi(SLOPES, offset=None), AttentionTypeError, "offset"),
        (lambda: mods.soft_cap(0), AttentionArgumentError, "cap must be a finite number > 0"),
        (lambda: mods.soft_cap(math.inf), AttentionArgumentError, "cap"),
        (lambda: mods.soft_cap(True), AttentionArgumentError, "cap"),
        (lambda: mods.relative_bias(TABLE.T, 16, 40), AttentionArgumentError, "transpose"),
        (lambda: mods.relative_bias(TABLE, 16, 4), AttentionArgumentError,
         "max_distance must be an int > 4"),
        (lambda: mods.relative_bias(TABLE[:3], 3, 40), AttentionArgumentError, "num_buckets"),
        (lambda: mods.relative_bias(TABLE, 16, 40, bidirectional=1), AttentionTypeError,
         "bidirectional"),
        (lambda: mods.relative_bias(TABLE.long(), 16, 40), AttentionTypeError, "table"),
    ]
    for make, error, match in cases:
        with pytest.raises(error, match=match):
            make()


def test_mismatched_calls_are_named():
    per_row = mods.document_mask(IDS)  # (B, 45)
    with pytest.raises(AttentionArgumentError, match=r"B=2 rows .* B=1"):
        create_block_mask(per_row, None, None, 45, 45)
    with pytest.raises(AttentionArgumentError, match=r"45 positions .* query at position 49"):
        create_block_mask(per_row, B, None, 50, 45)
    with pytest.raises(AttentionArgumentError, match="key at position 52"):
        create_block_mask(mods.padding_mask(KEEP[:, :40]), B, None, 8, 53)
    with pytest.raises(AttentionArgumentError, match="create_block_mask"):
        create_block_mask(mods.prefix_lm(torch.tensor([1, 2, 3])), B, None, 8, 8)
    q = torch.randn(1, 3, 8, 4)
    with pytest.raises(AttentionArgumentError, match=r"4 heads .* H=3"):
        qkv.flex_attention(q, q, q, mods.alibi(SLOPES))
    with pytest.raises(AttentionArgumentError, match=r"4 heads .* H=3"):
        qkv.flex_attention(q, q, q, mods.relative_bias(TABLE, 16, 40))
