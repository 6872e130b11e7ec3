"""Decoding with a static cache and a compiled step (``generate(..., compile=True)``).

:class:`StaticDecoderSession` is a :class:`~qkv.generate.session.DecoderSession` whose cache is
a :class:`~qkv.nn.static_cache.StaticKVCache` sized for the prompt plus every new token. The
prompt runs eagerly once; each later step feeds one token per row through
``torch.compile(model, fullgraph=True)``: the step's shapes never change (the slot and the
position are tensors updated in place), so the model compiles once per batch size and cache
length bucket (``BUCKET`` slots: another prompt length in the same bucket reuses it), and a
step makes no host synchronisation and no allocation outside the graph.

On a GPU the compiled step is also replayed from a CUDA graph (``torch.compile``'s
``mode="reduce-overhead"``, as gpt-fast and transformers' static cache do): one token's step
launches a kernel or more per layer, each costing the host microseconds that a small batch's
kernels do not hide, and a replayed graph launches them all at once. The graph writes the new
keys into the cache in place, so the cache's buffers must keep their addresses: the session
takes a cache kept with the model for its batch size and capacity (zeroed for each session;
:data:`POOL` shapes kept, the oldest dropped), marked as static for the compiler. Inputs that
change from session to session (the encoder's memory, the cross-attention keys and values
its first step projects, the slot) are copied into the graph's own buffers at each replay.
Each step returns a copy of its logits, never the graph's own buffer, which the next replay
overwrites. :data:`CUDA_GRAPHS` turns the graphs off (for comparison).

Compilation needs a C++ compiler (inductor's CPU code); where it fails, the session warns once,
says why, and decodes eagerly, with the same tokens; a later compiled step that fails (a CUDA
graph's recording, say) does the same, and is run again eagerly (it rewrites the same slots).
``compile_seconds`` reports the time of the first compiled step (tracing plus code
generation), apart from decoding.
"""

from __future__ import annotations

import inspect
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.threads import fitted
from qkv.generate.session import (
    DecoderSession,
    EncodedInputs,
    Inputs,
    MemorySession,
    Seq2SeqSession,
    is_seq2seq,
    make_session,
)
from qkv.generate.structure import structure
from qkv.nn.static_cache import StaticKVCache

__all__ = ["BUCKET", "CUDA_GRAPHS", "POOL", "SOURCE_BUCKET", "StaticDecoderSession",
           "StaticMemorySession", "StaticSeq2SeqSession", "compiled_method", "compiled_step",
           "open_session", "release_caches", "uses_cuda_graphs"]

BUCKET = 256  # cache capacities are multiples of this: one compiled graph per bucket
SOURCE_BUCKET = 64  # encoder-decoders: sources padded to a multiple of this
CUDA_GRAPHS = True  # compiled steps on a GPU replayed from CUDA graphs (False: compiled only)
POOL = 2  # static caches kept with a model for CUDA graphs (their shapes)


def uses_cuda_graphs(device: torch.device) -> bool:
    """Whether a compiled step on ``device`` replays a CUDA graph: on CUDA, while
    :data:`CUDA_GRAPHS` is set."""
    return CUDA_GRAPHS and device.type == "cuda"


def compiled_step(model: nn.Module, *, cuda_graphs: bool = False) -> Any:
    """``torch.compile(model, fullgraph=True, dynamic=False)``, made once per model (held in a
    plain attribute, not a submodule, so ``state_dict`` and ``repr`` do not change); with
    ``cuda_graphs``, ``mode="reduce-overhead"`` (kept apart from the plain one)."""
    key = "_qkv_compiled_step_graphs" if cuda_graphs else "_qkv_compiled_step"
    return _compiled_once(model, key, model, "reduce-overhead" if cuda_graphs else None)


def compiled_method(model: nn.Module, name: str, *, cuda_graphs: bool = False) -> Any:
    """``torch.compile(getattr(model, name), fullgraph=True, dynamic=False)``, made once per
    model and method (kept out of the module's attributes, as :func:`compiled_step`); with
    ``cuda_graphs``, ``mode="reduce-overhead"``."""
    key = f"_qkv_compiled_{name}{'_graphs' if cuda_graphs else ''}"
    return _compiled_once(model, key, getattr(model, name),
                          "reduce-overhead" if cuda_graphs else None)  # fmt: skip


def _compiled_once(model: nn.Module, key: str, fn: Any, mode: str | None = None) -> Any:
    """The compiled ``fn`` kept with ``model`` under ``key``, compiled afresh when the model's
    :func:`~qkv.generate.structure.structure` changed since. On a CPU, torch's per-call
    guards on the model's modules are dropped (that check is the fingerprint's, once per
    session) and one-row matmuls run as reductions (:mod:`qkv.generate.gemv_pass`)."""
    shape = structure(model)
    kept = model.__dict__.get(key)
    if kept is not None and kept[0] == shape:
        return kept[1]
    from qkv.generate.gemv_pass import compile_options  # (imports inductor: on first use)

    weight = next(model.parameters(), None)
    device = weight.device if weight is not None else torch.device("cpu")
    options = None
    if mode is None and device.type == "cpu":
        options = {**(compile_options(device) or {}),
                   "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    step = torch.compile(fn, fullgraph=True, dynamic=False, mode=mode, options=options)
    # (torch.compile marks a module it wraps: the fingerprint is taken after it did)
    object.__setattr__(model, key, (structure(model), step))
    return step


def _session_cache(model: nn.Module, owner: Any, shape: tuple,
                   make: Callable[[], StaticKVCache]) -> StaticKVCache:  # fmt: skip
    """A static cache for ``owner`` (a session): ``make()``, or where the session's steps
    replay CUDA graphs (``owner.cuda_graphs``) one kept with
    ``model`` for ``shape`` (batch size, capacity) and its weights' dtype and device, zeroed,
    its buffers marked static for the compiler, and held by ``owner`` while it lives: a graph
    recorded on it replays for every later session of the same shape. A cache still held by
    a live session is not shared; the session gets one of its own."""
    if not owner.cuda_graphs:
        return make()
    pool: dict = model.__dict__.setdefault("_qkv_static_caches", {})
    weight = next(model.parameters())  # a model moved or cast since gets caches of its own
    shape = (*shape, weight.dtype, weight.device)
    kept, held = pool.pop(shape, (None, lambda: None))
    if held() is not None:  # in use by a live session: it stays kept, this one is its own
        pool[shape] = (kept, held)
        return _marked(make())
    # (a cache made under inference mode cannot be written outside it, nor the other way)
    usable = kept is not None and kept[0].k.is_inference() == torch.is_inference_mode_enabled()
    cache = kept if usable else _marked(make())
    if usable:
        cache.reset()
    pool[shape] = (cache, weakref.ref(owner))  # the newest last
    while len(pool) > POOL:
        pool.pop(next(iter(pool)))
    return cache


def release_caches(model: nn.Module) -> int:
    """Drop the static caches kept with ``model`` for CUDA graphs (their memory returns once
    no live session holds them; the next compiled session makes a new one, and its graph
    records again). Returns how many were kept."""
    return len(model.__dict__.pop("_qkv_static_caches", {}))


def _marked(cache: StaticKVCache) -> StaticKVCache:
    cache.mark_static()
    return cache


def _bucketed(n: int, size: int = BUCKET) -> int:
    """``n`` rounded up to a multiple of ``size``: every length in a bucket shares one graph."""
    return -(-n // size) * size


class _CompiledSteps:
    """What the static sessions share: a step that runs compiled (timing its first call as
    ``compile_seconds``) or eagerly, falls back to eager with one warning when compiling
    fails, and refuses beam search (a static cache has a fixed batch)."""

    compiled: bool
    compile_seconds: float | None

    def _init_steps(self, compile: bool, device: torch.device, eager: Any,
                    make_compiled: Any) -> None:  # fmt: skip
        """Steps through ``make_compiled(cuda_graphs)`` with ``compile``, else ``eager``;
        CUDA graphs where :func:`uses_cuda_graphs` says so for ``device``."""
        self.compiled, self.compile_seconds = bool(compile), None
        self.cuda_graphs = self.compiled and uses_cuda_graphs(device)
        self._eager = eager
        self.step_fn = make_compiled(self.cuda_graphs) if compile else eager

    def _step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One step through the compiled function; where it fails, a warning and the step
        again eagerly (a step writes its slots before reading them, so running it twice
        changes nothing), and every later step eagerly. The logits are a copy: a CUDA graph's
        output buffer is overwritten by its next replay."""
        if not self.compiled:
            return self.step_fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are done
            out = self.step_fn(*args, **kwargs)
            out = out.clone() if self.cuda_graphs else out
        except Exception as err:  # inductor: no C++ compiler, an unsupported platform
            first = self.compile_seconds is None
            warnings.warn(
                f"torch.compile could not {'compile' if first else 'run'} the decoding step "
                f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
                f"{'; it needs a working C++ compiler (g++ or clang)' if first else ''}. "
                "Decoding eagerly instead (same tokens).",
                RuntimeWarning, stacklevel=4,
            )
            self.compiled = self.cuda_graphs = False
            self.step_fn = self._eager
            return self.step_fn(*args, **kwargs)
        if self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - start
        return out

    def select(self, rows: Tensor) -> None:
        """Beam search reorders rows; a static cache has a fixed batch.

        Raises:
            ValueError: always (use ``compile=False`` with beam search).
        """
        raise ValueError("compiled decoding (a static cache) does not support beam search; "
                         "use compile=False with beam_size")  # fmt: skip


class StaticDecoderSession(_CompiledSteps, DecoderSession):
    """A :class:`DecoderSession` on a static cache, with its steps compiled (``compile``) or
    eager.

    Args:
        model: a :class:`qkv.models.DecoderLM` (``new_cache(static=True)``).
        prompts, max_new_tokens: as :class:`DecoderSession`.
        compile: run the steps after the prompt through ``torch.compile``.

    Attributes:
        compile_seconds: seconds the first compiled step took (None until it ran, or eager).
        compiled: whether steps run compiled (False after a failed compile).
        cuda_graphs: whether compiled steps replay a CUDA graph (on a GPU, see
            :func:`uses_cuda_graphs`); the cache is then one kept with the model.

    Raises:
        ValueError: as :class:`DecoderSession`, and a model whose cache cannot be static.
    """

    def __init__(self, model: nn.Module, prompts: Inputs, max_new_tokens: int, *,
                 compile: bool = True) -> None:  # fmt: skip
        super().__init__(model, prompts, max_new_tokens)
        P = self.ids.shape[1]
        # Capacity rounded up to a multiple of BUCKET: prompts of other lengths reuse the
        # compiled step (unwritten slots are masked, so the extra room changes nothing).
        L = _bucketed(P + max_new_tokens)
        self._init_steps(compile, self.ids.device, model,
                         lambda graphs: compiled_step(model, cuda_graphs=graphs))
        self.cache = _session_cache(model, self, (self.batch, L),
                                    lambda: model.new_cache(self.batch, L, static=True))
        self.capacity = L
        if self.mask is not None:
            full = torch.zeros((self.batch, L), dtype=torch.bool, device=self.ids.device)
            full[:, :P] = self.mask  # (B, L): later slots are real tokens once written
            full[:, P:] = True
            self.mask = full
        self.slot = torch.full((1,), P, dtype=torch.long, device=self.ids.device)  # (1,)
        self.written = P  # slots filled, known on the host (no read of ``slot``)

    @fitted
    def first(self) -> Tensor:
        """Run the prompts (eagerly); returns ``(B, V)`` logits of the first new token."""
        P = self.ids.shape[1]
        self.cache.set_slots(torch.arange(P, device=self.ids.device))
        positions = None if self.mask is None else self.positions
        logits = self.model(self.ids, attention_mask=self.mask, cache=self.cache,
                            positions=positions)  # (B, P, V)  # fmt: skip
        self.next_pos = self.positions[:, -1:] + 1  # (B, 1)
        self.cache.set_slots(self.slot)
        return logits[:, -1].float()  # (B, V)

    @fitted
    def next(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens (B,)`` at the next slot; returns ``(B, V)`` logits."""
        if self.written >= self.capacity:
            raise ValueError(f"the static cache is full ({self.capacity} slots)")
        positions = self.slot if self.mask is None else self.next_pos
        logits = self._step(tokens[:, None], attention_mask=self.mask, cache=self.cache,
                            positions=positions)  # (B, 1, V)  # fmt: skip
        self.slot.add_(1)
        self.next_pos.add_(1)
        self.written += 1
        return logits[:, -1].float()  # (B, V)


class StaticSeq2SeqSession(_CompiledSteps, Seq2SeqSession):
    """A :class:`~qkv.generate.session.Seq2SeqSession` on a static cache, its steps after the
    first compiled (``compile``) or eager.

    The sources are padded to a multiple of :data:`SOURCE_BUCKET` tokens (padding is masked,
    so the memory's real rows are unchanged) and the target capacity rounds up to
    :data:`BUCKET`: one compiled graph serves every batch of the same size whose sources and
    outputs fall in the same buckets. The first step (BOS) runs eagerly and stores each
    layer's cross-attention keys and values in the cache; the compiled steps reuse them.

    Attributes:
        compile_seconds, compiled, cuda_graphs: as :class:`StaticDecoderSession`.

    Raises:
        ValueError: as :class:`Seq2SeqSession`, and a model whose cache cannot be static.
    """

    def __init__(self, model: nn.Module, sources: Inputs, max_new_tokens: int, pad_id: int,
                 bos_id: Any, *, compile: bool = True) -> None:  # fmt: skip
        super().__init__(model, sources, max_new_tokens, pad_id, bos_id)
        B, S, E = self.memory.shape
        S_pad = _bucketed(S, SOURCE_BUCKET)
        if S_pad != S:  # pad the memory and its mask: the padded keys are never seen
            pad = self.memory.new_zeros(B, S_pad - S, E)
            self.memory = torch.cat([self.memory, pad], dim=1)  # (B, S_pad, E)
            hidden = torch.zeros(B, 1, 1, S_pad - S, dtype=torch.bool,
                                 device=self.src_mask.device)  # fmt: skip
            self.src_mask = torch.cat([self.src_mask, hidden], dim=-1)  # (B, 1, 1, S_pad)
        self.capacity, self.written = _bucketed(max_new_tokens + 1), 0
        self._init_steps(compile, self.memory.device, model.decode,
                         lambda graphs: compiled_method(model, "decode", cuda_graphs=graphs))
        self.cache = _session_cache(
            model, self, ("seq2seq", self.batch, self.capacity),
            lambda: model.new_cache(self.capacity, static=True, batch_size=self.batch))
        self.slot = torch.zeros(1, dtype=torch.long, device=self.memory.device)  # (1,)
        self.cache.set_slots(self.slot)

    @fitted
    def next(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens (B,)`` at the next slot; returns ``(B, V)`` logits."""
        if self.written >= self.capacity:
            raise ValueError(f"the static cache is full ({self.capacity} slots)")
        # BOS runs eagerly: it stores the cross-attention keys and values.
        step = self.model.decode if self.written == 0 else self._step
        logits = step(tokens[:, None], self.memory, self.src_mask, cache=self.cache)
        self.slot.add_(1)
        self.written += 1
        return logits[:, -1].float()  # (B, V)


class StaticMemorySession(_CompiledSteps, MemorySession):
    """A :class:`~qkv.generate.session.MemorySession` (decoding from encoded inputs with a
    forced prompt, e.g. Whisper) on a static cache, its steps after the prompt compiled.

    The prompt runs eagerly at slots ``0..P-1`` and stores each layer's cross-attention keys
    and values; later steps write one slot each through ``torch.compile``. The capacity
    rounds up to :data:`BUCKET`; the memory's shape (``(B, 1500, E)`` for a 30 s window) is
    part of the graph.

    Attributes:
        compile_seconds, compiled, cuda_graphs: as :class:`StaticDecoderSession`.
    """

    def __init__(self, model: nn.Module, inputs: EncodedInputs, max_new_tokens: int, *,
                 compile: bool = True) -> None:  # fmt: skip
        super().__init__(model, inputs, max_new_tokens)
        P = self.prompts.shape[1]
        self.capacity, self.written = _bucketed(P + max_new_tokens), 0
        self._init_steps(compile, self.prompts.device, model.decode,
                         lambda graphs: compiled_method(model, "decode", cuda_graphs=graphs))
        self.cache = _session_cache(
            model, self, ("memory", self.batch, self.capacity),
            lambda: model.new_cache(self.capacity, static=True, batch_size=self.batch))
        self.slot = torch.full((1,), P, dtype=torch.long, device=self.prompts.device)  # (1,)

    def _logits(self, tokens: Tensor) -> Tensor:
        T = tokens.shape[1]
        if self.written + T > self.capacity:
            raise ValueError(f"the static cache is full ({self.capacity} slots)")
        if self.written == 0:  # the prompt, eagerly: stores the cross-attention keys/values
            self.cache.set_slots(torch.arange(T, device=tokens.device))
            out = self.model.decode(tokens, self.memory, self.memory_mask, cache=self.cache)
            self.cache.set_slots(self.slot)
        else:
            out = self._step(tokens, self.memory, self.memory_mask, cache=self.cache)
            self.slot.add_(1)
        self.written += T
        logits = out[:, -1].float()  # (B, V)
        logits[:, self.suppress] = float("-inf")
        return logits


def open_session(model: nn.Module, inputs: Inputs | EncodedInputs, max_new_tokens: int, *,
                 pad_id: int | None, bos_id: int | None, compile: bool = False) -> Any:  # fmt: skip
    """:func:`qkv.generate.session.make_session`, or with ``compile`` a
    :class:`StaticDecoderSession` (decoder-only models) or :class:`StaticSeq2SeqSession`
    (encoder-decoders with ``new_cache(static=True)``, e.g. Marian and BART) or
    :class:`StaticMemorySession` (encoded inputs with a forced prompt, e.g. Whisper).

    Raises:
        ValueError: ``compile`` not a bool, or True for a model without a static cache; as
            the sessions.
    """
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r:.80}")
    if not compile:
        return make_session(model, inputs, max_new_tokens, pad_id=pad_id, bos_id=bos_id)
    if isinstance(inputs, EncodedInputs) or is_seq2seq(model):
        if "static" not in inspect.signature(model.new_cache).parameters:
            raise ValueError(f"compile=True needs a static cache; {type(model).__name__}."
                             "new_cache has none: use compile=False")  # fmt: skip
        if isinstance(inputs, EncodedInputs):
            return StaticMemorySession(model, inputs, max_new_tokens)
        return StaticSeq2SeqSession(model, inputs, max_new_tokens, pad_id, bos_id)
    return StaticDecoderSession(model, inputs, max_new_tokens)
