"""LoRA: fine-tune a large linear layer through a small low-rank update (Hu et al., 2021).

A frozen ``nn.Linear`` with weight ``W (out, in)`` gets two trainable matrices,
``A (r, in)`` and ``B (out, r)``; the layer computes::

    y = x Wᵀ + b + (dropout(x) Aᵀ Bᵀ) · alpha / r

``B`` starts at zero, so a model with adapters computes exactly what it did before; ``A``
starts as ``nn.Linear``'s own initialisation (Kaiming-uniform), as PEFT's LoRA does. Only ``A``
and ``B`` train: ``r · (in + out)`` numbers per layer instead of ``in · out``. After training
the update folds into the weight (``W + B A · alpha / r``, :func:`merge_lora`), and the model is
a plain model again, as fast as before.

:func:`add_lora` puts adapters on the linears whose names match the given patterns
(``fnmatch`` style: ``"*.q_proj"``, ``"blocks.*.ffn.*"``) and freezes every other parameter.

Shapes: ``in`` / ``out`` the linear's widths, ``r`` the rank.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["LoRALinear", "add_lora", "lora_layers", "lora_parameters", "merge_lora",
           "restore_lora"]


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update (see the module docstring).

    Args:
        base: the ``nn.Linear`` to adapt (its parameters are frozen).
        rank: ``r`` >= 1.
        alpha: the update's scale numerator (the update is multiplied by ``alpha / r``).
        dropout: dropout on the adapter's input (training only).

    Raises:
        TypeError: ``base`` not an ``nn.Linear``.
        ValueError: a rank that is not a positive int, a negative ``alpha``, ``dropout``
            outside ``[0, 1)``.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRA adapts nn.Linear layers, got {type(base).__name__}")
        _check(rank, alpha, dropout)
        self.base, self.rank, self.alpha = base, rank, float(alpha)
        for p in base.parameters():
            p.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype,
                                               device=w.device))  # (r, in)  # fmt: skip
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype,
                                               device=w.device))  # (out, r)  # fmt: skip
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.drop = nn.Dropout(dropout)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype inputs are checked against (as a quantised linear says it)."""
        return self.base.weight.dtype

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"

    def forward(self, x: Tensor) -> Tensor:
        """``(..., in) -> (..., out)``."""
        update = self.drop(x) @ self.lora_A.t() @ self.lora_B.t()  # (..., out)
        return self.base(x) + update * self.scaling

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the update folded into its weight."""
        base = self.base
        out = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                        dtype=base.weight.dtype, device=base.weight.device)  # fmt: skip
        with torch.no_grad():
            out.weight.copy_(base.weight + (self.lora_B @ self.lora_A) * self.scaling)
            if base.bias is not None:
                out.bias.copy_(base.bias)
        return out


def _check(rank: object, alpha: object, dropout: object) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha < math.inf:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must lie in [0, 1), got {dropout!r}")


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def add_lora(model: nn.Module, targets: str | Sequence[str], *, rank: int = 8,
             alpha: float = 16.0, dropout: float = 0.0) -> list[str]:  # fmt: skip
    """Put LoRA adapters on ``model``'s linears named like ``targets``; freeze the rest.

    Args:
        model: any module.
        targets: ``fnmatch`` patterns over module names (``model.named_modules()``), e.g.
            ``["*.q_proj", "*.v_proj"]``.
        rank, alpha, dropout: as :class:`LoRALinear`.

    Returns:
        the adapted module names, in order.

    Raises:
        ValueError: a pattern that matches no ``nn.Linear`` (named, with examples of the
            model's linear names), bad sizes.
    """
    _check(rank, alpha, dropout)
    patterns = [targets] if isinstance(targets, str) else list(targets)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"targets must be name patterns, got {targets!r:.80}")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in linears):
            raise ValueError(f"LoRA target {p!r} matches no linear layer; the model's linears "
                             f"include {linears[:4]}")  # fmt: skip
    chosen = [n for n in linears if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        _set(model, name, LoRALinear(model.get_submodule(name), rank, alpha, dropout))
    return chosen


def lora_parameters(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors by name (what an adapter file holds)."""
    return {n: p for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (in place); returns ``model``, adapters gone."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            _set(model, name, module.merged())
    return model


def lora_layers(model: nn.Module) -> dict[str, dict[str, float]]:
    """``{layer name: {"rank", "alpha", "dropout"}}`` of every adapter in ``model`` (what a
    checkpoint records so that :func:`restore_lora` can rebuild them)."""
    return {n: {"rank": m.rank, "alpha": m.alpha, "dropout": m.drop.p}
            for n, m in model.named_modules() if isinstance(m, LoRALinear)}  # fmt: skip


def restore_lora(model: nn.Module, layers: object) -> nn.Module:
    """Put adapters on ``model`` as :func:`lora_layers` described them; freeze the rest.

    Raises:
        TypeError: ``layers`` not a mapping of names to ``{"rank", "alpha", "dropout"}``.
        ValueError: a layer the model does not have, or not an ``nn.Linear``; bad sizes.
    """
    if not isinstance(layers, dict) or not all(
        isinstance(v, dict) and set(v) == {"rank", "alpha", "dropout"} for v in layers.values()
    ):
        raise TypeError("LoRA layers must map layer names to {'rank', 'alpha', 'dropout'}")
    modules = dict(model.named_modules())
    for name, kind in layers.items():
        if not isinstance(modules.get(name), nn.Linear):
            raise ValueError(f"LoRA layer {name!r} is not an nn.Linear of this model")
        _check(kind["rank"], kind["alpha"], kind["dropout"])
    for p in model.parameters():
        p.requires_grad_(False)
    for name, kind in layers.items():
        _set(model, name, LoRALinear(modules[name], kind["rank"], kind["alpha"], kind["dropout"]))
    return model
