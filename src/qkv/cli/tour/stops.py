"""The stops of ``qkv tour``, in order, and how they run.

Each :class:`Stop` is a name (what ``--stop`` takes), a title and a function ``(Context,
Section) -> None`` from a theme module (:mod:`qkv.cli.tour.attention`,
:mod:`~qkv.cli.tour.modules`, :mod:`~qkv.cli.tour.masks`, :mod:`~qkv.cli.tour.positions`,
:mod:`~qkv.cli.tour.layers`, :mod:`~qkv.cli.tour.models`, :mod:`~qkv.cli.tour.memory`). The
order follows the seed tutorials: the function, the module, heads, masks, positions, the
block, a token's journey, the encoder-decoder, older additive attention, images, and cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from qkv.cli.tour import attention as tour_attention
from qkv.cli.tour import layers as tour_layers
from qkv.cli.tour import masks as tour_masks
from qkv.cli.tour import memory as tour_memory
from qkv.cli.tour import models as tour_models
from qkv.cli.tour import modules as tour_modules
from qkv.cli.tour import positions as tour_positions
from qkv.cli.tour.page import Context, Section

__all__ = ["STOPS", "Stop", "TourCheckError", "check_sections", "run_stop", "select"]


@dataclass(frozen=True)
class Stop:
    """One stop: ``name`` for ``--stop``, ``title`` for the heading, ``run`` fills a section."""

    name: str
    title: str
    run: Callable[[Context, Section], None]


STOPS: tuple[Stop, ...] = (
    Stop("attention", "the attention function and its weights", tour_attention.attention_stop),
    Stop("steps", "scores -> scaled -> softmax -> weighted sum", tour_attention.steps_stop),
    Stop("numpy", "NumPy (qkv.reference) vs torch (qkv), float64", tour_attention.numpy_stop),
    Stop("self-attention", "the self-attention module and its projections",
         tour_modules.self_attention_stop),
    Stop("multi-head", "multi-head attention: packed in_proj, split, heads, concat, = torch",
         tour_modules.multihead_stop),
    Stop("masks", "masks: causal, padding, cross-attention with T != S", tour_masks.masks_stop),
    Stop("positions", "positions: the sinusoidal formula and RoPE's relative property",
         tour_positions.positions_stop),
    Stop("block", "the transformer block: residual + norm, the feed-forward",
         tour_layers.block_stop),
    Stop("journey", "a token's journey through one layer", tour_layers.journey_stop),
    Stop("encoder-decoder", "the encoder-decoder and its cross-attention",
         tour_models.encoder_decoder_stop),
    Stop("additive", "Bahdanau's additive attention", tour_models.additive_stop),
    Stop("vit", "ViT: an image as a sequence of patches", tour_models.vit_stop),
    Stop("memory", "the O(T·S) memory of the scores, and what flash attention changes",
         tour_memory.memory_stop),
)  # fmt: skip


class TourCheckError(ValueError):
    """A stop's check failed (a ValueError, so the command prints one ``error:`` line)."""


def select(names: Sequence[str] | None) -> list[Stop]:
    """The stops named (in tour order), or all of them for None / empty.

    Raises:
        ValueError: a name that is not a stop, with the list of known stops.
    """
    if not names:
        return list(STOPS)
    known = [stop.name for stop in STOPS]
    for name in names:
        if name not in known:
            raise ValueError(
                f"--stop {name!r} is not a stop of the tour; known stops: {', '.join(known)}"
            )
    return [stop for stop in STOPS if stop.name in names]


def run_stop(stop: Stop, ctx: Context) -> Section:
    """Run one stop into a fresh section; torch's global random state is left as it was.

    A stop that raises (a library error on its live tensors) does not end the tour: what it
    showed so far is kept and a failed check ``"the stop ran to the end"`` naming the
    exception is added, so :func:`check_sections` reports it with the other failures.
    """
    number = STOPS.index(stop) + 1 if stop in STOPS else 0
    section = Section(stop.name, stop.title, number)
    with torch.random.fork_rng(devices=[]):
        try:
            stop.run(ctx, section)
        except Exception as err:  # any failure of the library under the stop is a failed check
            message = " ".join(str(err).split())
            section.holds("the stop ran to the end", False, f"({type(err).__name__}: {message})")
    return section


def check_sections(sections: Sequence[Section]) -> None:
    """Raise :class:`TourCheckError` naming every failed check, if any.

    Raises:
        TourCheckError: ``"tour check failed: stop 'positions': table = the formula ...: max
            |difference| = 0.001 > 1e-12"`` (all failures, ``;``-separated).
    """
    failed = [f"stop {s.name!r}: {check}" for s in sections for check in s.failures]
    if failed:
        raise TourCheckError(f"tour check failed ({len(failed)}): " + "; ".join(failed))
