"""kda_cp: Kimi Delta Attention with exact context parallelism.

Single device: :func:`chunk_kda` (TileLang kernels on Hopper, torch elsewhere).
Sharded sequence: :func:`kda_cp.parallel.cp_chunk_kda`. Oracle: :func:`naive_recurrent_kda`.
"""

from kda_cp.ops import chunk_kda
from kda_cp.reference import naive_recurrent_kda

__all__ = ["chunk_kda", "naive_recurrent_kda"]
__version__ = "0.1.0"
