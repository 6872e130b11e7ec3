"""Structured output: a request's text held to a grammar (a JSON schema, any JSON object, a
regular expression, a choice of strings, or a Lark grammar) by a mask over the vocabulary at
every step.

The grammar engine is llguidance (Microsoft's Rust library behind Guidance; chosen over
xgrammar on ``benchmarks/grammar_engines.py``: a schema compiles in about 1 ms against 4-5 ms,
a mask takes 0.01 ms of a decoding step of tens of ms, and it reads a ``tokenizers`` tokenizer
as it is, with no other dependency). It is imported when a grammar is first used
(``pip install llguidance``).

* :class:`Grammar`: what the text must match, a frozen record (a field of
  :class:`~qkv.generate.engine.SamplingParams`), checked when made.
* :class:`GrammarVocabulary`: the tokenizer's tables for the engine, built once (~0.2 s for
  49,152 tokens).
* :class:`Constraint`: one request's state: the allowed tokens of its next step, advanced by
  each token chosen. EOS is allowed exactly where the text may end; where it cannot go on,
  :attr:`Constraint.finished` says so and the request ends.

JSON is written compactly, with ``", "`` and ``": "`` between items (no free whitespace: a
small model would otherwise spend its tokens on blank lines).

Shapes: ``V`` vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qkv.generate.args import ParamError

__all__ = ["KINDS", "Constraint", "Grammar", "GrammarVocabulary"]

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _engine() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ImportError("structured output needs llguidance: pip install llguidance "
                          "(or 'qkv[serve]')") from None  # fmt: skip
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a request's text must match.

    Attributes:
        kind: ``"json_schema"`` (``source``: the schema as JSON text), ``"json_object"`` (any
            JSON object; ``source`` ignored), ``"regex"`` (the whole text matches ``source``,
            Rust's regex syntax), ``"choice"`` (``source``: a JSON array of strings, the text
            is one of them) or ``"lark"`` (``source``: a Lark grammar, llguidance's dialect).
        source: as ``kind`` says.

    Raises:
        ParamError: (``param`` ``"grammar"``) an unknown kind, or a source llguidance refuses
            (its message kept); ImportError without llguidance.
    """

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ParamError("grammar", f" kind must be one of {', '.join(KINDS)}, got "
                             f"{self.kind!r}")  # fmt: skip
        if not isinstance(self.source, str):
            raise ParamError("grammar", f" source must be text, got {type(self.source).__name__}")
        error = _engine().LLMatcher.validate_grammar(self.compiled())
        if error:
            raise ParamError("grammar", f" ({self.kind}) is not one llguidance takes: {error}")

    def compiled(self) -> str:
        """The grammar in llguidance's form."""
        matcher = _engine().LLMatcher
        if self.kind in ("json_schema", "json_object"):
            schema = {"type": "object"} if self.kind == "json_object" else _schema(self.source)
            return matcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            return "start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                          for c in _choices(self.source))  # fmt: skip
        return self.source


def _schema(source: str) -> dict:
    try:
        schema = json.loads(source)
    except ValueError as err:
        raise ParamError("grammar", f" (json_schema) must be JSON text, got a parse error: "
                         f"{err}") from None  # fmt: skip
    if not isinstance(schema, dict):
        raise ParamError("grammar", f" (json_schema) must be a JSON object, got {source:.60}")
    return schema


def _choices(source: str) -> list[str]:
    try:
        choices = json.loads(source)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(
            isinstance(c, str) and c for c in choices):  # fmt: skip
        raise ParamError("grammar", f" (choice) must be a JSON array of non-empty strings, got "
                         f"{source:.60}")  # fmt: skip
    return choices


class GrammarVocabulary:
    """A tokenizer's tables for grammars: built once, shared by every request.

    Args:
        tokenizer_json: the ``tokenizers`` tokenizer as JSON text (``Tokenizer.to_str()``).
        eos_id: the end token (allowed where the text may end).
        vocab_size: ``V``, the model's output width (ids at or past the tokenizer's are
            never allowed).
    """

    def __init__(self, tokenizer_json: str, eos_id: int | None, vocab_size: int) -> None:
        llguidance = _engine()
        self.tables = llguidance.LLTokenizer(tokenizer_json, eos_token=eos_id)
        self.eos_id, self.vocab_size = eos_id, vocab_size
        self.bits = torch.arange(32, dtype=torch.int32)  # (32,)

    @classmethod
    def of(cls, tokenizer: Any, eos_id: int | None, vocab_size: int) -> GrammarVocabulary:
        """From a :class:`~qkv.pretrained.tokenizer.PretrainedTokenizer` (its ``backend``).

        Raises:
            ValueError: a tokenizer without a ``tokenizers`` backend.
        """
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise ValueError(f"grammars need a tokenizers tokenizer, got "
                             f"{type(tokenizer).__name__}")  # fmt: skip
        return cls(backend.to_str(), eos_id, vocab_size)


class Constraint:
    """One request's grammar state.

    Args:
        vocabulary: the engine's :class:`GrammarVocabulary`.
        grammar: what the text must match.
    """

    def __init__(self, vocabulary: GrammarVocabulary, grammar: Grammar) -> None:
        llguidance = _engine()
        self.vocabulary = vocabulary
        self.matcher = llguidance.LLMatcher(vocabulary.tables, grammar.compiled())
        words = -(-vocabulary.tables.vocab_size // 32)
        self.bitmask = torch.zeros((1, words), dtype=torch.int32)  # (1, ceil(V' / 32))

    @property
    def finished(self) -> bool:
        """The text is complete and cannot go on: only the end is left."""
        return self.matcher.is_stopped()

    def allowed(self) -> Tensor:
        """``(V,)`` bool: the tokens the next step may choose.

        Raises:
            RuntimeError: the grammar allows nothing (llguidance's error kept).
        """
        # llguidance writes the bits into our buffer (what llguidance.torch's helper does;
        # that module is not imported: it compiles and scripts functions at import).
        row = self.bitmask[0]  # (words,) int32, contiguous, on the CPU
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        v = self.vocabulary
        bits = ((self.bitmask[0, :, None] >> v.bits) & 1).reshape(-1).bool()  # (32·words,)
        allowed = torch.zeros(v.vocab_size, dtype=torch.bool)
        n = min(v.vocab_size, v.tables.vocab_size)
        allowed[:n] = bits[:n]
        if not bool(allowed.any()):
            raise RuntimeError(f"the grammar allows no next token: {self.matcher.get_error()}")
        return allowed

    def advance(self, token: int) -> None:
        """The token chosen (one :meth:`allowed` allowed).

        Raises:
            RuntimeError: the grammar refuses it.
        """
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
