"""Sequence parallelism at the level of the model's layers: the CP context that
:func:`parallelize` sets on them, the short convolution's halo, attention over the gathered
sequence, and Ulysses (the head-parallel all-to-all). The CP op itself is one level down
(kda_cp.parallel.cp and its exchange); the trainer's mesh and engines live in kda_cp.train.
"""

from kda_cp.parallel.layers.attention import all_gather_sequence, causal_attention, cp_attention
from kda_cp.parallel.layers.context import CP_STRATEGIES, ULYSSES_IMPLS, CPContext, parallelize
from kda_cp.parallel.layers.conv import causal_conv1d, halo_exchange
from kda_cp.parallel.layers.ulysses import head_to_seq, seq_to_head, ulysses_kda

__all__ = ["CPContext", "parallelize", "CP_STRATEGIES", "ULYSSES_IMPLS", "causal_conv1d", "halo_exchange",
           "cp_attention", "causal_attention", "all_gather_sequence", "ulysses_kda", "seq_to_head", "head_to_seq"]
