"""Triton's interpreter without its repeated language patching (the tests' harness only).

Under ``TRITON_INTERPRET=1`` a kernel launch patches ``triton.language`` (every builtin
wrapped to run in NumPy) and restores it when the grid is done. Each call of a ``@triton.jit``
helper *inside* the kernel patches it again, scanning the whole language with
``inspect.getmembers`` (~1 ms), and never restores that second scope: with the helpers qkv's
kernels call per tile it was 30% of an interpreted test's time (cProfile: 70,000 scans in a
50 s flex test). While a launch's patch is in force, a helper whose modules that launch already
patched needs nothing more, so here it gets nothing more: the same patched functions run, the
kernels compute what they computed (every interpreted test compares them with a float64
reference). A helper that sees a language module the launch did not is patched as before.
"""

from __future__ import annotations

import inspect


class _Kept:
    """The scope a skipped patch returns: nothing to restore."""

    def restore(self) -> None:
        pass


def install() -> None:
    """Wrap ``triton.runtime.interpreter._patch_lang`` (idempotent)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "_qkv_kept", False):
        return
    patched: set[int] = set()  # ids of the language modules the running launch patched
    seen_in: dict[tuple[int, int], frozenset[int]] = {}  # (globals, their count) -> modules

    def langs(fn) -> frozenset[int]:
        key = (id(fn.__globals__), len(fn.__globals__))
        if key not in seen_in:
            seen_in[key] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and v in (tl, tl.core))
        return seen_in[key]

    def patch_lang(fn):
        seen = langs(fn)
        if patched and seen <= patched:  # a helper inside a launch whose patch holds
            return _Kept()
        scope = original(fn)
        if patched:  # a helper that sees another module: patched as Triton does
            return scope
        patched.update(seen)  # a launch: until its grid is done
        restore = scope.restore

        def done() -> None:
            patched.clear()
            restore()

        scope.restore = done
        return scope

    patch_lang._qkv_kept = True
    interpreter._patch_lang = patch_lang
