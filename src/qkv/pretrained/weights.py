"""Moving a checkpoint's tensors into a qkv model, strictly, by an explicit name map.

Every converter (BERT, GPT-2, Llama, GGUF) describes the checkpoint it expects as a list of
:class:`Entry`: the source tensor's name, the shape it must have (computed from the config, so
a wrong-sized checkpoint is caught by name, not by a broadcasting accident later), and the qkv
parameter(s) it fills, with an optional transform (a transpose, a slice of a fused matrix, the
undoing of llama.cpp's row permutation). :func:`check_entries` checks the three ways a
checkpoint can be wrong against the file's header, before the model is built, and
:func:`load_entries` again on the tensors read, each reported with the tensor names:

* missing: a tensor the model needs is not in the file;
* unexpected: the file has a tensor nobody asked for (and the converter does not know to be
  safely unused, like BERT's pooler or a cached ``position_ids`` buffer);
* misshaped: a tensor with the wrong shape.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from qkv.data.files import BadFileError

__all__ = ["Entry", "check_entries", "load_entries", "skip_init", "transpose", "with_prefix"]

Transform = Callable[[Tensor], Tensor]


def transpose(t: Tensor) -> Tensor:
    """``(in, out) -> (out, in)``: GPT-2's ``Conv1D`` stores linear weights transposed."""
    return t.t()  # (out, in)


@dataclass(frozen=True)
class Entry:
    """One source tensor and the qkv parameters it fills.

    Attributes:
        source: the tensor's name in the checkpoint (after any prefix is stripped).
        shape: the shape it must have.
        targets: ``(qkv state-dict key, transform or None)`` pairs; a fused source (GPT-2's
            ``c_attn``) fills several keys, a tied one may fill two.
    """

    source: str
    shape: tuple[int, ...]
    targets: tuple[tuple[str, Transform | None], ...]


def with_prefix(
    entries: Iterable[Entry], prefix: str, *, bare: tuple[str, ...] = ()
) -> list[Entry]:
    """``entries`` with ``prefix`` before each source name (task models store the base model
    under ``transformer.`` or ``bert.``), except the names in ``bare`` (e.g. ``lm_head.weight``,
    which sits beside the base model). Messages then name tensors as the file spells them."""
    return [e if e.source in bare else replace(e, source=prefix + e.source) for e in entries]


_INITS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
    "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_",
)


@contextmanager
def skip_init() -> Iterator[None]:
    """Build modules without initialising their parameters (the memory is left as allocated).

    Random initialisation of a 135M-parameter model costs seconds and is thrown away when the
    checkpoint is copied in, so loaders build the model inside this context; :func:`load_entries`
    then refuses to finish unless every parameter was filled. It swaps ``torch.nn.init``'s
    functions for no-ops while the block runs (as Hugging Face's ``no_init_weights`` does), so
    it is not meant for use from several threads at once.
    """
    saved = {name: getattr(nn.init, name) for name in _INITS if hasattr(nn.init, name)}

    def noop(tensor: Tensor, *args: object, **kwargs: object) -> Tensor:
        return tensor

    try:
        for name in saved:
            setattr(nn.init, name, noop)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _names(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def check_entries(
    shapes: Mapping[str, tuple[int, ...]],
    entries: Iterable[Entry],
    *,
    where: str | os.PathLike,
    ignore: Callable[[str], bool] = lambda name: False,
    origin: str = "",
) -> None:
    """Check a file's tensor names and shapes against ``entries``, before any data is read.

    Args:
        shapes: source name -> shape (a safetensors or GGUF header, or a state dict's shapes).
        entries: the expected source tensors (computed from the config).
        where: the weights file, named in messages (and the error's ``path``).
        ignore: source names that are known to be unused (not reported as unexpected).
        origin: where the expected shapes come from, appended to messages
            (``"the model config.json describes"``).

    Raises:
        qkv.data.files.BadFileError (a ValueError): missing, unexpected or misshaped tensors,
            all of a kind named at once.
    """
    entries = list(entries)
    tail = f" ({origin})" if origin else ""
    missing = [e.source for e in entries if e.source not in shapes]
    if missing:
        raise BadFileError(f"{where}: missing tensor(s) {_names(missing)}{tail}", path=where)
    used = {e.source for e in entries}
    unexpected = [k for k in shapes if k not in used and not ignore(k)]
    if unexpected:
        raise BadFileError(f"{where}: unexpected tensor(s) {_names(unexpected)}{tail}",
                           path=where)  # fmt: skip
    wrong = [
        f"{e.source!r} has shape {tuple(shapes[e.source])}, expected {tuple(e.shape)}"
        for e in entries
        if tuple(shapes[e.source]) != tuple(e.shape)
    ]
    if wrong:
        raise BadFileError(f"{where}: misshaped tensor(s): " + "; ".join(wrong[:8]) + tail,
                           path=where)  # fmt: skip


def _wider(t: Tensor, param: Tensor) -> Tensor:
    """``t`` in the wider of its dtype and ``param``'s, so a transform (Gemma's ``1 + w``)
    rounds once, into the model's dtype, not first in the file's (an fp16 folder loaded in
    float32 was 1e-2 off transformers' logits)."""
    if t.is_floating_point() and param.is_floating_point():
        return t.to(torch.promote_types(t.dtype, param.dtype))
    return t


def load_entries(
    model: nn.Module,
    state: Mapping[str, Tensor],
    entries: Iterable[Entry],
    *,
    where: str | os.PathLike,
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy ``state``'s tensors into ``model`` as ``entries`` say, checking everything.

    Args:
        model: the freshly built qkv model.
        state: source name -> tensor (any float dtype; cast to the model's dtype).
        entries: the expected source tensors.
        where: the checkpoint's path or name, for messages.
        ignore: source names that are known to be unused (not reported as unexpected).

    Raises:
        qkv.data.files.BadFileError (a ValueError): missing, unexpected or misshaped tensors
            (see :func:`check_entries`).
        ValueError: a model parameter no entry fills, or an entry naming a parameter the
            model lacks (a converter bug, named too).
    """
    entries = list(entries)
    check_entries({k: tuple(v.shape) for k, v in state.items()}, entries, where=where,
                  ignore=ignore)  # fmt: skip
    params = model.state_dict()
    new: dict[str, Tensor] = {}
    for e in entries:
        for key, fn in e.targets:
            if key not in params:
                raise ValueError(f"{where}: converter error: qkv model has no parameter {key!r}")
            t = state[e.source] if fn is None else fn(_wider(state[e.source], params[key]))
            if t.shape != params[key].shape:
                raise ValueError(
                    f"{where}: tensor {e.source!r} gives {key!r} shape {tuple(t.shape)}, but "
                    f"the model's is {tuple(params[key].shape)}"
                )
            new[key] = t
    unfilled = [k for k in params if k not in new]
    if unfilled:
        raise ValueError(f"{where}: converter error: nothing fills {_names(unfilled)}")
    with torch.no_grad():
        for key, t in new.items():
            params[key].copy_(t)
