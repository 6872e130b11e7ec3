"""Choose a backend for an attention call, and explain the choice.

The backends are those of the registry (:mod:`qkv.attention.backends`, where their contract
is written down). ``auto`` walks :data:`PREFERENCE` (fastest first) and takes the first
backend that can honour the call; ``math`` honours every call, so the walk always ends.
:func:`explain` returns that decision as data: the chosen backend and, for every other
backend, why it was not chosen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType

from qkv.attention import backends
from qkv.attention.call import AttentionCall
from qkv.attention.costs import Cost, predict
from qkv.attention.errors import AttentionArgumentError

__all__ = ["BACKENDS", "PREFERENCE", "Explanation", "decide", "select"]

# Read-only, live views of the registry (backends.register adds to both): name -> module,
# and the names fastest first, as ``auto`` takes them.
BACKENDS: Mapping[str, ModuleType] = backends.REGISTRY
PREFERENCE: Sequence[str] = backends.PREFERENCE


@dataclass(frozen=True)
class Explanation:
    """Which backend ``auto`` picks for a call, and why not each of the others.

    Attributes:
        chosen: name of the backend ``auto`` runs.
        reasons: for every other backend, why it was not chosen.
        shapes: the call's ``B, H, Hkv, T, S, D, Dv`` after validation.
        costs: predicted FLOPs and peak extra memory of each backend's forward
            (:mod:`qkv.attention.costs`); a backend with no cost model is absent, and
            ``str()`` says "no cost model" for it. Empty when costs were not asked for.
    """

    chosen: str
    reasons: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, int] = field(default_factory=dict)
    costs: dict[str, Cost] = field(default_factory=dict)

    def __str__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.shapes.items())
        lines = [f"auto -> {self.chosen}" + (f"  ({dims})" if dims else "")]
        for name in self._names():
            cost = self._cost(name)
            if name == self.chosen:
                lines.append(f"  {name}: chosen{cost}")
            elif name in self.reasons:
                lines.append(f"  {name}: not chosen, {self.reasons[name]}{cost}")
        return "\n".join(lines)

    def _names(self) -> list[str]:
        """The backends to report, in preference order (then any since unregistered)."""
        named = [self.chosen, *self.reasons]
        return [*(n for n in PREFERENCE if n in named), *(n for n in named if n not in PREFERENCE)]

    def _cost(self, name: str) -> str:
        """``name``'s predicted cost as printed: none at all when costs were not computed."""
        if not self.costs:
            return ""
        return f"  [{self.costs[name]}]" if name in self.costs else "  [no cost model]"


def _why_not_auto(name: str, call: AttentionCall) -> str | None:
    """Why ``auto`` skips a backend: it cannot honour the call, or another serves it better."""
    module = BACKENDS[name]
    why = module.why_not(call)
    if why is None and hasattr(module, "prefer_not"):
        why = module.prefer_not(call)
    return why


def decide(call: AttentionCall, *, with_costs: bool = True) -> Explanation:
    """Run the ``auto`` policy on ``call`` and record every reason (and, for ``explain``,
    every backend's predicted cost; ``auto`` itself skips that work)."""
    reasons: dict[str, str] = {}
    chosen = None
    for name in PREFERENCE:
        why = _why_not_auto(name, call)
        if chosen is None and why is None:
            chosen = name
        elif why is not None:
            reasons[name] = why
        else:
            reasons[name] = f"{chosen} is preferred (faster) for this call"
    assert chosen is not None, "the math backend honours every call"
    q, v = call.query, call.value
    shapes = {
        "B": q.shape[0], "H": q.shape[1], "Hkv": call.num_kv_heads, "T": call.T,
        "S": call.S, "D": q.shape[3], "Dv": v.shape[3],
    }
    costs = {}
    for name in PREFERENCE if with_costs else ():
        cost = predict(call, name)
        if cost is not None:  # None: a registered backend without a cost model
            costs[name] = cost
    return Explanation(chosen=chosen, reasons=reasons, shapes=shapes, costs=costs)


def select(call: AttentionCall, backend: str) -> ModuleType:
    """The backend module to run ``call`` with.

    Raises:
        AttentionArgumentError: unknown ``backend`` name, or a named backend that cannot
            honour the call.
    """
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        known = ", ".join(repr(b) for b in ("auto", *BACKENDS))
        raise AttentionArgumentError(f"backend must be one of {known}, got {backend!r}")
    if backend == "auto":
        # The first backend in PREFERENCE with nothing against it: what decide() chooses,
        # without writing the other backends' reasons (this runs on every attention call).
        for name in PREFERENCE:
            if _why_not_auto(name, call) is None:
                return BACKENDS[name]
        return BACKENDS[decide(call, with_costs=False).chosen]  # (math honours every call)
    module = BACKENDS[backend]
    why = module.why_not(call)
    if why is not None:
        raise AttentionArgumentError(f"backend={backend!r} cannot honour this call: {why}")
    return module
