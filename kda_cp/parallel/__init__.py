"""Context parallelism: the sharded KDA op, sharding helpers, the exchange, and the sequence-parallel
pieces of a model (short-conv halo, attention over the gathered sequence, Ulysses), and the
CPContext that :func:`parallelize` sets on a model's layers.

Of the model code, only this package touches torch.distributed (the trainer's side, the dp x cp
mesh and the engines, is kda_cp.train).
"""

from kda_cp.parallel.attention import all_gather_sequence, cp_attention
from kda_cp.parallel.context import CPContext, parallelize
from kda_cp.parallel.conv import causal_conv1d, halo_exchange
from kda_cp.parallel.cp import cp_chunk_kda, cp_chunk_kda_in_one_process
from kda_cp.parallel.sharding import gather_sequence, shard_bounds, shard_lengths, shard_sequence, split_sequence
from kda_cp.parallel.ulysses import head_to_seq, seq_to_head, ulysses_kda
from kda_cp.parallel.varlen import ShardSegments, shard_segments

__all__ = [
    "CPContext",
    "parallelize",
    "cp_chunk_kda",
    "cp_chunk_kda_in_one_process",
    "causal_conv1d",
    "halo_exchange",
    "shard_lengths",
    "cp_attention",
    "all_gather_sequence",
    "ulysses_kda",
    "seq_to_head",
    "head_to_seq",
    "gather_sequence",
    "shard_bounds",
    "shard_sequence",
    "split_sequence",
    "ShardSegments",
    "shard_segments",
]
