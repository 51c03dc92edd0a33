"""The CP algorithm with all shards in one process (the path the GPU kernels are checked on)."""

import pytest
import torch

from kda_cp import naive_recurrent_kda
from kda_cp.parallel.cp import cp_chunk_kda_in_one_process
from tests._utils import assert_close, make_inputs

CASES = [
    # id, world size, T, shard lengths, cu_seqlens
    ("P3-dense-uneven", 3, 150, [64, 23, 63], None),
    ("P4-packed", 4, 160, [40, 40, 40, 40], [0, 10, 130, 140, 160]),
    ("P5-packed-edges", 5, 100, [21, 19, 30, 1, 29], [0, 3, 7, 20, 21, 45, 60, 61, 99, 100]),
]


@pytest.mark.parametrize("world,T,lengths,cu", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_process_cp_equals_recurrence(world, T, lengths, cu):
    B = 2 if cu is None else 1
    n = B if cu is None else len(cu) - 1
    q, k, v, g, beta, _ = make_inputs(B, T, 2, 8, 6)
    h0 = torch.randn(n, 2, 8, 6, dtype=torch.float64)
    do = torch.randn(B, T, 2, 6, dtype=torch.float64)
    dfinal = torch.randn(n, 2, 8, 6, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o_ref, f_ref = naive_recurrent_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                       cu_seqlens=None if cu is None else torch.tensor(cu))
    ((o_ref * do).sum() + (f_ref * dfinal).sum()).backward()
    o, final, grads = cp_chunk_kda_in_one_process(q, k, v, g, beta, world_size=world, lengths=lengths, cu_seqlens=cu,
                                                  initial_state=h0, output_final_state=True, do=do, dfinal=dfinal)
    assert_close("o", o_ref, o, 1e-10)
    assert_close("final_state", f_ref, final, 1e-10)
    for name, leaf, got in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), leaves, grads):
        assert_close(name, leaf.grad, got, 1e-10)
