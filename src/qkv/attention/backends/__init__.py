"""Attention backends: interchangeable implementations of one :class:`AttentionCall`, and the
registry :mod:`qkv.attention.dispatch` chooses among.

The contract
============

A backend is a module (any object with these attributes will do) exposing:

``NAME: str``
    What users pass as ``backend=...``: unique, not ``"auto"``.
``why_not(call) -> str | None``
    ``None`` when the backend honours ``call``, else why not, as one phrase (``qkv.explain``
    prints it; a call that names a refusing backend raises ``AttentionArgumentError`` with
    it). A backend may refuse whatever it does not implement: dropout, weights, the
    log-sum-exp (``call.need_lse``), an empty sequence (``T`` or ``S`` is 0), a device... It
    must never accept a call and then compute something else.
``prefer_not(call) -> str | None`` (optional)
    Asked by ``auto`` only, and only after ``why_not`` gave ``None``: a reason to leave a call
    it could run to the next backend in :data:`PREFERENCE` (that one is faster there). A call
    that names the backend ignores it.
``run(call) -> (out, weights)``
    ``out (B, H, T, Dv)`` in the query's dtype; ``weights (B, H, T, S)`` in the query's dtype
    (the softmax weights as applied to the values, dropout included) when
    ``call.need_weights``, else ``None``.
``run_lse(call) -> (out, weights, lse)``
    :func:`run` plus the log-sum-exp ``lse (B, H, T)`` of the scaled, masked scores, in a
    float dtype of the backend's choosing (the caller converts it). Called for
    ``return_lse=True`` (``call.need_lse``).

``call`` holds validated 4-D tensors: ``query (B, H, T, D)``, ``key (B, Hkv, S, D)``,
``value (B, Hkv, S, Dv)`` with ``H = G·Hkv`` (``call.groups``: query heads ``h·G .. h·G+G-1``
share key/value head ``h``), plus the mask parts (a user mask, a causal diagonal, a sliding
window, ALiBi slopes; :func:`qkv.attention.masks.apply_mask` is their one definition),
``scale`` and ``dropout_p`` (drawn as :mod:`qkv.attention.dropout` defines, so one seed
drops the same weights on every backend of a device).

On every call it honours, a backend itself (no caller fixes its results up):

* gives a row with no visible key (a "dead row") zero output, zero weights, ``lse = -inf``
  and zero gradient, never NaN (:mod:`qkv.attention.rows` writes that rule once);
* gives a query row holding NaN or ``±inf`` a NaN output row and a NaN weights row, dead
  or not (:func:`qkv.attention.masks.poison_rows`);
* gives an empty batch (``B = 0``) empty results of the shapes above, gradients included;
* lets ``out`` (and the weights) carry autograd gradients with respect to q, k and v.

The registry
============

:data:`REGISTRY` maps each name to its module and :data:`PREFERENCE` is the order ``auto``
tries them in, fastest first; both are read-only, live views kept by :func:`register` and
:func:`unregister`. qkv registers ``torch``, ``triton`` (CUDA), ``flash`` and ``math``, in
that order. ``math`` honours every call, so it is the fallback ``auto`` always ends with and
cannot be unregistered; a backend registered without a ``preference`` goes after it, where ``auto``
never reaches it: it runs when named. A backend need not have a cost model
(:mod:`qkv.attention.costs`): ``qkv.explain`` then says "no cost model" for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType, ModuleType

from qkv.attention.backends import flash, math, torch_kernel, triton_kernel

__all__ = [
    "PREFERENCE", "REGISTRY", "REQUIRED", "flash", "math", "register", "torch_kernel",
    "triton_kernel", "unregister",
]

# What a backend must expose, with what each is for (quoted in registration errors).
REQUIRED = {
    "NAME": "the name users pass as backend=",
    "why_not": "why_not(call) -> str | None",
    "run": "run(call) -> (out, weights | None)",
    "run_lse": "run_lse(call) -> (out, weights | None, lse)",
}
_CALLABLE = ("why_not", "prefer_not", "run", "run_lse")
_FALLBACK = "math"

_modules: dict[str, ModuleType] = {}  # kept in preference order
_order: list[str] = []


class _Preference(Sequence[str]):
    """A read-only, live view of the preference order: behaves as a tuple of names."""

    def __getitem__(self, index):
        return tuple(_order)[index]

    def __iter__(self):
        return iter(tuple(_order))  # a snapshot: unchanged by a register() mid-walk

    def __contains__(self, name: object) -> bool:
        return name in _order

    def __len__(self) -> int:
        return len(_order)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return tuple(_order) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # it changes: not a dictionary key

    def __repr__(self) -> str:
        return repr(tuple(_order))


REGISTRY: Mapping[str, ModuleType] = MappingProxyType(_modules)
PREFERENCE: Sequence[str] = _Preference()


def _check(module: ModuleType) -> str:
    """The backend's name, after checking it has what the contract asks for.

    Raises:
        TypeError: a missing or non-callable attribute (every one is named).
        ValueError: a name that is empty, ``"auto"`` or already registered.
    """
    label = getattr(module, "__name__", repr(module))
    missing = [f"{a} ({what})" for a, what in REQUIRED.items() if not hasattr(module, a)]
    if missing:
        raise TypeError(
            f"backend {label} lacks {', '.join(missing)}; see qkv.attention.backends"
        )
    wrong = [a for a in _CALLABLE if hasattr(module, a) and not callable(getattr(module, a))]
    if wrong:
        raise TypeError(f"backend {label}: {', '.join(wrong)} must be callable")
    name = module.NAME
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"backend {label}: NAME must be a non-empty string other than 'auto', "
                         f"got {name!r}")
    if name in _modules:
        raise ValueError(f"a backend named {name!r} is already registered; unregister it first")
    return name


def register(module: ModuleType, *, preference: int | None = None) -> ModuleType:
    """Add a backend to :data:`REGISTRY` and return it.

    Args:
        module: a module (or object) with the attributes of the contract above.
        preference: its index in :data:`PREFERENCE` (0: ``auto`` tries it first); ``None``
            puts it last, after the ``math`` fallback, so ``auto`` never picks it.

    Raises:
        TypeError: ``module`` lacks an attribute of the contract (the message names each).
        ValueError: its name is taken or invalid, or ``preference`` is out of range.
    """
    name = _check(module)
    at = len(_order) if preference is None else preference
    if not isinstance(at, int) or not 0 <= at <= len(_order):
        raise ValueError(f"preference must be an int in [0, {len(_order)}] or None, "
                         f"got {preference!r}")
    _order.insert(at, name)
    _modules[name] = module
    _reorder()
    return module


def unregister(name: str) -> ModuleType:
    """Remove the backend called ``name`` from the registry and return its module.

    Raises:
        KeyError: no backend of that name.
        ValueError: ``name`` is ``"math"``, the fallback that honours every call.
    """
    if name not in _modules:
        raise KeyError(f"no backend named {name!r}; registered: {', '.join(_order)}")
    if name == _FALLBACK:
        raise ValueError("the math backend is the fallback that honours every call; "
                         "it cannot be unregistered")
    _order.remove(name)
    return _modules.pop(name)


def _reorder() -> None:
    """Keep :data:`REGISTRY`'s iteration order equal to :data:`PREFERENCE`."""
    modules = dict(_modules)
    _modules.clear()
    _modules.update((n, modules[n]) for n in _order)


for _builtin in (torch_kernel, triton_kernel, flash, math):  # the built-in backends, fastest first
    register(_builtin)
del _builtin
