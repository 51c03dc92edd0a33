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


@pytest.mark.parametrize("final", [True, False], ids=["final-state", "no-final-state"])
@pytest.mark.parametrize("scan_method", ["sequential", "log_depth"])
@pytest.mark.parametrize("world,T,lengths,cu", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_process_cp_equals_recurrence(world, T, lengths, cu, scan_method, final):
    B = 2 if cu is None else 1
    n = B if cu is None else len(cu) - 1
    q, k, v, g, beta, _ = make_inputs(B, T, 2, 8, 6, seed=world + 7 * final)
    h0 = torch.randn(n, 2, 8, 6, dtype=torch.float64)
    do = torch.randn(B, T, 2, 6, dtype=torch.float64)
    # a non-contiguous final-state gradient (the seed of the reverse scan) with the final state
    dfinal = torch.randn(n, 2, 6, 8, dtype=torch.float64).transpose(-1, -2) if final else None
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o_ref, f_ref = naive_recurrent_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                       cu_seqlens=None if cu is None else torch.tensor(cu))
    ((o_ref * do).sum() + ((f_ref * dfinal).sum() if final else 0)).backward()
    o, final_state, grads = cp_chunk_kda_in_one_process(
        q, k, v, g, beta, world_size=world, lengths=lengths, cu_seqlens=cu, initial_state=h0,
        output_final_state=final, do=do, dfinal=dfinal, scan_method=scan_method)
    assert_close("o", o_ref, o, 1e-10)
    if final:
        assert_close("final_state", f_ref, final_state, 1e-10)
    else:
        assert final_state is None
    for name, leaf, got in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), leaves, grads):
        assert_close(name, leaf.grad, got, 1e-10)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "1"])
def test_one_process_cp_checks_the_scale(scale):
    q, k, v, g, beta, _ = make_inputs(1, 20, 2, 8, 8)
    with pytest.raises(ValueError, match="scale"):
        cp_chunk_kda_in_one_process(q, k, v, g, beta, world_size=2, scale=scale)
