"""Packed sequences: variable-length documents laid into fixed-length rows, with document ids.

Padding every example to the longest wastes the padded positions' compute; packing lays
several documents end to end in one row of ``T`` tokens and records which document each
position belongs to, so a model can keep attention inside each document and restart its
positions (``DecoderLM(..., document_ids=)``, ``Encoder(..., document_ids=)``). Then each
document computes exactly what it computes alone, and almost no position is padding.

1. Documents longer than ``T`` are cut into pieces of ``T`` (``long="split"``, each piece a
   document of its own whose positions restart at 0) or refused (``long="error"``).
2. The pieces are laid into rows by one of two greedy strategies:

   * ``"best_fit"`` (best-fit decreasing): pieces longest first, each into the row whose free
     space fits it most tightly (a new row when none does). Documents stay whole (beyond the
     cut of step 1); rows end in a little padding.
   * ``"sequential"``: pieces in their order, each row filled to exactly ``T`` and a piece
     that does not fit cut at the row's end (its rest starts the next row as a document of
     its own). No padding but in the last row; more documents are cut.

3. Padding at a row's end is a document of its own, id :data:`PAD_DOCUMENT` (-1): real
   positions never see it; its tokens are ``pad_id`` and an LM's targets there are
   :data:`IGNORE_INDEX`.

Language modelling (:func:`pack_lm`): a document of ``n`` tokens gives ``n - 1`` (input,
target) pairs, ``targets[t] = inputs[t + 1]`` inside the document, so no position learns to
predict the next document's first token. ``packed=False`` lays one document per row instead
(the padded baseline), with the same targets. A :class:`LabeledDocument` also says which
tokens are learned (Hugging Face's ``labels``: the token, or :data:`IGNORE_INDEX`), e.g. only
the assistant's turns of a chat: a position whose next token is not learned gets target
:data:`IGNORE_INDEX`, and still attends and is attended to as any other.

Shapes: ``N`` rows of ``T`` positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.checks import positive_int

__all__ = [
    "IGNORE_INDEX",
    "LONG_POLICIES",
    "PAD_DOCUMENT",
    "STRATEGIES",
    "LabeledDocument",
    "PackedRows",
    "pack_documents",
    "pack_lm",
    "plan_rows",
    "split_documents",
]

PAD_DOCUMENT = -1  # the document id of padding at a row's end
IGNORE_INDEX = -100  # LM targets that no loss counts (torch's cross_entropy default)
STRATEGIES = ("best_fit", "sequential")
LONG_POLICIES = ("split", "error")

# One segment of a row: (document index, first token, last token + 1).
Segment = tuple[int, int, int]


@dataclass(frozen=True)
class PackedRows:
    """Documents packed into ``N`` rows of ``T`` positions.

    Attributes:
        tokens: ``(N, T)`` long ids (``pad_id`` on padding); for :func:`pack_lm` the inputs.
        document_ids: ``(N, T)`` long: ``0, 1, ...`` per document within a row,
            :data:`PAD_DOCUMENT` on padding.
        positions: ``(N, T)`` long, restarting at 0 at each document (and at padding).
        targets: ``(N, T)`` long next-token labels (:func:`pack_lm`), :data:`IGNORE_INDEX` on
            padding; None for :func:`pack_documents`.
        num_documents: documents packed (before any cut).
        num_pieces: segments laid into rows (a cut document counts each piece).
    """

    tokens: Tensor
    document_ids: Tensor
    positions: Tensor
    targets: Tensor | None
    num_documents: int
    num_pieces: int

    @property
    def real_tokens(self) -> int:
        """Positions that hold a document's token."""
        return int((self.document_ids != PAD_DOCUMENT).sum())

    @property
    def padding_fraction(self) -> float:
        """Share of the ``N·T`` positions that are padding."""
        total = self.tokens.numel()
        return 0.0 if total == 0 else 1.0 - self.real_tokens / total

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __repr__(self) -> str:
        N, T = self.tokens.shape
        return (f"PackedRows(rows={N}, T={T}, documents={self.num_documents}, pieces="
                f"{self.num_pieces}, padding={self.padding_fraction:.1%})")  # fmt: skip


@dataclass(frozen=True)
class LabeledDocument:
    """A document whose loss counts only on some tokens (e.g. a chat's assistant turns).

    Attributes:
        ids: ``(n,)`` token ids.
        labels: ``(n,)``: ``labels[i] == ids[i]`` where token ``i`` is learned (predicted
            from the tokens before it), :data:`IGNORE_INDEX` where it is not; the first
            token is never predicted, whatever its label.

    Raises:
        TypeError: ids or labels not sequences of ints; ValueError: different lengths, or a
            label that is neither its token nor :data:`IGNORE_INDEX` (naming the position).
    """

    ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("ids", "labels"):
            v = getattr(self, name)
            v = v.tolist() if isinstance(v, Tensor) else v
            if not isinstance(v, Sequence) or isinstance(v, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in v
            ):
                raise TypeError(f"LabeledDocument.{name} must be a sequence of ints, got "
                                f"{type(v).__name__}")  # fmt: skip
            object.__setattr__(self, name, tuple(v))
        if len(self.ids) != len(self.labels):
            raise ValueError(f"LabeledDocument: {len(self.ids)} ids but {len(self.labels)} "
                             "labels; give one label per token")  # fmt: skip
        for i, (t, y) in enumerate(zip(self.ids, self.labels, strict=True)):
            if y not in (t, IGNORE_INDEX):
                raise ValueError(f"LabeledDocument: label {y} at position {i} is neither the "
                                 f"token ({t}) nor IGNORE_INDEX ({IGNORE_INDEX})")  # fmt: skip

    @property
    def learned(self) -> int:
        """Tokens whose prediction counts (the first token never does)."""
        return sum(y != IGNORE_INDEX for y in self.labels[1:])


def split_documents(text: str, separator: str = "\n\n") -> list[str]:
    """``text`` cut at ``separator`` into documents (e.g. paragraphs), empty ones dropped.

    Raises:
        TypeError: ``text`` or ``separator`` not a str; ValueError: an empty separator.
    """
    if not isinstance(text, str) or not isinstance(separator, str):
        raise TypeError(f"text and separator must be str, got {type(text).__name__} and "
                        f"{type(separator).__name__}")  # fmt: skip
    if not separator:
        raise ValueError("separator must not be empty")
    return [d for d in text.split(separator) if d.strip()]


def plan_rows(
    lengths: Sequence[int], length: int, *, strategy: str = "best_fit", long: str = "split"
) -> list[list[Segment]]:
    """Where each document goes: per row, its ``(document, start, stop)`` segments in order.

    Args:
        lengths: each document's length (0 allowed: it is skipped).
        length: ``T``, the row length.
        strategy: ``"best_fit"`` or ``"sequential"`` (module docstring).
        long: ``"split"`` documents longer than ``T`` into pieces of ``T``, or ``"error"``.

    Raises:
        ValueError: an unknown strategy or policy, a negative length, ``T < 1``, or (with
            ``long="error"``) a document longer than ``T``, naming it.
    """
    T = positive_int("length", length)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    pieces = _pieces(lengths, T, long)
    if strategy == "sequential":
        return _sequential(pieces, T)
    return _best_fit(pieces, T)


def _pieces(lengths: Sequence[int], T: int, long: str) -> list[Segment]:
    """Each document as pieces of at most ``T`` (``long="split"``), in order."""
    if long not in LONG_POLICIES:
        raise ValueError(f"long must be one of {LONG_POLICIES}, got {long!r}")
    pieces: list[Segment] = []
    for d, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"document {d} has length {n!r}; lengths must be ints >= 0")
        if n > T and long == "error":
            raise ValueError(
                f"document {d} has {n} tokens, more than the row length T={T}; pass "
                "long='split' to cut it into pieces of T, or use longer rows"
            )
        pieces += [(d, s, min(s + T, n)) for s in range(0, n, T)]
    return pieces


def _best_fit(pieces: list[Segment], T: int) -> list[list[Segment]]:
    """Best-fit decreasing: longest first, into the row with the least free space that fits."""
    rows: list[list[Segment]] = []
    by_free: list[list[int]] = [[] for _ in range(T + 1)]  # free space -> rows with it
    for piece in sorted(pieces, key=lambda p: p[1] - p[2]):  # longest first, stable
        n = piece[2] - piece[1]
        free = next((f for f in range(n, T + 1) if by_free[f]), None)
        if free is None:
            rows.append([])
            row, free = len(rows) - 1, T
        else:
            row = by_free[free].pop()
        rows[row].append(piece)
        by_free[free - n].append(row)
    return rows


def _sequential(pieces: list[Segment], T: int) -> list[list[Segment]]:
    """In order; rows filled to ``T``, the piece that does not fit cut at the row's end."""
    rows: list[list[Segment]] = [[]]
    used = 0
    for d, start, stop in pieces:
        while start < stop:
            if used == T:
                rows.append([])
                used = 0
            take = min(stop - start, T - used)
            rows[-1].append((d, start, start + take))
            start, used = start + take, used + take
    return [r for r in rows if r]


def _as_lists(documents: object, name: str) -> list[list[int]]:
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise TypeError(f"{name} must be a sequence of token-id sequences, got "
                        f"{type(documents).__name__}")  # fmt: skip
    out = []
    for i, doc in enumerate(documents):
        if isinstance(doc, LabeledDocument):
            out.append(list(doc.ids))
            continue
        if isinstance(doc, Tensor):
            if doc.dim() != 1 or doc.is_floating_point() or doc.dtype == torch.bool:
                raise TypeError(f"{name}[{i}] must be a 1-D integer tensor, got shape "
                                f"{tuple(doc.shape)} and dtype {doc.dtype}")  # fmt: skip
            doc = doc.tolist()
        elif not isinstance(doc, Sequence) or isinstance(doc, (str, bytes)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in doc
        ):
            raise TypeError(f"{name}[{i}] must be a sequence of int token ids, got "
                            f"{type(doc).__name__}")  # fmt: skip
        out.append(list(doc))
    return out


def _labels(documents: Sequence, docs: list[list[int]]) -> list[list[int]]:
    """Each document's labels: its :class:`LabeledDocument` labels, or its tokens."""
    return [list(d.labels) if isinstance(d, LabeledDocument) else ids
            for d, ids in zip(documents, docs, strict=True)]  # fmt: skip


def _fill(rows: list[list[Segment]], docs: list[list[int]], T: int, pad_id: int,
          shift: int | None, labels: list[list[int]] | None = None
          ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """Tensors of a plan; ``shift=1`` also fills targets (``labels``, default the tokens, one
    later)."""
    labels = docs if labels is None else labels
    N = len(rows)
    tokens = torch.full((N, T), pad_id, dtype=torch.long)  # (N, T)
    doc_ids = torch.full((N, T), PAD_DOCUMENT, dtype=torch.long)  # (N, T)
    positions = torch.zeros((N, T), dtype=torch.long)  # (N, T)
    targets = None if shift is None else torch.full((N, T), IGNORE_INDEX, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for j, (d, start, stop) in enumerate(row):
            n = stop - start
            tokens[r, at : at + n] = torch.tensor(docs[d][start:stop])
            doc_ids[r, at : at + n] = j
            positions[r, at : at + n] = torch.arange(n)
            if targets is not None:
                targets[r, at : at + n] = torch.tensor(labels[d][start + 1 : stop + 1])
            at += n
        if at < T:
            positions[r, at:] = torch.arange(T - at)  # padding: a document of its own
    return tokens, doc_ids, positions, targets


def pack_documents(
    documents: Sequence[Sequence[int]] | Sequence[Tensor],
    length: int,
    *,
    strategy: str = "best_fit",
    long: str = "split",
    pad_id: int = 0,
) -> PackedRows:
    """Pack token-id documents into rows of ``length`` positions, with document ids.

    Args:
        documents: token-id lists or 1-D integer tensors (empty ones are skipped).
        length: ``T``.
        strategy: ``"best_fit"`` or ``"sequential"``.
        long: ``"split"`` or ``"error"`` for documents longer than ``T``.
        pad_id: the token written into padding.

    Returns:
        :class:`PackedRows` (``targets`` None).

    Raises:
        TypeError: documents that are not sequences of ints; ValueError: as :func:`plan_rows`.
    """
    docs = _as_lists(documents, "documents")
    rows = plan_rows([len(d) for d in docs], length, strategy=strategy, long=long)
    tokens, doc_ids, positions, _ = _fill(rows, docs, length, pad_id, None)
    return PackedRows(tokens, doc_ids, positions, None, sum(1 for d in docs if d),
                      sum(len(r) for r in rows))  # fmt: skip


def pack_lm(
    documents: Sequence[Sequence[int]] | Sequence[Tensor],
    length: int,
    *,
    packed: bool = True,
    strategy: str = "best_fit",
    long: str = "split",
    pad_id: int = 0,
) -> PackedRows:
    """Language-model rows: inputs, next-token targets and document ids.

    A document of ``n`` tokens gives ``n - 1`` positions (documents of fewer than 2 tokens
    predict nothing and are skipped); a cut piece's last target is the token after the cut.

    Args:
        documents: token-id lists, 1-D integer tensors (e.g. ``tok.encode(text,
            add_bos=True, add_eos=True)`` per document) or :class:`LabeledDocument` (targets
            from its labels).
        length: ``T``, positions per row.
        packed: pack several documents per row; False lays one document (piece) per row,
            right-padded to ``T`` (the padded baseline: no document ids are needed to run it).
        strategy, long, pad_id: as :func:`pack_documents`.

    Returns:
        :class:`PackedRows` with ``tokens`` the inputs and ``targets`` filled.

    Raises:
        TypeError, ValueError: as :func:`pack_documents`.
    """
    docs = _as_lists(documents, "documents")
    lengths = [max(0, len(d) - 1) for d in docs]
    if packed:
        rows = plan_rows(lengths, length, strategy=strategy, long=long)
    else:  # one piece per row, in document order
        rows = [[piece] for piece in _pieces(lengths, positive_int("length", length), long)]
    tokens, doc_ids, positions, targets = _fill(rows, docs, length, pad_id, 1,
                                                _labels(documents, docs))  # fmt: skip
    return PackedRows(tokens, doc_ids, positions, targets, sum(1 for n in lengths if n),
                      sum(len(r) for r in rows))  # fmt: skip
