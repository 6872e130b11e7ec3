"""qkv across processes, on ``torch.distributed`` (launched by ``torchrun``).

Context parallelism (the sequence split across ranks):

* :func:`ring_attention`: keys and values travel round a ring, partial results merged by
  log-sum-exp, its own backward;
* :func:`all_to_all_attention`: heads exchanged for sequence (DeepSpeed-Ulysses style);
* :func:`shard_sequence` / :func:`gather_sequence` / :func:`sequence_positions`: the layout;
* :func:`context_parallel`: run a model (``DecoderLM``, ``Encoder``) with its sequence
  sharded; :func:`explain` says which method serves a call and what each rank sends.
"""

from qkv.distributed.context import (
    ContextParallel,
    Explanation,
    choose_method,
    context_parallel,
    explain,
)
from qkv.distributed.layout import (
    chunk_bounds,
    gather_sequence,
    sequence_positions,
    shard_sequence,
)
from qkv.distributed.ring import ring_attention
from qkv.distributed.ulysses import all_to_all_attention

__all__ = [
    "ContextParallel",
    "Explanation",
    "all_to_all_attention",
    "choose_method",
    "chunk_bounds",
    "context_parallel",
    "explain",
    "gather_sequence",
    "ring_attention",
    "sequence_positions",
    "shard_sequence",
]
