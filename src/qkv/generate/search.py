"""Token-by-token decoding: greedy search, sampling, and a streaming iterator.

Every method runs the same loop over a :mod:`~qkv.generate.session`: the prompt (or the
encoder and BOS) once, then one new token per step with the KV cache. A row stops at EOS
(which is kept in its output) or after ``max_new_tokens``; a finished row is filled with
``pad_id`` while the others go on, and the loop ends when every row has finished.

Each method takes ``controls``, a :class:`~qkv.generate.controls.GenerationControls`
(repetition penalty, no-repeat n-grams, bad words, minimum and forced length, min-p), applied
to every step's logits before the token is chosen.

Outputs hold the *new* tokens only, ``(B, L)`` with ``L <= max_new_tokens``;
:func:`strip` turns them into lists without EOS and padding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from qkv.checks import is_int, remember_checked
from qkv.generate.args import check_sampling, check_seed, output_vocab, special_ids
from qkv.generate.compiled import open_session
from qkv.generate.controls import GenerationControls, checked_controls, prompt_ids
from qkv.generate.sampling import Sampler
from qkv.generate.session import Inputs, decoding, is_seq2seq

__all__ = ["greedy", "sample", "stream", "strip"]


def _steps(
    session, choose: Callable[[Tensor], Tensor], max_new_tokens: int, eos_id: int | None,
    fill: int, controls: GenerationControls | None = None,
) -> Iterator[Tensor]:  # fmt: skip
    """Yield the ``(B,)`` tokens of each step until every row has ended."""
    # Each row's tokens so far (B, L), kept only when the controls read them.
    history = prompt_ids(session) if controls is not None and controls.edits_logits else None
    # 1) the prompt (or encoder + BOS) gives the first logits
    logits = session.first()  # (B, V)
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)  # (B,)
    for t in range(max_new_tokens):
        # 2) the controls edit the logits; choose a token per row; ended rows get padding
        if history is not None:
            assert controls is not None
            logits = controls.apply(logits, history, new=t, last_step=t == max_new_tokens - 1,
                                    eos_id=eos_id)  # (B, V)  # fmt: skip
        tokens = choose(logits).masked_fill(finished, fill)  # (B,)
        # Chosen among the logits (or the checked fill id): the model need not read them back.
        remember_checked(tokens, ("ids", logits.shape[-1]), unversioned=True)
        yield tokens
        # 3) a row ends at EOS; stop when all have, or at the length limit
        if t == max_new_tokens - 1:
            return
        if eos_id is not None:  # (without an EOS no row ends early: no read of the device)
            finished |= tokens == eos_id
            if bool(finished.all()):
                return
        # 4) one cached forward step for the chosen tokens
        if history is not None:
            history = torch.cat([history, tokens[:, None]], dim=1)  # (B, L + 1)
        logits = session.next(tokens)  # (B, V)


def _ids(model: nn.Module, eos_id: int | None, pad_id: int | None, bos_id: int | None = None):
    """``(eos, pad, bos, fill)`` checked against the model's vocabularies (TypeError for a
    model of neither kind)."""
    return special_ids(model, eos_id, pad_id, bos_id, seq2seq=is_seq2seq(model))


def _min_p(controls: GenerationControls | None) -> float | None:
    return None if controls is None else controls.min_p


@decoding
def greedy(
    model: nn.Module,
    inputs: Inputs,
    *,
    max_new_tokens: int = 32,
    eos_id: int | None = None,
    pad_id: int | None = None,
    bos_id: int | None = None,
    compile: bool = False,
    controls: GenerationControls | None = None,
) -> Tensor:
    """Greedy decoding: the most probable token at every step.

    Args:
        model: a decoder-only LM (e.g. :class:`qkv.models.DecoderLM`) or an encoder-decoder
            model (e.g. :class:`qkv.models.Seq2SeqTransformer`).
        inputs: decoder-only: ``B`` prompts (lists of ids, any lengths >= 1) or a ``(B, P)``
            tensor; encoder-decoder: ``B`` sources (lists of ids, usually ending in EOS) or a
            ``(B, S)`` tensor right-padded with ``pad_id``.
        max_new_tokens: the most tokens generated per row.
        eos_id, pad_id, bos_id: special ids; default the model config's (``bos_id`` starts
            an encoder-decoder's output; without ``eos_id`` rows run to the limit).
        compile: decoder-only models: a static KV cache and the steps after the prompt
            through ``torch.compile`` (:mod:`qkv.generate.compiled`); the same tokens.
        controls: a :class:`~qkv.generate.controls.GenerationControls` (``min_p`` leaves
            greedy's choice unchanged); None = none.

    Returns:
        ``(B, L)`` long: the new tokens, EOS included, ``pad_id`` after it.

    Raises:
        TypeError: a model of neither kind; ``controls`` of another type.
        ValueError: malformed inputs, ids outside the vocabulary, a length past ``max_len``,
            controls the model cannot meet (:func:`~qkv.generate.controls.checked_controls`).
    """
    eos, pad, bos, fill = _ids(model, eos_id, pad_id, bos_id)
    controls = checked_controls(controls, output_vocab(model), eos)
    session = open_session(model, inputs, max_new_tokens, pad_id=pad, bos_id=bos,
                           compile=compile)  # fmt: skip
    steps = _steps(session, lambda logits: logits.argmax(-1), max_new_tokens, eos, fill,
                   controls)  # fmt: skip
    return torch.stack(list(steps), dim=1)  # (B, L)


@decoding
def sample(
    model: nn.Module,
    inputs: Inputs,
    *,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | Sequence[int] | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    bos_id: int | None = None,
    compile: bool = False,
    controls: GenerationControls | None = None,
) -> Tensor:
    """Sampling with temperature, top-k and top-p (nucleus); ``temperature=0`` is greedy.

    Args:
        model, inputs, max_new_tokens, eos_id, pad_id, bos_id, compile, controls: as
            :func:`greedy`; ``controls.min_p`` filters after top-p.
        temperature: >= 0; 0 = greedy, below 1 sharper, above 1 flatter.
        top_k: sample among the ``k`` most probable tokens only; None = all.
        top_p: sample within the nucleus of probability mass ``p``; None = all.
        seed: an int (row ``b`` uses ``seed + b``, so a row samples the same alone or in a
            batch), one int per row, or None (drawn from torch's global generator).

    Returns:
        ``(B, L)`` long, as :func:`greedy`.

    Raises:
        ValueError: as :func:`greedy`, and ``temperature`` not a finite number >= 0,
            ``top_k`` not an int >= 1, ``top_p`` outside ``(0, 1]``, a bad seed (all checked
            even when ``temperature=0`` leaves them unused; see :mod:`qkv.generate.args`).
    """
    check_sampling(temperature, top_k, top_p)
    eos, pad, bos, fill = _ids(model, eos_id, pad_id, bos_id)
    controls = checked_controls(controls, output_vocab(model), eos)
    session = open_session(model, inputs, max_new_tokens, pad_id=pad, bos_id=bos,
                           compile=compile)  # fmt: skip
    check_seed(seed, session.batch)  # checked even when greedy leaves it unused
    if temperature == 0:
        choose: Callable[[Tensor], Tensor] = lambda logits: logits.argmax(-1)  # noqa: E731
    else:
        # seeded on the CPU: one seed draws the same tokens whatever the model's device
        choose = Sampler(session.batch, seed=seed, temperature=temperature, top_k=top_k,
                         top_p=top_p, min_p=_min_p(controls))  # fmt: skip
    steps = _steps(session, choose, max_new_tokens, eos, fill, controls)
    return torch.stack(list(steps), dim=1)  # (B, L)


def stream(
    model: nn.Module,
    prompt: Sequence[int],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
    bos_id: int | None = None,
    compile: bool = False,
    controls: GenerationControls | None = None,
) -> Iterator[int]:
    """Generate for one prompt, yielding each new token id as soon as it is chosen.

    The same tokens as :func:`greedy` (``temperature=0``) or :func:`sample` with the same
    seed; EOS ends the stream and is not yielded.

    Args:
        model: a decoder-only LM (an encoder-decoder model works too, ``prompt`` being the
            source).
        prompt: the token ids (a list, or a 1-D tensor).
        max_new_tokens, temperature, top_k, top_p, eos_id, bos_id, compile, controls: as
            :func:`sample`.
        seed: an int or None.

    Returns:
        an iterator of ints (computed lazily: each ``next`` runs one model step).

    Raises:
        ValueError: as :func:`sample`, raised by this call (before the first ``next``).
    """
    check_sampling(temperature, top_k, top_p)
    if seed is not None and not is_int(seed):
        raise ValueError(f"seed must be an int or None (stream decodes one row), got {seed!r:.80}")
    check_seed(seed, 1)
    if isinstance(prompt, Tensor):
        prompt = prompt.reshape(-1).tolist() if prompt.dim() <= 1 else prompt
    if isinstance(prompt, str | Tensor) or not isinstance(prompt, Sequence):
        raise ValueError(f"prompt must be a list of token ids (or a 1-D tensor), got "
                         f"{prompt!r:.80}")  # fmt: skip
    with torch.inference_mode():
        eos, pad, bos, fill = _ids(model, eos_id, None, bos_id)
        controls = checked_controls(controls, output_vocab(model), eos)
        session = open_session(model, [list(prompt)], max_new_tokens, pad_id=pad, bos_id=bos,
                               compile=compile)  # fmt: skip
        if temperature == 0:
            choose: Callable[[Tensor], Tensor] = lambda logits: logits.argmax(-1)  # noqa: E731
        else:
            choose = Sampler(1, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p,
                             min_p=_min_p(controls))  # fmt: skip
    return _tokens(_steps(session, choose, max_new_tokens, eos, fill, controls), eos)


def _tokens(steps: Iterator[Tensor], eos: int | None) -> Iterator[int]:
    """The ints of one row's steps, stopping before EOS; each step runs in inference mode."""
    while True:
        with torch.inference_mode():
            tokens = next(steps, None)
        if tokens is None or (eos is not None and int(tokens[0]) == eos):
            return
        yield int(tokens[0])


def strip(tokens: Tensor, eos_id: int | None) -> list[list[int]]:
    """Rows of ``tokens (B, L)`` as lists, each cut before its first ``eos_id``.

    Raises:
        ValueError: ``tokens`` not 2-D.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (B, L), got shape {tuple(tokens.shape)}")
    rows = []
    for row in tokens.tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id)]
        rows.append(row)
    return rows
