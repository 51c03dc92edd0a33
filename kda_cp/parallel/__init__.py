"""Context parallelism, by level: the sharded KDA op with its exchange, packed-sequence metadata and
sharding helpers (cp.py, exchange.py, varlen.py, sharding.py), and one level up the model's layers
under CP (kda_cp.parallel.layers: the CPContext that :func:`parallelize` sets on them, the
short-conv halo, attention over the gathered sequence, Ulysses). Both are re-exported here.

Of the model code, only this package touches torch.distributed (the trainer's side, the dp x cp
mesh and the engines, is kda_cp.train).
"""

from kda_cp.parallel.cp import cp_chunk_kda, cp_chunk_kda_in_one_process
from kda_cp.parallel.layers import (CPContext, all_gather_sequence, causal_conv1d, cp_attention, halo_exchange,
                                    head_to_seq, parallelize, seq_to_head, ulysses_kda)
from kda_cp.parallel.sharding import gather_sequence, shard_bounds, shard_lengths, shard_sequence, split_sequence
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
