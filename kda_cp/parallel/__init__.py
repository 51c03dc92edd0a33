"""Context parallelism: the sharded KDA op, sharding helpers and the exchange.

Only this package touches torch.distributed.
"""

from kda_cp.parallel.conv import causal_conv1d, halo_exchange, shard_lengths
from kda_cp.parallel.cp import cp_chunk_kda
from kda_cp.parallel.sharding import gather_sequence, shard_bounds, shard_sequence, split_sequence
from kda_cp.parallel.varlen import ShardSegments, shard_segments

__all__ = [
    "causal_conv1d",
    "halo_exchange",
    "shard_lengths",
    "cp_chunk_kda",
    "gather_sequence",
    "shard_bounds",
    "shard_sequence",
    "split_sequence",
    "ShardSegments",
    "shard_segments",
]
