"""qkv across processes, on ``torch.distributed`` (launched by ``torchrun``).

Context parallelism (the sequence split across ranks):

* :func:`ring_attention`: keys and values travel round a ring, partial results merged by
  log-sum-exp, its own backward;
* :func:`all_to_all_attention`: heads exchanged for sequence (DeepSpeed-Ulysses style);
* :func:`shard_sequence` / :func:`gather_sequence` / :func:`sequence_positions`: the layout;
* :func:`context_parallel`: run a model (``DecoderLM``, ``Encoder``) with its sequence
  sharded; :func:`explain_parallel` says which method serves a call and what each rank sends.

Data parallelism (what ``qkv.train`` uses under ``torchrun``): :func:`init_distributed`,
:class:`World`, :func:`wrap_ddp`, :func:`shard_fsdp` (FSDP2), batch shares, reductions, full
state dicts gathered for checkpoints, :class:`PeerError` when another rank fails.
"""

from qkv.distributed.context import (
    ContextParallel,
    ParallelPlan,
    choose_method,
    context_parallel,
    explain_parallel,
)
from qkv.distributed.data_parallel import (
    PeerError,
    World,
    all_gather_json,
    all_reduce_sum,
    barrier,
    current_world,
    init_distributed,
    launched,
    share,
    shutdown,
    slice_rows,
)
from qkv.distributed.dp_model import (
    full_model_state,
    full_optimizer_state,
    gradient_sync,
    load_optimizer_state,
    shard_fsdp,
    wrap_ddp,
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
    "ParallelPlan",
    "PeerError",
    "World",
    "all_gather_json",
    "all_reduce_sum",
    "all_to_all_attention",
    "barrier",
    "choose_method",
    "chunk_bounds",
    "context_parallel",
    "current_world",
    "explain_parallel",
    "full_model_state",
    "full_optimizer_state",
    "gather_sequence",
    "gradient_sync",
    "init_distributed",
    "launched",
    "load_optimizer_state",
    "ring_attention",
    "sequence_positions",
    "shard_fsdp",
    "shard_sequence",
    "share",
    "shutdown",
    "slice_rows",
    "wrap_ddp",
]
