"""Hugging Face transformers models on qkv's attention: ``attn_implementation="qkv"``.

    import qkv.integrations.transformers as qkv_hf
    qkv_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation="qkv")
    qkv_hf.attach(model)                                # hook points before the first call
    with qkv.inspect.capture(model, layers=-1) as cap:
        model(ids)
    cap.weights["model.layers.1.self_attn.qkv_core"]   # (B, H, T, S), exact

How: :func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface``
and, for the masks, transformers' own boolean SDPA mask builder to ``AttentionMaskInterface``
under the same name (True = may attend, ``None`` where ``is_causal`` alone says it, as for
``"sdpa"``). Each call then runs through an :class:`HFAttentionCore` attached to the calling
transformers attention module as its submodule ``qkv_core``: the one attention core of
:mod:`qkv.nn.core` (hook points, the kernel ``auto`` picks, weights on request), so the hook
points appear in the model's module tree and :func:`qkv.inspect.capture` finds them. The core
has no parameters: ``state_dict`` keys do not change. Cores are attached on the first call;
:func:`attach` attaches them up front (capture looks for them when it starts).

The semantics are those of transformers' ``"sdpa"`` implementation: its ``is_causal`` rule
(the module's ``is_causal``, only when no mask is given and more than one query), the
scale the model passes (``scaling``), dropout, grouped-query heads (read in place, never
repeated) and the masks transformers builds for ``"sdpa"`` (padding and sliding windows are
tested). A causal layer given a mask (padding) carries its causality in that mask, so
:func:`qkv.inspect.capture` records its kind as ``"self"``, not ``"causal self"``.
Refused with a clear error: ``softcap``, ``position_bias`` (T5-style relative bias),
attention sinks (``s_aux``) and paged caches.

transformers is imported only inside the functions here (it is an optional extra).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from qkv.attention.masks import check_attn_mask
from qkv.nn.core import AttentionCore
from qkv.nn.options import AttentionOptions

__all__ = ["NAME", "HFAttentionCore", "attach", "attention_forward", "register"]

# The attn_implementation string :func:`register` uses by default.
NAME = "qkv"
# The submodule name a core is attached under.
CORE = "qkv_core"
# Keyword arguments of transformers' attention functions that qkv does not implement.
_REFUSED = {
    "softcap": "a tanh soft cap on the scores (use qkv.flex_attention with a score_mod)",
    "position_bias": "a T5-style relative position bias",
    "s_aux": "attention sinks (a learned extra key per head)",
}


class HFAttentionCore(AttentionCore):
    """The qkv attention core of one transformers attention module (no parameters).

    ``num_heads`` (``H``) and ``num_kv_heads`` (``Hkv``) are read from the transformers module
    when attached and updated from each call's shapes.
    """

    def __init__(self, num_heads: int = 0, num_kv_heads: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "HFAttentionCore is called through qkv.integrations.transformers.attention_forward "
            "by its transformers attention module, not directly"
        )


def _heads_of(module: nn.Module) -> tuple[int, int]:
    """``(H, Hkv)`` of a transformers attention module, 0 where it does not say."""
    config = getattr(module, "config", None)
    H = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", 0) or 0
    Hkv = getattr(config, "num_key_value_heads", None) or H
    return int(H), int(Hkv)


def core_of(module: nn.Module) -> HFAttentionCore:
    """The :class:`HFAttentionCore` of a transformers attention module, attached if missing."""
    core = getattr(module, CORE, None)
    if isinstance(core, HFAttentionCore):
        return core
    if core is not None:
        raise TypeError(
            f"{type(module).__name__}.{CORE} is a {type(core).__name__}, not qkv's core; "
            "rename that attribute"
        )
    core = HFAttentionCore(*_heads_of(module))
    module.add_module(CORE, core)
    return core


def _attention_classes(model: nn.Module) -> tuple[type, ...]:
    """The attention module classes a transformers model declares (``_can_record_outputs``)."""
    classes = []
    for key, target in (getattr(model, "_can_record_outputs", None) or {}).items():
        if "attention" not in key:
            continue
        cls = getattr(target, "target_class", target)
        if isinstance(cls, type):
            classes.append(cls)
    return tuple(classes)


def attach(model: nn.Module) -> dict[str, HFAttentionCore]:
    """Attach a core to every attention module of a transformers ``model`` now.

    Needed only before :func:`qkv.inspect.capture` on a model that has not run yet (cores are
    otherwise attached on each module's first call). The modules are the classes the model
    lists for ``"attentions"`` / ``"cross_attentions"`` in ``_can_record_outputs``.

    Returns:
        ``{name of the core in model.named_modules(): core}``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: no attention module found (a model from an older transformers that does
            not list its attention classes: run it once instead, which attaches the cores).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    classes = _attention_classes(model)
    targets = [(n, m) for n, m in model.named_modules() if classes and isinstance(m, classes)]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} declares no attention modules (_can_record_outputs has no "
            "'attentions' class); run the model once with attn_implementation='qkv' instead, "
            "which attaches the cores"
        )
    for _, module in targets:
        core_of(module)
    return {f"{n}.{CORE}" if n else CORE: getattr(m, CORE) for n, m in targets}


def _weights_wanted(kwargs: dict[str, Any]) -> bool:
    """Whether transformers wants this call's weights (``output_attentions=True``).

    Some models pass ``output_attentions`` down to the attention function; others (GPT-2) pop
    it and only collect the attention modules' second output through transformers' output
    recorder, whose active collector then has an ``"attentions"`` key (a private transformers
    name, read defensively: without it only the keyword counts).
    """
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - other transformers versions
        return False
    collected = _active_collector.get()
    return bool(collected) and any("attentions" in key for key in collected)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature, run on qkv's attention core.

    Args:
        module: the calling transformers attention module (its ``is_causal`` is the default
            causality; its :class:`HFAttentionCore` is attached on first use).
        query: ``(B, H, T, D)``.
        key: ``(B, Hkv, S, D)``; grouped-query heads (``H`` a multiple of ``Hkv``) are read in
            place.
        value: ``(B, Hkv, S, Dv)``.
        attention_mask: None, or the mask transformers built, broadcastable to
            ``(B, H, T, S)``: boolean (True = may attend) or float (added to the scores).
        dropout: dropout on the weights (transformers passes 0 in evaluation).
        scaling: factor on ``q·k``; ``1/sqrt(D)`` when None.
        is_causal: overrides ``module.is_causal``; as in ``"sdpa"``, causality applies only
            without a mask and with more than one query (top-left aligned).
        **kwargs: transformers' extras. The weights are returned when transformers asks
            for them (``output_attentions=True``), else None as for ``"sdpa"``.

    Returns:
        ``(out (B, T, H, Dv), weights (B, H, T, S) or None)``.

    Raises:
        ValueError: an argument qkv does not implement (``softcap``, ``position_bias``,
            ``s_aux``, a paged cache), naming it.
    """
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attn_implementation='qkv' does not implement {name!r} ({what}); use "
                "attn_implementation='eager' for this model"
            )
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise ValueError("attn_implementation='qkv' does not implement paged caches ('cache')")
    core = core_of(module)
    B, H, T, _ = query.shape
    core.num_heads, core.num_kv_heads = H, key.shape[1]
    mask = None
    if attention_mask is not None:
        mask = check_attn_mask(
            attention_mask, (B, H, T, key.shape[2]), name="attention_mask",
            device=query.device, dtype=query.dtype,
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and T > 1 and mask is None
    out, weights = core.attend(
        query, key, value, mask=mask, is_causal=causal, dropout_p=float(dropout),
        need_weights=_weights_wanted(kwargs), options=AttentionOptions(scale=scaling),
        cross=bool(getattr(module, "is_cross_attention", False)),
    )  # (B, H, T, Dv), (B, H, T, S) | None
    return out.transpose(1, 2).contiguous(), weights  # (B, T, H, Dv)


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` (default ``"qkv"``) run :func:`attention_forward`.

    Registers the attention function with transformers' ``AttentionInterface`` and
    transformers' boolean SDPA mask builder with ``AttentionMaskInterface`` under ``name``.
    Idempotent. Returns ``name``.

    Raises:
        ImportError: transformers is not installed (``pip install qkv[parity]``).
        ValueError: ``name`` is not a non-empty string or names one of transformers' own
            implementations.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "qkv.integrations.transformers needs transformers (pip install 'qkv[parity]')"
        ) from err
    builtin = {"eager", "sdpa", "flex_attention", "paged|eager"}
    if not isinstance(name, str) or not name or name in builtin or name.startswith("flash"):
        raise ValueError(
            f"name must be a new attention implementation name such as 'qkv', got {name!r}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name

