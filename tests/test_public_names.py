"""One meaning per public name: no name is exported by two of qkv's public modules as two
different things, and ``qkv.masks`` exports what users build masks with, no kernel helper."""

from __future__ import annotations

import importlib
import inspect
import sys

PUBLIC = ["qkv", "qkv.masks", "qkv.nn", "qkv.models", "qkv.generate", "qkv.inspect", "qkv.data",
          "qkv.train", "qkv.pretrained", "qkv.checkpoint", "qkv.distributed", "qkv.attention",
          "qkv.reference"]
# kernel helpers that live in qkv.attention.masks and must not leak into the user's name
KERNEL = {"EXP_FLOOR", "accumulation_dtype", "alibi_bias", "apply_mask", "causal_shift",
          "check_attn_mask", "dead_rows", "dense_mask", "dropout_keep", "exp_floored_",
          "exp_shifted_", "mask_dtype", "mask_tile", "poison_rows", "safe_lse", "safe_row_max",
          "safe_total", "split_causal_bias", "structure_keep"}


def _describe(obj) -> str:
    where = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    try:
        return f"{where}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return where


def test_no_public_name_means_two_things():
    seen: dict[str, dict[str, object]] = {}
    for name in PUBLIC:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if not inspect.ismodule(obj):
                seen.setdefault(attr, {})[name] = obj
    clashes = {attr: {m: _describe(o) for m, o in where.items()}
               for attr, where in seen.items() if len({id(o) for o in where.values()}) > 1}
    assert not clashes, f"public names with two meanings: {clashes}"


def test_qkv_masks_exports_user_names_only():
    import qkv

    leaked = KERNEL & set(qkv.masks.__all__)
    assert not leaked, f"kernel helpers in qkv.masks: {sorted(leaked)}"
    for name in qkv.masks.__all__:
        assert callable(getattr(qkv.masks, name)), name
    kernel = importlib.import_module("qkv.attention.masks")
    assert KERNEL <= set(dir(kernel)), sorted(KERNEL - set(dir(kernel)))


def test_moved_modules_import_under_their_old_names_with_a_warning():
    """Issue 43 moved modules into sub-packages; every old name is the new module itself."""
    import warnings

    import qkv

    for old, new in qkv.MOVED_MODULES.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), (old, new)
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
                   for w in seen), (old, [str(w.message) for w in seen])
    import qkv.pretrained

    assert callable(qkv.pretrained.save_hf), "qkv.pretrained.save_hf is the function"
    assert qkv.serve.make_app is importlib.import_module("qkv.serve.app").make_app
