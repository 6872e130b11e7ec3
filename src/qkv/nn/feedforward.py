"""Position-wise feed-forward layers: the two-layer MLP and the gated ones (SwiGLU, GeGLU).

Applied to every position independently, after attention in each transformer block:

    FeedForward(x) = linear2(dropout(act(linear1(x))))          (Vaswani et al., 2017: ReLU;
                                                                  BERT and GPT-2: GELU)
    SwiGLU(x)      = down_proj(silu(gate_proj(x)) ⊙ up_proj(x))  (Shazeer, 2020; Llama)
    GeGLU(x)       = down_proj(gelu_tanh(gate_proj(x)) ⊙ up_proj(x))  (Shazeer, 2020;
                                                                  T5 v1.1, Gemma)

Submodule names follow the models people load weights from: ``linear1``/``linear2`` as in
``torch.nn.TransformerEncoderLayer``, ``gate_proj``/``up_proj``/``down_proj`` as in Hugging
Face Llama. The dropout on the block's *output* belongs to the block, not to these layers.
Each has an identity hook point ``hook_hidden`` on its ``(..., d_ff)`` hidden activations (after
the activation or gate, before dropout), for :mod:`qkv.inspect`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from qkv.nn.dropout import Dropout
from qkv.nn.hooks import HookPoint
from qkv.nn.linear import Linear

__all__ = ["ACTIVATIONS", "FEEDFORWARD_KINDS", "FeedForward", "GeGLU", "SwiGLU",
           "make_feedforward"]

# Name -> factory of the activation module. "gelu" is the exact erf form (torch's default,
# BERT); "gelu_tanh" the tanh approximation (GPT-2's "gelu_new").
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
}
# Every kind make_feedforward builds: a FeedForward per activation, then the gated ones.
FEEDFORWARD_KINDS = (*ACTIVATIONS, "swiglu", "geglu")
_KINDS = FEEDFORWARD_KINDS


def _check_width(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_dropout(p: object) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1], got {p!r}")
    return float(p)


def _check_input(x: object, d_model: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != d_model:
        raise ValueError(f"x must have shape (..., E={d_model}), got {tuple(x.shape)}")
    return x


class FeedForward(nn.Module):
    """Two-layer MLP ``linear2(dropout(act(linear1(x))))``, width ``E -> d_ff -> E``.

    Args:
        d_model: model width ``E``.
        d_ff: hidden width (``4·E`` in most models).
        activation: ``"relu"``, ``"gelu"`` (exact, erf), ``"gelu_tanh"`` (tanh approximation),
            ``"silu"``, or any callable ``Tensor -> Tensor`` (an ``nn.Module`` is registered as
            the submodule ``activation``).
        dropout: dropout on the hidden activations (as in ``TransformerEncoderLayer``).
        bias: whether both linear layers have a bias.

    Raises:
        ValueError: non-positive widths, ``dropout`` outside ``[0, 1]``, an unknown activation
            name (the message lists the known ones).
        TypeError: ``activation`` is neither a string nor callable.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.d_model = _check_width("d_model", d_model)
        self.d_ff = _check_width("d_ff", d_ff)
        if isinstance(activation, str):
            if activation not in ACTIVATIONS:
                raise ValueError(
                    f"activation must be one of {tuple(ACTIVATIONS)} or a callable, "
                    f"got {activation!r}"
                )
            self.activation_name = activation
            self.activation: Callable[[Tensor], Tensor] = ACTIVATIONS[activation]()
        elif callable(activation):
            self.activation_name = getattr(activation, "__name__", type(activation).__name__)
            self.activation = activation
        else:
            raise TypeError(
                f"activation must be a name in {tuple(ACTIVATIONS)} or a callable, "
                f"got {type(activation).__name__}"
            )
        self.linear1 = Linear(d_model, d_ff, bias=bias)
        self.dropout = Dropout(_check_dropout(dropout))
        self.linear2 = Linear(d_ff, d_model, bias=bias)
        self.hook_hidden = HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        """Args: x ``(..., E)``. Returns ``(..., E)``.

        Raises:
            TypeError / ValueError: ``x`` is not a tensor with last dimension ``E``.
        """
        x = _check_input(x, self.d_model)
        hidden = self.dropout(self.hook_hidden(self.activation(self.linear1(x))))  # (..., d_ff)
        return self.linear2(hidden)  # (..., E)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation_name!r}"


class SwiGLU(nn.Module):
    """Gated MLP ``down_proj(silu(gate_proj(x)) ⊙ up_proj(x))`` (Shazeer, 2020; Llama).

    :class:`GeGLU` is the same module with the tanh-approximated GELU as the gate.

    Three matrices instead of two, so models usually shrink ``d_ff`` to about ``8/3·E`` to
    keep the parameter count of a ``4·E`` MLP.

    Args:
        d_model: model width ``E``.
        d_ff: hidden width.
        bias: whether the three projections have biases (Llama: no).
        dropout: dropout on the gated hidden activations (0 in Llama).

    Raises:
        ValueError: non-positive widths, ``dropout`` outside ``[0, 1]``.
    """

    def __init__(
        self, d_model: int, d_ff: int, *, bias: bool = False, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.d_model = _check_width("d_model", d_model)
        self.d_ff = _check_width("d_ff", d_ff)
        self.gate_proj = Linear(d_model, d_ff, bias=bias)
        self.up_proj = Linear(d_model, d_ff, bias=bias)
        self.down_proj = Linear(d_ff, d_model, bias=bias)
        self.dropout = Dropout(_check_dropout(dropout))
        self.hook_hidden = HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        """Args: x ``(..., E)``. Returns ``(..., E)``.

        Raises:
            TypeError / ValueError: ``x`` is not a tensor with last dimension ``E``.
        """
        x = _check_input(x, self.d_model)
        gated = self._gate(self.gate_proj(x)) * self.up_proj(x)  # (..., d_ff)
        gated = self.hook_hidden(gated)
        return self.down_proj(self.dropout(gated))  # (..., E)

    def _gate(self, g: Tensor) -> Tensor:
        return torch.nn.functional.silu(g)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}"


class GeGLU(SwiGLU):
    """Gated MLP ``down_proj(gelu_tanh(gate_proj(x)) ⊙ up_proj(x))`` (Shazeer, 2020).

    The gate is GELU's tanh approximation (``gelu_pytorch_tanh`` in Hugging Face configs), as
    in Gemma and T5 v1.1. Arguments, submodules and errors as :class:`SwiGLU`.
    """

    def _gate(self, g: Tensor) -> Tensor:
        return torch.nn.functional.gelu(g, approximate="tanh")


def make_feedforward(kind: str, d_model: int, d_ff: int, **kw) -> nn.Module:
    """Build the feed-forward layer named by ``kind`` (a model config's ``activation``).

    Args:
        kind: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` (a :class:`FeedForward` with
            that activation), ``"swiglu"`` (a :class:`SwiGLU`) or ``"geglu"`` (a
            :class:`GeGLU`).
        d_model: model width ``E``.
        d_ff: hidden width.
        **kw: passed on (``dropout``, ``bias``); defaults are each class's own (bias on for
            :class:`FeedForward`, off for the gated ones).

    Returns:
        The module, mapping ``(..., E) -> (..., E)``.

    Raises:
        ValueError: unknown ``kind`` (the message lists the known ones).
        TypeError: ``activation`` passed in ``kw`` (``kind`` already chooses it).
    """
    if kind not in _KINDS:
        raise ValueError(f"feed-forward kind must be one of {_KINDS}, got {kind!r}")
    if "activation" in kw:
        raise TypeError("make_feedforward takes the activation from `kind`, not `activation=`")
    if kind == "swiglu":
        return SwiGLU(d_model, d_ff, **kw)
    if kind == "geglu":
        return GeGLU(d_model, d_ff, **kw)
    return FeedForward(d_model, d_ff, activation=kind, **kw)
