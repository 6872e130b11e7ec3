"""Shared cases for the hostile-input tests: every mask part written out from its definition
(independently of ``qkv.attention.masks``) and the NumPy float64 reference on them."""

from __future__ import annotations

import numpy as np
import torch

import qkv
from helpers import DEVICE, backend_names
from qkv import reference

BACKENDS = backend_names()  # "auto" and every registered backend


def slopes_for(H: int) -> torch.Tensor:
    return 2.0 ** -torch.arange(1, H + 1, dtype=torch.float64)  # (H,)


def mask_case(kind: str, H: int, T: int, S: int, seed: int = 0):
    """``(sdpa kwargs, additive float64 mask (1, H, T, S), visible (T, S) bool)`` written out
    from the definitions, independently of ``qkv.attention.masks``."""
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    add = np.zeros((1, H, T, S))
    hide = np.zeros((T, S), dtype=bool)
    kw: dict = {}
    if kind == "causal":
        kw, hide = dict(is_causal=True), j > i
    elif kind == "bottom-right":  # T > S: the first rows see no key
        kw, hide = dict(is_causal="bottom-right"), j > i + S - T
    elif kind == "window":
        kw, hide = dict(is_causal=True, window=2), (j > i) | (j <= i - 2)
    elif kind == "alibi":
        slopes = slopes_for(H)
        kw, hide = dict(is_causal="bottom-right", alibi_slopes=slopes), j > i + S - T
        add = add - slopes.cpu().numpy()[None, :, None, None] * np.abs(i + S - T - j)
    elif kind in ("bool", "float"):
        hide[:3, 2] = True  # key 2 hidden from the first three queries
        hide[5, :] = True  # query 5 sees no key
        if kind == "bool":
            kw = dict(attn_mask=torch.from_numpy(~hide).to(DEVICE))
        else:
            rng = np.random.default_rng(seed)
            finite = rng.normal(size=(T, S)) * 0.5
            user = np.where(hide, -np.inf, finite)
            kw, add = dict(attn_mask=torch.from_numpy(user).to(DEVICE)), add + finite
    elif kind != "none":
        raise AssertionError(kind)
    return kw, np.where(hide, -np.inf, add), ~hide


def ref_attention(q, k, v, add):
    """``(out, weights)`` of the NumPy float64 reference, ``add`` an additive mask or None."""
    return reference.attention(
        q.double().cpu().numpy(), k.double().cpu().numpy(), v.double().cpu().numpy(), mask=add
    )


def run(backend, q, k, v, kw, need_weights):
    res = qkv.scaled_dot_product_attention(
        q, k, v, enable_gqa=q.shape[1] != k.shape[1], need_weights=need_weights,
        backend=backend, **kw,
    )
    return res if need_weights else (res, None)
