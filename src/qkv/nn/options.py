"""What attention does beyond its projections, as one frozen record: :class:`AttentionOptions`.

An option is one field here and the code that reads it where it acts; it is not a parameter
handed down through every constructor. :class:`~qkv.nn.attention.Attention` and
:class:`~qkv.nn.block.TransformerBlock` take the record (``options=``) or its fields as
keywords (``Attention(512, 8, window=256)``), validate them once, here, and keep the record;
:class:`~qkv.nn.core.AttentionCore` carries it into the kernel call. Where each field acts:

============== ======================================================================
``scale``       the kernel call: the factor on ``q·k`` (None: ``1/sqrt(D)``)
``window``      the kernel call: a sliding causal window (needs ``is_causal``)
``alibi``       ``Attention``: ALiBi distance biases, causal (``j - i``) distances, or
``alibi_symmetric``  ``-|i - j|`` ones (encoders)
``softcap``     ``Attention``: ``cap·tanh(score / cap)`` on the scaled scores (a score mod)
``qk_norm``     ``Attention``: RMSNorm or LayerNorm of each query and key head over ``D``
``norm_eps``    ``Attention``: the epsilon of those norms
``temperature`` ``AttentionCore``: per-head temperatures ``(τ_0 .. τ_{H-1})``, head ``h``'s
                scores divided by ``τ_h`` (its queries are, before the kernel call)
============== ======================================================================

Model configs keep their own serialised field names (``attn_scale``, ``attn_softcap``, ...),
so checkpoints written before this record existed load unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qkv.checks import is_number, positive_int
from qkv.nn.norms import NORMS

__all__ = ["AttentionOptions"]


def _positive(name: str, value: object) -> float | None:
    """None, or ``value`` as a float when it is a finite number > 0."""
    if value is None:
        return None
    if not is_number(value) or not value > 0:
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
    return float(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class AttentionOptions:
    """One record of attention's options (see the module docstring for where each acts).

    Raises:
        ValueError: a ``scale``, ``softcap`` or ``norm_eps`` that is not a finite number
            > 0, a ``window`` that is not an int >= 1, an unknown ``qk_norm``,
            ``alibi_symmetric`` without ``alibi``.
        TypeError: ``alibi`` or ``alibi_symmetric`` that is not a bool.
    """

    scale: float | None = None
    window: int | None = None
    alibi: bool = False
    alibi_symmetric: bool = False
    softcap: float | None = None
    qk_norm: str | None = None
    norm_eps: float = 1e-6
    temperature: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        fix = object.__setattr__  # frozen: normalise the validated values in place
        fix(self, "scale", _positive("scale", self.scale))
        fix(self, "softcap", _positive("softcap", self.softcap))
        fix(self, "norm_eps", _positive("norm_eps", self.norm_eps))
        if self.window is not None:
            fix(self, "window", positive_int("window", self.window))
        _flag("alibi", self.alibi)
        _flag("alibi_symmetric", self.alibi_symmetric)
        if self.alibi_symmetric and not self.alibi:
            raise ValueError("alibi_symmetric=True needs alibi=True")
        if self.qk_norm is not None and self.qk_norm not in NORMS:
            raise ValueError(f"qk_norm must be None or one of {NORMS}, got {self.qk_norm!r}")
        if self.temperature is not None:
            taus = self.temperature
            if not isinstance(taus, (tuple, list)) or not taus:
                raise ValueError(f"temperature must be None or a sequence of per-head numbers "
                                 f"> 0, got {taus!r}")
            fix(self, "temperature", tuple(_positive("temperature", t) for t in taus))

    @classmethod
    def build(cls, options: AttentionOptions | None = None, **fields) -> AttentionOptions:
        """``options`` (default: all defaults) with ``fields`` replaced.

        Raises:
            TypeError: ``options`` that is not an ``AttentionOptions``, or a field name that
                is not an option (the message lists them).
        """
        if options is not None and not isinstance(options, AttentionOptions):
            raise TypeError(f"options must be an AttentionOptions or None, got "
                            f"{type(options).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise TypeError(f"unknown attention option(s) {', '.join(unknown)}; the options "
                            f"are {', '.join(sorted(names))}")
        base = options or cls()
        return dataclasses.replace(base, **fields) if fields else base

    def for_cross_attention(self) -> AttentionOptions:
        """These options without the ones that work on positions within one sequence (ALiBi,
        the window): what the cross-attention of a block takes."""
        return dataclasses.replace(self, alibi=False, alibi_symmetric=False, window=None)

    def described(self) -> list[str]:
        """The options that differ from the defaults, as ``name=value`` (for ``repr``)."""
        parts = []
        if self.alibi:
            parts.append("alibi=" + ("symmetric" if self.alibi_symmetric else "causal"))
        for name in ("scale", "qk_norm", "window", "softcap"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)!r}")
        return parts
