"""What a compiled decoding step was traced on: a model's structure, checked once a session.

``torch.compile`` checks, before every call, that the model still looks as it did when traced
(its guards): every submodule's attributes and every parameter's shape, dtype and strides.
For a 30-layer model that is thousands of checks, ~2 ms of an int8 step that takes ~9
(SmolLM2-135M, 2 threads, AMD EPYC), paid on every token. A decoding session's model does
not change while it decodes, so :mod:`qkv.generate.compiled` drops torch's guards on the
model's modules (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``) and checks the same
things once per session instead: :func:`structure` is a fingerprint of the module tree
(names, types, training flags, hooks, the plain attributes of every module, the shape,
dtype, device, strides and ``requires_grad`` of every parameter, buffer and tensor
attribute, and which parameters are one tensor: a tied weight). A model whose fingerprint
changed since its step was compiled (a module swapped, a hook added, a kernel or option field
set, weights of another dtype, a tie broken) gets a new compiled step, traced afresh;
weights changed in place keep the step, whose graph reads them on every call. Attributes
named ``_qkv_*`` are qkv's own bookkeeping that no trace reads (the compiled steps
themselves, a rotary module's memo of its last tables) and are left out.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["structure"]

_OWN = {"_parameters", "_buffers", "_modules"}  # walked apart, below
_PLAIN = (bool, int, float, complex, str, bytes, type(None), enum.Enum, torch.dtype,
          torch.device)  # fmt: skip


def _tensor(t: Tensor) -> tuple:
    return ("tensor", tuple(t.shape), t.dtype, t.device, t.stride(), t.requires_grad)


def _value(v: Any, depth: int = 0) -> Any:
    """A hashable stand-in for an attribute: its value where it is plain data, its metadata
    where it is a tensor, its identity otherwise (a function, a hook, an object)."""
    if isinstance(v, Tensor):
        return _tensor(v)
    if isinstance(v, _PLAIN):
        return v
    if depth < 3 and isinstance(v, tuple | list | frozenset | set):
        items = sorted(v, key=repr) if isinstance(v, set | frozenset) else v
        return (type(v).__name__, *(_value(x, depth + 1) for x in items))
    if depth < 3 and isinstance(v, dict):
        return ("dict", *((repr(k), _value(x, depth + 1)) for k, x in v.items()))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v).__qualname__, repr(v))
    return (type(v).__qualname__, id(v))


def _module(name: str, m: nn.Module, first: dict[int, str]) -> tuple:
    """One module's part; ``first`` maps each tensor seen so far to the first name it had
    (a tied weight is one graph input for both of its modules: the ties are structure)."""
    attrs = tuple((k, _value(v)) for k, v in vars(m).items()
                  if k not in _OWN and not k.startswith("_qkv_"))  # (the steps themselves)
    tensors = []
    for k, t in (*m._parameters.items(), *m._buffers.items()):
        seen = None if t is None else first.setdefault(id(t), f"{name}.{k}")
        tensors.append((k, None if t is None else (_tensor(t), seen)))
    return (name, type(m), attrs, tuple(tensors))


def structure(model: nn.Module) -> int:
    """A fingerprint of ``model``'s module tree (see the module docstring), and of torch's
    global module hooks; equal while nothing a compiled step was traced on has changed.

    Args:
        model: any ``nn.Module``.

    Returns:
        an int (a hash; compare two, never store one across processes).
    """
    hooks = nn.modules.module
    shared = tuple(_value(d) for d in (hooks._global_forward_hooks,
                                       hooks._global_forward_pre_hooks,
                                       hooks._global_module_registration_hooks))  # fmt: skip
    first: dict[int, str] = {}
    return hash((shared, *(_module(n, m, first) for n, m in model.named_modules())))
