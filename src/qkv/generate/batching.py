"""Continuous batching over a paged KV cache: many requests decoded together, each joining the
running batch at the next step and leaving it the step it ends (Yu et al., 2022, "Orca";
Kwon et al., 2023, "vLLM").

One background thread runs the loop. Each turn it admits waiting requests, in order, while
the batch has room (``max_batch``) and the block pool has the blocks a request can ever need
(its prompt plus ``max_new_tokens``, reserved up front, so a running request never runs out: a
request that does not fit *waits*, it is not refused). A newcomer's prompt is prefilled alone
through the model, at most ``prefill_chunk`` positions a turn (chunked prefill: a long prompt
takes several turns, so the running requests keep getting tokens meanwhile); its last chunk
gives its first token. Then one decoding step runs for every running request at once: one
token each, at its own position, attending over its own pages
(:class:`~qkv.nn.paged_cache.PagedKVCache`). A request that ends (EOS, a stop id, its
``max_new_tokens``, or cancelled by its caller) gives its blocks back at once.

With ``prefix_cache`` (the default) the blocks go through a
:class:`~qkv.generate.prefix_cache.PrefixCache`: a prompt that starts with blocks another
request filled (a shared system prompt, the earlier turns of a chat) reads them instead of
computing them, and only the rest is prefilled.

Every request gets the tokens it would get alone: greedy rows equal
:func:`qkv.generate.greedy` on the request by itself, and a sampled request draws from its own
seeded generator. Each request's :class:`~qkv.generate.engine.SamplingParams` is applied to
its own row: its controls (repetition penalty, no-repeat n-grams, bad words, minimum length,
forced EOS) edit the row's logits from the row's own tokens (prompt + output), min-p filters
in its sampler, so rows with different controls in one batch each get what they would get
alone (:func:`qkv.generate.generate` with the same options); a row without controls keeps no
history and pays nothing for them. Decoder-only models whose attention the paged cache
expresses: rotary, learned or no positions; no ALiBi, relative biases, sliding windows or
soft-capping.

Shapes: ``B`` running requests, ``V`` vocabulary.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from qkv.generate.args import ParamError
from qkv.generate.controls import checked_controls
from qkv.generate.engine import (
    Request,
    SamplingParams,
    ShuttingDownError,
    TokenLogprob,
    check_prompt,  # fmt: skip
)
from qkv.generate.grammar import Constraint, GrammarVocabulary
from qkv.generate.prefix_cache import PrefixCache
from qkv.generate.sampling import Sampler
from qkv.nn.paged_cache import PagedKVCache

__all__ = ["BatchingEngine"]

IDLE_WAIT_S = 0.05  # how long the loop sleeps when nothing runs
PREFILL_CHUNK = 256  # prompt positions prefilled per turn, by default


@dataclass(eq=False)
class _Running:
    request: Request
    blocks: list[int]
    length: int = 0  # positions cached (while prefilling: the prompt's so far)
    last: int = -1  # the token to feed next
    chooser: object = field(default=None, repr=False)
    # (1, P + max_new_tokens): prompt then output, for the controls; None without them
    history: torch.Tensor | None = field(default=None, repr=False)
    constraint: Constraint | None = field(default=None, repr=False)  # its grammar's state


def _check_model(model: nn.Module) -> None:
    c = getattr(model, "config", None)
    if c is None or not hasattr(model, "new_cache") or hasattr(model, "encode"):
        raise ValueError(f"continuous batching serves decoder-only qkv models (DecoderLM), got "
                         f"{type(model).__name__}")  # fmt: skip
    windows = any(w is not None for w in getattr(c, "windows", ()))
    softcap = getattr(getattr(c, "attention", None), "softcap", None)
    if c.positions in ("alibi", "relative") or windows or softcap:
        raise ValueError(f"the paged cache does not express this model's attention (positions="
                         f"{c.positions!r}, sliding windows {windows}, soft-cap {softcap})")


class BatchingEngine:
    """Continuous batching for a decoder-only model (see the module docstring).

    Args:
        model: a :class:`~qkv.models.DecoderLM` (eval mode).
        eos_id: the id that ends a request (default: the config's).
        max_batch: the most requests decoded together.
        block_size: positions per cache block.
        num_blocks: blocks in the pool (default: ``max_batch`` sequences of 1024 positions).
        prefix_cache: share full prompt blocks between requests
            (:class:`~qkv.generate.prefix_cache.PrefixCache`).
        prefill_chunk: the most prompt positions prefilled per turn of the loop.
        tokenizer: the model's tokenizer (a :class:`~qkv.pretrained.tokenizer.
            PretrainedTokenizer`), for requests with a grammar (None: such requests are
            refused).

    Attributes:
        blocks: the :class:`~qkv.generate.prefix_cache.PrefixCache` every request's blocks
            come from (with ``prefix_cache=False`` it shares nothing).

    Raises:
        ValueError: a model the paged cache cannot serve, sizes that are not positive ints.
    """

    def __init__(self, model: nn.Module, *, eos_id: int | None = None, max_batch: int = 16,
                 block_size: int = 16, num_blocks: int | None = None, prefix_cache: bool = True,
                 prefill_chunk: int = PREFILL_CHUNK, tokenizer: object = None) -> None:  # fmt: skip
        _check_model(model)
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        c, weight = model.config, next(model.parameters())
        self.model, self.max_batch = model.eval(), max_batch
        self.eos_id = c.eos_id if eos_id is None else eos_id
        blocks = num_blocks if num_blocks is not None else max_batch * -(-1024 // block_size)
        self.cache = PagedKVCache(c.num_layers, num_blocks=blocks, block_size=block_size,
                                  kv_heads=c.num_kv_heads or c.num_heads, head_dim=c.head_dim,
                                  dtype=weight.dtype, device=weight.device)  # fmt: skip
        self.blocks = PrefixCache(self.cache, share=prefix_cache)
        self.prefill_chunk = prefill_chunk
        self.tokenizer = tokenizer
        self._vocabulary: GrammarVocabulary | None = None  # built at the first grammar
        # The context a request must fit: a learned position table, else the config's max_len.
        self.limit = getattr(model, "position_limit", None) or getattr(c, "max_len", None)
        self.waiting: deque[Request] = deque()
        self.running: list[_Running] = []
        self.prefilling: _Running | None = None  # the newcomer whose prompt is being read
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None  # where the loop runs
        self._spawned = False  # the loop's thread is the engine's own (start)
        self._stop_when: Callable[[], bool] | None = None
        self.steps = 0  # decoding steps run (for statistics)

    # --- the callers' side -------------------------------------------------------------------

    def start(self) -> BatchingEngine:
        """Start the loop in a background thread (once; nothing when :meth:`claim` gave it
        to a caller's thread); returns the engine."""
        with self._wake:
            if self._thread is None:
                self._thread, self._spawned = threading.Thread(
                    target=self._loop, name="qkv-engine", daemon=True), True
                self._thread.start()
        return self

    def claim(self) -> None:
        """Give the loop to the calling thread, which then calls :meth:`run`; :meth:`start`
        does nothing after this.

        Why: torch's CPU work runs on an OpenMP thread pool per calling thread, and with two
        pools on the machine (the thread that loaded the model, and the engine's) GNU
        OpenMP stops spinning between parallel regions, so every matmul of a decoding step
        waits for its worker to wake (measured: a 1x576 @ 576x1536 product 34 us on the
        loading thread, 145 us on a second one; a SmolLM2 step 47 against 87 ms). Running
        the loop on the thread that loaded the model keeps one pool.

        Raises:
            RuntimeError: the loop already runs elsewhere.
        """
        with self._wake:
            if self._thread is not None and self._thread is not threading.current_thread():
                raise RuntimeError("the engine's loop already runs in another thread")
            self._thread = threading.current_thread()

    def run(self, stop_when: Callable[[], bool] | None = None) -> None:
        """Run the loop in the calling thread (claimed first, if not already) until
        :meth:`shutdown` from another thread, or ``stop_when()`` turns true, and no request is
        left (``stop_when`` is asked while idle)."""
        self.claim()
        self._stop_when = stop_when
        self._loop()

    def submit(self, prompt: list[int], params: SamplingParams | None = None) -> Request:
        """Queue a request; its tokens come from ``request.tokens()``.

        Raises:
            ParamError: (a ``ValueError`` whose ``param`` names the option) a bad prompt,
                controls the model cannot meet (a bad word outside the vocabulary, forced EOS
                without an EOS id), a request longer than the model's context (its learned
                positions, else its ``max_len``) or than the whole block pool.
            ShuttingDownError: (a ``ValueError``) an engine shutting down.
        """
        params = params or SamplingParams()
        ids = check_prompt(prompt, self.model.config.vocab_size)
        checked_controls(params.controls, self.model.config.vocab_size, self.eos_id)
        n, total = params.max_new_tokens, len(ids) + params.max_new_tokens
        if self.limit is not None and total > self.limit:
            raise ParamError("max_new_tokens", f"={n} exceeds the model's {self.limit} "
                             "positions", f"a prompt of {len(ids)} tokens + ")  # fmt: skip
        if self.cache.blocks_for(total) > self.cache.num_blocks:
            raise ParamError("max_new_tokens", f"={n}) needs more than the whole block pool "
                             f"({self.cache.num_blocks} x {self.cache.block_size})",
                             f"a request of {total} positions (a prompt of {len(ids)} tokens + ")
        if params.grammar is not None:
            self._grammar_vocabulary()
        request = Request(ids, params)
        with self._wake:
            if self._stop:
                raise ShuttingDownError("the engine is shutting down; no new requests")
            self.waiting.append(request)
            self._wake.notify()
        return request

    def _grammar_vocabulary(self) -> GrammarVocabulary:
        """The tokenizer's tables for grammars, built once (ParamError without a tokenizer)."""
        if self.tokenizer is None:
            raise ParamError("grammar", " needs the engine to know the model's tokenizer "
                             "(BatchingEngine(..., tokenizer=...))")  # fmt: skip
        if self._vocabulary is None:
            self._vocabulary = GrammarVocabulary.of(self.tokenizer, self.eos_id,
                                                    self.model.config.vocab_size)  # fmt: skip
        return self._vocabulary

    def shutdown(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; let those in flight finish (``cancel``: end them now), then
        stop the loop."""
        with self._wake:
            self._stop = True
            if cancel:
                for r in [*self.waiting, *(run.request for run in self._runs())]:
                    r.cancel()
            self._wake.notify()
        if self._spawned and self._thread is not threading.current_thread():
            self._thread.join(timeout)  # (a claimed loop ends by itself once idle)

    # --- the loop ----------------------------------------------------------------------------

    def _runs(self) -> list[_Running]:
        """The requests holding blocks: running, and the one prefilling."""
        return [*self.running, *([self.prefilling] if self.prefilling is not None else [])]

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    if not self.waiting and not self._runs():
                        if self._stop or (self._stop_when is not None and self._stop_when()):
                            return
                        self._wake.wait(IDLE_WAIT_S)
                        continue
                try:
                    self._admit()
                    if self.running:
                        self._step()
                except Exception as err:  # a failed step ends the requests it held
                    for run in self.running:
                        run.request.finish("error", err)
                        self.blocks.release(run.blocks)
                    self.running = []

    def _admit(self) -> None:
        """Prefill newcomers, in order, up to :attr:`prefill_chunk` prompt positions."""
        budget = self.prefill_chunk
        while budget > 0:
            run = self.prefilling or self._next()
            if run is None:
                return
            try:
                budget -= self._prefill(run, budget)
            except Exception as err:  # the failed request ends; the others go on
                self.prefilling = None
                run.request.finish("error", err)
                self.blocks.release(run.blocks)

    def _next(self) -> _Running | None:
        """The next waiting request, its blocks taken (shared ones first), as the one
        prefilling; None when none waits, the batch is full or the pool is short."""
        while len(self.running) < self.max_batch:
            with self._wake:
                if not self.waiting:
                    return None
                request = self.waiting[0]
                if request.cancelled:
                    self.waiting.popleft().finish("cancelled")
                    continue
                need = self.cache.blocks_for(len(request.prompt) + request.params.max_new_tokens)
                got = self.blocks.acquire(request.prompt, need)
                if got is None:
                    return None  # waits for blocks to come back
                self.waiting.popleft()
            table, cached = got
            self.prefilling = run = _Running(request, table, length=cached)
            device = self.cache.layers[0].k_pool.device
            run.chooser, run.history = _chooser(request.params), _history(request, device)
            if request.params.grammar is not None:
                run.constraint = Constraint(self._grammar_vocabulary(), request.params.grammar)
            return run
        return None

    def _prefill(self, run: _Running, budget: int) -> int:
        """Read the next (at most ``budget``) prompt positions of ``run``; the last chunk
        chooses its first token. Returns the positions read."""
        prompt = run.request.prompt
        if run.request.cancelled:
            self.prefilling = None
            self._end(run, "cancelled")
            return 0
        start, end = run.length, min(len(prompt), run.length + budget)
        device = self.cache.layers[0].k_pool.device
        self.cache.set_batch([run.blocks], [start])
        ids = torch.tensor([prompt[start:end]], device=device)  # (1, T)
        positions = torch.arange(start, end, device=device)[None]  # (1, T)
        logits = self.model(ids, cache=self.cache, positions=positions)  # (1, T, V)
        run.length = end
        self.blocks.register(run.blocks, prompt[:end])
        if end == len(prompt):
            self.prefilling = None
            if self._take(run, logits[0, -1].float()):
                self.running.append(run)
        return end - start

    def _step(self) -> None:
        for run in [r for r in self.running if r.request.cancelled]:
            self._end(run, "cancelled")
        if not self.running:
            return
        device = self.cache.layers[0].k_pool.device
        self.cache.set_batch([r.blocks for r in self.running], [r.length for r in self.running])
        ids = torch.tensor([[r.last] for r in self.running], device=device)  # (B, 1)
        positions = torch.tensor([[r.length] for r in self.running], device=device)  # (B, 1)
        logits = self.model(ids, cache=self.cache, positions=positions)[:, -1].float()  # (B, V)
        self.steps += 1
        for run, row in zip(list(self.running), logits, strict=True):
            run.length += 1
            self._take(run, row)

    def _take(self, run: _Running, logits: torch.Tensor) -> bool:
        """Choose ``run``'s next token from ``logits (V,)``; False when the request ended."""
        p, new = run.request.params, len(run.request.output)
        logits = logits[None]  # (1, V)
        if run.history is not None:  # the request's own controls, on its own tokens so far
            seen = run.history[:, : len(run.request.prompt) + new]  # (1, P + new)
            last = new == p.max_new_tokens - 1
            logits = p.controls.apply(logits, seen, new=new, last_step=last,
                                      eos_id=self.eos_id)  # (1, V)  # fmt: skip
        try:
            if run.constraint is not None:  # the grammar's tokens only
                allowed = run.constraint.allowed().to(logits.device)  # (V,)
                logits = logits.masked_fill(~allowed, float("-inf"))
            token = int(run.chooser(logits)[0])
            if token == self.eos_id or token in p.stop_ids:
                self._end(run, "stop")
                return False
            run.request.emit(token, None if p.logprobs is None else _logprob(logits[0], token, p))
            if run.constraint is not None:
                run.constraint.advance(token)
        except RuntimeError as err:  # its grammar failed: this request ends, the others go on
            self._end(run, "error", err)
            return False
        if run.constraint is not None and run.constraint.finished:  # nothing may follow
            self._end(run, "stop")
            return False
        run.last = token
        if run.history is not None:
            run.history[0, len(run.request.prompt) + new] = token
        if len(run.request.output) >= p.max_new_tokens:
            self._end(run, "length")
            return False
        return True

    def _end(self, run: _Running, reason: str, error: BaseException | None = None) -> None:
        run.request.finish(reason, error)
        # Every full block it wrote is shareable: its prompt's, and its answer's so far.
        written = [*run.request.prompt, *run.request.output][: run.length]
        self.blocks.register(run.blocks, written)
        self.blocks.release(run.blocks)
        if run in self.running:
            self.running.remove(run)


def _chooser(p: SamplingParams):
    """Greedy, or the request's own seeded sampler (its min-p included)."""
    if p.temperature == 0:
        return lambda logits: logits.argmax(-1)
    return Sampler(1, seed=p.seed, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                   min_p=p.controls.min_p)  # fmt: skip


def _logprob(logits: torch.Tensor, token: int, p: SamplingParams) -> TokenLogprob:
    """``token``'s log-probability under ``logits (V,)`` (divided by the temperature when
    sampling), and the ``p.logprobs`` most probable tokens' (finite ones only)."""
    scaled = logits.float() if p.temperature == 0 else logits.float() / p.temperature  # (V,)
    logp = scaled.log_softmax(-1)  # (V,)
    values, ids = logp.topk(min(p.logprobs, logp.shape[-1]))  # (k,) each
    top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
                if v > float("-inf"))  # fmt: skip
    return TokenLogprob(token, float(logp[token]), top)


def _history(request: Request, device: torch.device) -> torch.Tensor | None:
    """``(1, P + max_new_tokens)`` long on ``device`` (the logits'): the prompt, then room for
    the output, for controls that read the row's tokens; None when nothing edits the logits."""
    p = request.params
    if not p.edits_logits:
        return None
    history = torch.zeros((1, len(request.prompt) + p.max_new_tokens), dtype=torch.long)
    history[0, : len(request.prompt)] = torch.tensor(request.prompt)
    return history.to(device)
