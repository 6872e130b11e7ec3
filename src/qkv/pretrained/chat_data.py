"""Fine-tuning data for a pretrained decoder: conversations and plain text as token documents.

:func:`chat_document` renders a conversation with the model's own chat template and marks the
tokens to learn: each assistant turn, from the end of the template's opening of that turn
(what ``add_generation_prompt`` writes) to the end of the turn, its end-of-turn token included
(so the model learns to stop). System and user turns, and the template's framing, are context
only (:data:`~qkv.data.packing.IGNORE_INDEX` labels), as TRL's ``assistant_only_loss`` and
transformers' ``return_assistant_tokens_mask`` do.

The spans come from rendering the conversation's prefixes: the ids of the turns before an
assistant turn plus the generation prompt, and the ids through that turn, must both be
prefixes of the whole conversation's ids. Templates that rewrite earlier turns when later
ones follow break that, and are refused with a clear error rather than learned wrongly.

:func:`text_documents` cuts plain text into paragraphs, each encoded as the tokenizer frames
it and ended with the end-of-sequence token.

Shapes: ``n`` tokens of a document.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from qkv.data.files import BadFileError
from qkv.data.packing import IGNORE_INDEX, LabeledDocument, split_documents
from qkv.data.records import load_chats
from qkv.pretrained.chat import check_messages

__all__ = ["chat_document", "chat_documents", "text_documents"]


def chat_document(tokenizer: Any, messages: object) -> LabeledDocument:
    """One conversation as a :class:`~qkv.data.packing.LabeledDocument` of ``n`` tokens,
    learned on its assistant turns only.

    Args:
        tokenizer: a pretrained tokenizer with a chat template (``bundle.tokenizer``).
        messages: ``[{"role": ..., "content": ...}, ...]`` with at least one assistant turn,
            not the first message.

    Raises:
        ValueError: a tokenizer without a chat template, no assistant turn, an assistant turn
            first, or a template whose prefixes are not prefixes of the whole (see above).
        TypeError: malformed messages.
    """
    msgs = check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: fine-tune it on plain "
                         "text (--text) instead of conversations")  # fmt: skip
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("no assistant turn to learn: a conversation needs at least one "
                         "{'role': 'assistant', ...} message")  # fmt: skip
    if turns[0] == 0:
        raise ValueError("the conversation starts with an assistant turn; give the user's (or "
                         "system's) message it answers first")  # fmt: skip
    ids = tokenizer.encode_chat(msgs, add_generation_prompt=False)
    labels = [IGNORE_INDEX] * len(ids)
    for i in turns:
        start = tokenizer.encode_chat(msgs[:i], add_generation_prompt=True)
        stop = tokenizer.encode_chat(msgs[: i + 1], add_generation_prompt=False)
        if ids[: len(stop)] != stop or stop[: len(start)] != start:
            raise ValueError(f"the chat template renders message {i} differently once later "
                             "messages follow, so its tokens cannot be told apart; split the "
                             "conversation at that turn")  # fmt: skip
        labels[len(start) : len(stop)] = ids[len(start) : len(stop)]
    return LabeledDocument(ids, labels)


def chat_documents(tokenizer: Any, path: str | os.PathLike) -> list[LabeledDocument]:
    """Every conversation of a ``.jsonl`` chat file (:func:`qkv.data.records.load_chats`) as a
    :func:`chat_document`, in file order.

    Raises:
        qkv.data.files.MissingFileError: no file.
        qkv.data.files.BadFileError: a malformed line, or one :func:`chat_document` refuses,
            as ``<file>:<line>: ...``.
    """
    docs = []
    for number, messages in load_chats(path):
        try:
            docs.append(chat_document(tokenizer, messages))
        except (TypeError, ValueError) as err:
            raise BadFileError(f"{path}:{number}: {err}", path=path) from None
    return docs


def text_documents(tokenizer: Any, text: str, *, eos_id: int | None) -> list[list[int]]:
    """Plain text as token documents: paragraphs (:func:`~qkv.data.split_documents`), each
    encoded as the tokenizer frames it, then ``eos_id`` (when not None and not already last).

    Raises:
        ValueError: text with no paragraph.
    """
    paragraphs = split_documents(text)
    if not paragraphs:
        raise ValueError("the text holds no paragraph to learn (it is empty or blank)")
    docs = []
    for p in paragraphs:
        ids = list(tokenizer.encode(p))
        if eos_id is not None and (not ids or ids[-1] != eos_id):
            ids.append(eos_id)
        docs.append(ids)
    return docs


def documents_learned(docs: Sequence[LabeledDocument | Sequence[int]]) -> int:
    """Tokens the documents teach (labels not ignored; every token but the first of a plain
    document)."""
    return sum(d.learned if isinstance(d, LabeledDocument) else max(0, len(d) - 1)
               for d in docs)  # fmt: skip
