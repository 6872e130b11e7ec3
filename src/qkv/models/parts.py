"""Pieces every model assembles: positions, input checks, masks, initialisation, the base class.

Positions are data, not branches: :func:`make_positions` turns a config's ``positions`` into
:class:`PositionParts`, the module added to the embeddings (learned, sinusoidal) and the
keyword arguments the blocks' self-attention takes (``rope=``, ``alibi=``). A model adds
``parts.added`` when it is not None and passes ``parts.attention`` to every block; it never
asks which scheme it has.

Packed rows: :func:`check_document_ids`, :func:`document_positions` and
:func:`document_block_mask` give a model what it needs to run several documents in one row as
if each ran alone: positions that restart at each document and a block mask that keeps
attention inside its document (:func:`qkv.attention.mods.document_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.flex.blocks import BlockMask, create_block_mask
from qkv.attention.mods import document_mask
from qkv.checks import checked_before, values_unknown
from qkv.nn.cache import KVCache
from qkv.nn.positions import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from qkv.nn.relative_bias import RelativePositionBias
from qkv.nn.rope import RotaryEmbedding
from qkv.nn.rope_scaling import RopeScaling
from qkv.nn.static_cache import StaticKVCache

__all__ = [
    "ModelBase",
    "PositionParts",
    "add_positions",
    "check_cache",
    "check_document_ids",
    "check_ids",
    "check_memory",
    "check_positions",
    "document_block_mask",
    "document_positions",
    "init_gpt_style",
    "init_xavier",
    "make_positions",
    "packed_inputs",
    "padding_keep_mask",
]


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


@dataclass(frozen=True)
class PositionParts:
    """How one positional scheme enters a model.

    Attributes:
        added: module adding positions to the embeddings ``(B, T, E) -> (B, T, E)``
            (learned, sinusoidal), or None (RoPE, ALiBi, no positions).
        attention: keyword arguments for each block's self-attention (``rope``, ``alibi``,
            ``alibi_symmetric``); one ``RotaryEmbedding`` is shared by every block.
        limit: number of positions there are (a learned table's rows), or None when any
            position works.
        bias: module giving a ``(1, H, T, S)`` bias added to the self-attention scores
            (T5's relative bias, ``bias(T, S, offset)``), computed once per stack and given to
            every block of it as a float mask; None for the other schemes.
    """

    added: nn.Module | None = None
    attention: dict[str, Any] = field(default_factory=dict)
    limit: int | None = None
    bias: nn.Module | None = None


def make_positions(
    kind: str | None,
    *,
    d_model: int,
    d_head: int,
    max_len: int,
    rope_base: float = 10000.0,
    symmetric: bool = False,
    num_heads: int | None = None,
    relative_buckets: int = 32,
    relative_max_distance: int = 128,
    rope_scaling: RopeScaling | None = None,
    rope_dim: int | None = None,
) -> PositionParts:
    """Build the parts of positional scheme ``kind`` (a config's ``positions``).

    Args:
        kind: ``"learned"``, ``"sinusoidal"``, ``"rope"``, ``"alibi"``, ``"relative"``
            (T5's bucketed bias, :class:`~qkv.nn.relative_bias.RelativePositionBias`) or None.
        d_model: model width ``E``.
        d_head: head width ``D`` (RoPE rotates ``D``-wide queries and keys).
        max_len: rows of a learned table; rows precomputed for the others.
        rope_base: RoPE frequency base.
        symmetric: ALiBi with ``|i - j|`` distances, or a bidirectional relative bias
            (encoders).
        num_heads: heads ``H`` of the relative bias (needed for ``"relative"`` only).
        relative_buckets, relative_max_distance: the relative bias's buckets (T5: 32, 128).
        rope_scaling: RoPE frequency scaling (:class:`~qkv.nn.rope_scaling.RopeScaling`).
        rope_dim: columns RoPE rotates (None: all of ``d_head``; partial rotary).

    Raises:
        ValueError: unknown ``kind`` (configs have rejected it already).
    """
    builders = {
        "learned": lambda: PositionParts(
            LearnedPositionalEmbedding(max_len, d_model), limit=max_len
        ),
        "sinusoidal": lambda: PositionParts(SinusoidalPositionalEncoding(d_model, max_len)),
        "rope": lambda: PositionParts(
            attention={"rope": RotaryEmbedding(d_head, base=rope_base, max_len=max_len,
                                               scaling=rope_scaling, rotary_dim=rope_dim)}
        ),
        "alibi": lambda: PositionParts(
            attention={"alibi": True, "alibi_symmetric": symmetric}
        ),
        "relative": lambda: PositionParts(bias=RelativePositionBias(
            num_heads, relative_buckets, relative_max_distance, bidirectional=symmetric)),
        None: lambda: PositionParts(),
    }
    if kind not in builders:
        raise ValueError(f"positions must be one of {tuple(builders)}, got {kind!r}")
    if kind == "relative" and num_heads is None:
        raise ValueError("positions='relative' needs num_heads (one bias per head)")
    return builders[kind]()


def add_positions(
    pos: nn.Module | None, x: Tensor, *, offset: int = 0, positions: Tensor | None = None,
    checked: bool = False,
) -> Tensor:
    """``x (B, T, E)`` plus the positions of its tokens (``offset + arange(T)`` or ``positions``).

    ``positions`` is ``(B, T)`` or ``(T,)``; ``checked``: already bounded by the learned
    table's size (:func:`check_positions` with its ``max_len``), so it is not read again.
    """
    if pos is None:
        return x
    if positions is None:
        return pos(x, offset)  # (B, T, E)
    if checked and isinstance(pos, LearnedPositionalEmbedding):
        # check_positions bounded them by the table (max_len): no second reading
        return x + pos.weight[positions]  # (B, T, E)
    if isinstance(pos, SinusoidalPositionalEncoding):
        # While tracing, the values are unknown: the table's current rows must cover them.
        n = pos.max_len if values_unknown(positions) else int(positions.max()) + 1
        rows = pos.table(n, dtype=x.dtype)  # (P, E)
        return x + rows[positions]  # (B, T, E)
    return pos(x, positions=positions)  # (B, T, E)


def check_ids(name: str, ids: object, vocab_size: int) -> Tensor:
    """Check token ids: an integer ``(B, T)`` tensor with ``B, T >= 1``, values in ``[0, V)``.

    Raises:
        TypeError: not a tensor, or not an integer dtype.
        ValueError: not 2-D, empty, or ids out of range (min and max are reported).
    """
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids (torch.long), got dtype {ids.dtype}")
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"{name} must have shape (B, T) with B, T >= 1, got {_shape(ids)}")
    if values_unknown(ids):  # tracing (compile, export) or the meta device: shapes only
        return ids
    if checked_before(ids, ("ids", vocab_size)):  # chosen from logits by a generation loop
        return ids
    lo, hi = _min_max(ids)
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"{name} must lie in [0, vocab_size={vocab_size}), got values in [{lo}, {hi}]"
        )
    return ids


def _min_max(t: Tensor) -> tuple[int, int]:
    """``(min, max)`` of an integer tensor, read from the device in one transfer."""
    lo, hi = torch.stack(torch.aminmax(t)).tolist()
    return lo, hi


def check_positions(
    positions: object, B: int, T: int, *, max_len: int | None = None
) -> Tensor | None:
    """Check explicit positions: None, or integers ``(B, T)`` / ``(T,)`` in ``[0, max_len)``.

    ``max_len`` is the learned table's size (None: no upper bound).

    Raises:
        TypeError: not an integer tensor.
        ValueError: wrong shape, negative values, or values at or beyond ``max_len``.
    """
    if positions is None:
        return None
    if not isinstance(positions, Tensor) or positions.is_floating_point() or (
        positions.dtype == torch.bool or positions.is_complex()
    ):
        raise TypeError(
            f"positions must be an integer tensor (B, T) or None, got {positions!r:.80}"
        )
    if positions.shape not in ((B, T), (T,)):
        raise ValueError(
            f"positions must have shape (B, T) = ({B}, {T}) or (T,), got {_shape(positions)}"
        )
    if values_unknown(positions) or checked_before(positions, ("positions", max_len)):
        return positions  # (checked: computed by a decoding session, in range by construction)
    lo, hi = _min_max(positions)
    if lo < 0 or (max_len is not None and hi >= max_len):
        bound = "" if max_len is None else f", max_len={max_len} (learned positions)"
        raise ValueError(
            f"positions must lie in [0{bound}), got values in [{lo}, {hi}]"
        )
    return positions


def check_length(name: str, T: int, offset: int, max_len: int | None) -> None:
    """A learned position table has ``max_len`` rows: ``offset + T`` may not exceed it
    (``max_len`` None: no limit, nothing to check).

    Raises:
        ValueError: naming ``name``, the length, the cached offset and ``max_len``.
    """
    if max_len is not None and offset + T > max_len:
        cached = f" after {offset} cached tokens" if offset else ""
        raise ValueError(
            f"{name} has T={T} tokens{cached}, which goes beyond max_len={max_len} of the "
            "learned position table; use a shorter input or a model with a larger max_len"
        )


def padding_keep_mask(name: str, mask: object, B: int, S: int) -> Tensor:
    """A ``(B, S)`` padding mask (bool, or 0/1 numbers; 1 = real token) as a ``(B, 1, 1, S)``
    boolean keep mask.

    Raises:
        TypeError: not a tensor.
        ValueError: shape other than ``(B, S)``, or numeric values other than 0 and 1.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a (B, S) tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) != (B, S):
        raise ValueError(f"{name} must have shape (B, S) = ({B}, {S}), got {_shape(mask)}")
    if mask.dtype != torch.bool:
        if not values_unknown(mask) and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                f"{name} must be boolean or hold only 0 and 1 (1 = real token), got other values"
            )
        mask = mask != 0
    return mask[:, None, None, :]  # (B, 1, 1, S)


def check_document_ids(document_ids: object, B: int, T: int) -> Tensor:
    """Check packed-row document ids: integers ``(B, T)``, each document one contiguous run.

    Any integer may name a document (padding at a row's end is a document of its own, as
    :func:`qkv.data.packing.pack_documents` writes it); the same id in two separate runs of a
    row would join them into one document whose positions restart mid-way, so it is refused.

    Raises:
        TypeError: not an integer tensor.
        ValueError: a shape other than ``(B, T)``, or a document split into separate runs.
    """
    if not isinstance(document_ids, Tensor) or document_ids.is_floating_point() or (
        document_ids.dtype == torch.bool or document_ids.is_complex()
    ):
        raise TypeError(
            f"document_ids must be an integer tensor (B, T) or None, got {document_ids!r:.80}"
        )
    if tuple(document_ids.shape) != (B, T):
        raise ValueError(
            f"document_ids must have the shape of input_ids ({B}, {T}), got "
            f"{_shape(document_ids)}"
        )
    starts = _starts(document_ids)  # (B, T)
    runs = starts.sum(dim=1)  # (B,)
    for b in range(B):
        if int(runs[b]) != int(document_ids[b].unique().numel()):
            raise ValueError(
                f"document_ids row {b} uses a document id in more than one separate run; each "
                "document must be one contiguous run of positions (give every run its own id)"
            )
    return document_ids


def _starts(document_ids: Tensor) -> Tensor:
    """``(B, T)`` bool: True where a new document starts (position 0 and every id change)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)  # (B, T)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_positions(document_ids: Tensor) -> Tensor:
    """Positions that restart at 0 at each document: ``(B, T)`` long.

    ``positions[b, t] = t - (first position of t's document)``: what each token's position
    would be were its document run alone.
    """
    B, T = document_ids.shape
    t = torch.arange(T, device=document_ids.device).expand(B, T)  # (B, T)
    first = torch.where(_starts(document_ids), t, torch.zeros_like(t))  # (B, T)
    return t - first.cummax(dim=1).values  # (B, T)


def packed_inputs(
    document_ids: object, positions: Tensor | None, B: int, T: int
) -> tuple[BlockMask, Tensor]:
    """Checked ``document_ids (B, T)`` -> ``(block mask built once for every block,
    positions (B, T) restarting per document unless given)``."""
    document_ids = check_document_ids(document_ids, B, T)
    block_mask = document_block_mask(document_ids)
    return block_mask, document_positions(document_ids) if positions is None else positions


def document_block_mask(document_ids: Tensor) -> BlockMask:
    """The block mask of "same document" for ``(B, T)`` ids, one per batch row, all heads."""
    B, T = document_ids.shape
    return create_block_mask(
        document_mask(document_ids), B, None, T, T, device=document_ids.device
    )


def check_memory(memory: object, B: int, weight: Tensor, *, batch_of: str) -> Tensor:
    """The encoder output a decoder attends to: ``(B, S, E)`` with ``E = weight.shape[1]``, on
    ``weight``'s device, in its dtype (or under autocast); each error names ``memory`` and
    what it should be (``batch_of``: the argument whose batch size it must share).

    Raises:
        ValueError: a wrong shape, batch size or device. TypeError: a wrong dtype.
    """
    E = weight.shape[1]
    if not isinstance(memory, Tensor) or memory.dim() != 3 or memory.shape[2] != E:
        got = tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__
        raise ValueError(f"memory must have shape (B, S, E={E}), got {got}")
    if memory.shape[0] != B:
        raise ValueError(f"memory must have {batch_of}'s batch size B={B}, got memory of "
                         f"shape {tuple(memory.shape)}")  # fmt: skip
    if memory.device != weight.device:
        raise ValueError(f"memory must be on the model's device {weight.device}, got "
                         f"{memory.device}")  # fmt: skip
    if memory.dtype != weight.dtype and not torch.is_autocast_enabled(weight.device.type):
        raise TypeError(f"memory must have the parameters' dtype {weight.dtype} (the output "
                        f"of encode), got {memory.dtype}")  # fmt: skip
    return memory


def check_cache(cache: object, num_layers: int) -> KVCache | StaticKVCache | None:
    """None, or a :class:`KVCache` (or :class:`StaticKVCache`) with one layer per block.

    Raises:
        TypeError: not a ``KVCache``.
        ValueError: a different number of layers.
    """
    if cache is None:
        return None
    if not isinstance(cache, KVCache | StaticKVCache):
        raise TypeError(
            "cache must be a qkv.nn.KVCache (model.new_cache()) or None, got "
            f"{type(cache).__name__}"
        )
    if len(cache) != num_layers:
        raise ValueError(
            f"cache has {len(cache)} layers but the model has {num_layers}; use model.new_cache()"
        )
    return cache


def init_gpt_style(model: nn.Module, num_layers: int, std: float = 0.02) -> None:
    """GPT-2 / BERT initialisation: ``N(0, std²)`` weights, zero biases, unit norms.

    The projections that write into the residual stream (attention ``out_proj``, the
    feed-forward's ``linear2`` / ``down_proj``) get ``std / sqrt(2·num_layers)`` so the
    stream's variance does not grow with depth (GPT-2, section 2.3).
    """
    residual = {"out_proj", "linear2", "down_proj"}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            s = std / (2 * num_layers) ** 0.5 if name.rsplit(".", 1)[-1] in residual else std
            nn.init.normal_(module.weight, mean=0.0, std=s)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, LearnedPositionalEmbedding):
            module.reset_parameters()


def init_xavier(model: nn.Module) -> None:
    """Xavier-uniform for every matrix (the Annotated Transformer, ``torch.nn.Transformer``)."""
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)


class ModelBase(nn.Module):
    """Common surface of the models: ``config``, ``num_parameters`` and a readable repr."""

    config: Any

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of scalar parameters, each shared (tied) tensor counted once.

        Args:
            trainable_only: count only parameters with ``requires_grad``.
        """
        return sum(
            p.numel() for p in self.parameters() if p.requires_grad or not trainable_only
        )

    def extra_repr(self) -> str:
        return f"config: {self.config.summary()}\nparameters: {self.num_parameters():,}"


def new_static_cache(num_layers: int, batch_size: int | None, max_len: int | None,
                     num_kv_heads: int, d_head: int, like: Tensor, *,
                     dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> StaticKVCache:  # fmt: skip
    """A :class:`~qkv.nn.static_cache.StaticKVCache` for a model's ``new_cache(static=True)``:
    ``batch_size`` rows and ``max_len`` slots, in ``like``'s dtype and device unless given.

    Raises:
        ValueError: ``batch_size`` or ``max_len`` missing (a static cache has a fixed shape),
            or not positive ints.
    """
    if batch_size is None or max_len is None:
        raise ValueError("a static cache needs batch_size and max_len (its fixed shape)")
    return StaticKVCache(
        num_layers, batch_size, max_len, num_kv_heads, d_head,
        dtype=like.dtype if dtype is None else dtype,
        device=like.device if device is None else device,
    )
