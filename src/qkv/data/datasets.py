"""Training data from a torch ``Dataset`` or ``DataLoader``, checked at the door.

:func:`~qkv.train.train_seq2seq` and :func:`~qkv.train.train_lm` take, besides lists, any
map-style :class:`torch.utils.data.Dataset` (``len(ds)`` and ``ds[i]``) or a
:class:`~torch.utils.data.DataLoader` over one. How the items must look:

* encoder-decoder training: each item a ``(source, target)`` pair of strings (a tuple or
  list of two ``str``); the tokenizers encode them.
* language-model training: each item one document of token ids (a list of ints or a 1-D
  integer tensor ``(N,)``), as ``tok.encode(text, add_bos=True, add_eos=True)`` gives.

The items are read once, in index order, into a list, and then batched exactly as that list
would be: qkv's batching (length buckets, a seeded order per epoch) is what makes resuming
exact and data-parallel runs equal to one process. A ``DataLoader`` therefore contributes its
``dataset`` only; its sampler, batch size and collate function are not used. An iterable-style
dataset (no ``len``) is refused: it cannot be re-read from the same position on resume.

The first item is checked and a wrong one raises a TypeError naming what was received and
what was expected, before any training starts.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dataset_documents", "dataset_pairs", "is_torch_data"]


def is_torch_data(data: object) -> bool:
    """True for a :class:`torch.utils.data.Dataset` or :class:`~torch.utils.data.DataLoader`."""
    return isinstance(data, torch.utils.data.Dataset | torch.utils.data.DataLoader)


def _items(name: str, data: Any, expected: str) -> list[Any]:
    """Every item of a map-style dataset (or a DataLoader's dataset), in index order."""
    dataset = data.dataset if isinstance(data, torch.utils.data.DataLoader) else data
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"{name}: an iterable-style {type(dataset).__name__} (no len()) cannot be trained on "
            f"with exact resume; expected a map-style Dataset (len(ds), ds[i]) of {expected}"
        )
    n = len(dataset)
    if n == 0:
        raise ValueError(
            f"{name}: the {type(dataset).__name__} holds no items; expected {expected}"
        )
    return [dataset[i] for i in range(n)]


def _describe(item: Any) -> str:
    if isinstance(item, tuple | list):
        inner = ", ".join(type(x).__name__ for x in item[:3])
        return f"a {type(item).__name__} of {len(item)} ({inner}{', ...' if len(item) > 3 else ''})"
    if isinstance(item, torch.Tensor):
        return f"a tensor of shape {tuple(item.shape)} and dtype {item.dtype}"
    return f"a {type(item).__name__}"


def dataset_pairs(name: str, data: Any) -> list[tuple[str, str]]:
    """The ``(source, target)`` string pairs of a torch Dataset or DataLoader.

    Raises:
        TypeError: an iterable-style dataset, or a first item that is not a pair of strings
            (the message names what it is).
        ValueError: an empty dataset.
    """
    expected = "(source, target) pairs of str"
    items = _items(name, data, expected)
    first = items[0]
    if not (isinstance(first, tuple | list) and len(first) == 2
            and all(isinstance(x, str) for x in first)):  # fmt: skip
        raise TypeError(f"{name}: item 0 of the dataset is {_describe(first)}; expected "
                        f"{expected}")  # fmt: skip
    return [(s, t) for s, t in items]


def dataset_documents(name: str, data: Any) -> list[list[int]]:
    """The token-id documents of a torch Dataset or DataLoader (each a list of ints).

    Raises:
        TypeError: an iterable-style dataset, or a first item that is not a list of ints or a
            1-D integer tensor (the message names what it is).
        ValueError: an empty dataset.
    """
    expected = "documents of token ids (a list of int or a 1-D integer tensor (N,))"
    items = _items(name, data, expected)
    first = items[0]
    ok = (
        isinstance(first, torch.Tensor) and first.dim() == 1 and not first.is_floating_point()
        and first.dtype != torch.bool
    ) or (
        isinstance(first, list | tuple) and len(first) > 0
        and all(isinstance(x, int) and not isinstance(x, bool) for x in first)
    )  # fmt: skip
    if not ok:
        raise TypeError(f"{name}: item 0 of the dataset is {_describe(first)}; expected "
                        f"{expected}")  # fmt: skip
    return [d.tolist() if isinstance(d, torch.Tensor) else list(d) for d in items]
