"""Data for training and trying qkv models: tokenizers, synthetic tasks, corpora, batching.

* :mod:`~qkv.data.tokenizers`: :class:`CharTokenizer`, :class:`ByteTokenizer`,
  :func:`load_tokenizer`; every tokenizer has PAD=0, BOS=1, EOS=2, UNK=3 (the ids and the
  :class:`Tokenizer` protocol live in :mod:`~qkv.data.tokenizer_base`).
  :mod:`~qkv.data.subword`: :class:`BPETokenizer`, :class:`WordPieceTokenizer` (need
  ``pip install 'qkv[tokenizers]'``).
* :mod:`~qkv.data.tasks`: :func:`make_task` for copy, reverse, sort, addition and date
  normalisation (:mod:`~qkv.data.dates`), seeded, with disjoint splits.
* :mod:`~qkv.data.text`: :func:`load_text`, :func:`stdlib_corpus`, :func:`train_valid_split`.
* :mod:`~qkv.data.parallel`: :func:`load_pairs_tsv`, :func:`gettext_pairs`.
* :mod:`~qkv.data.packing`: :func:`pack_documents`, :func:`pack_lm` (variable-length
  documents packed into fixed-length rows with document ids; no padding inside a row),
  :class:`LabeledDocument` (a document learned only on some tokens, e.g. a chat's replies).
* :mod:`~qkv.data.batching`: :func:`encode_pairs`, :func:`bucket_batches`, :func:`lm_batches`,
  :func:`pad_rows`.
* :mod:`~qkv.data.files`: :func:`~qkv.data.files.read_json`, :func:`~qkv.data.files.read_toml`
  (one reader each, errors naming the file).

Corpora are read from the machine at run time and never stored in the repository.
"""

from qkv.data.batching import (
    Example,
    LMBatch,
    Seq2SeqBatch,
    bucket_batches,
    collate,
    encode_pairs,
    lm_batches,
    pad_rows,
)
from qkv.data.datasets import dataset_documents, dataset_pairs
from qkv.data.packing import (
    LabeledDocument,
    PackedRows,
    pack_documents,
    pack_lm,
    split_documents,
)
from qkv.data.parallel import gettext_catalogues, gettext_pairs, load_pairs_tsv
from qkv.data.records import load_pairs, load_records_text
from qkv.data.subword import BPETokenizer, WordPieceTokenizer
from qkv.data.tasks import SPLITS, TASKS, Task, make_task
from qkv.data.text import MissingData, load_text, stdlib_corpus, train_valid_split
from qkv.data.tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "SPLITS",
    "TASKS",
    "UNK_ID",
    "BPETokenizer",
    "ByteTokenizer",
    "CharTokenizer",
    "Example",
    "LMBatch",
    "LabeledDocument",
    "MissingData",
    "PackedRows",
    "Seq2SeqBatch",
    "Task",
    "Tokenizer",
    "WordPieceTokenizer",
    "bucket_batches",
    "collate",
    "dataset_documents",
    "dataset_pairs",
    "encode_pairs",
    "gettext_catalogues",
    "gettext_pairs",
    "lm_batches",
    "load_pairs",
    "load_pairs_tsv",
    "load_records_text",
    "load_text",
    "load_tokenizer",
    "make_task",
    "pack_documents",
    "pack_lm",
    "pad_rows",
    "split_documents",
    "stdlib_corpus",
    "train_valid_split",
]
