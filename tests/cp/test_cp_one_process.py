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
    ("P3-empty-sequences", 3, 90, [30, 25, 35], [0, 0, 12, 12, 30, 30, 55, 70, 90, 90]),
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


def test_one_process_cp_with_negative_eigenvalues_equals_recurrence():
    """beta in (0, 2) with allow_neg_eigval: the shards' maps and their scan are unchanged."""
    q, k, v, g, beta, _ = make_inputs(1, 130, 2, 8, 6, seed=31)
    beta = 2 * beta
    assert beta.max() > 1.5
    do = torch.randn(1, 130, 2, 6, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o_ref, _ = naive_recurrent_kda(*leaves)
    (o_ref * do).sum().backward()
    with pytest.raises(ValueError, match=r"beta .* must lie in \[0, 1\]"):
        cp_chunk_kda_in_one_process(q, k, v, g, beta, world_size=3)
    o, _, grads = cp_chunk_kda_in_one_process(q, k, v, g, beta, world_size=3, lengths=[50, 1, 79], do=do,
                                              allow_neg_eigval=True)
    assert_close("o", o_ref, o, 1e-10)
    for name, leaf, got in zip(("dq", "dk", "dv", "dg", "dbeta"), leaves, grads):
        assert_close(name, leaf.grad, got, 1e-10)


def test_one_process_cp_bad_arguments_name_what_was_expected():
    q, k, v, g, beta, _ = make_inputs(1, 60, 2, 8, 6, seed=3)
    do = torch.randn(1, 60, 2, 6, dtype=torch.float64)
    dfinal = torch.randn(1, 2, 8, 6, dtype=torch.float64)
    cases = [
        (dict(world_size=2, do=torch.randn(1, 61, 2, 6, dtype=torch.float64)), r"do \(the gradient of o\) must .* \[1, 60, 2, 6\]"),
        (dict(world_size=2, do=do[..., :5]), r"do \(the gradient of o\) must"),
        (dict(world_size=2, do=do, dfinal=dfinal), "dfinal .* needs output_final_state=True and do"),
        (dict(world_size=2, output_final_state=True, dfinal=dfinal), "dfinal .* needs output_final_state=True and do"),
        (dict(world_size=2, output_final_state=True, do=do, dfinal=dfinal[..., :5]),
         r"dfinal must be a float tensor \[N, H, K, V\] = \[1, 2, 8, 6\]"),
        (dict(world_size=True), "world_size must be an int >= 1, got True"),
        (dict(world_size=2.0), "world_size must be an int >= 1, got 2.0"),
        (dict(world_size=2, lengths=[30.0, 30.0]), "lengths must be ints"),
        (dict(world_size=2, lengths=[True, 59]), "lengths must be ints"),
        (dict(world_size=2, scan_method="foo"), "scan_method must be 'sequential' or 'log_depth'"),
        (dict(world_size=2, output_final_state="yes"), "output_final_state must be a bool"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            cp_chunk_kda_in_one_process(q, k, v, g, beta, **kw)


def test_packed_row_sends_the_summary_buffer_as_it_is():
    """The all-gather row of a pair is [S | M] on the last dim. Where S and M are the two halves of
    one buffer in that order (the summary kernel's output) the row is that buffer, no copy; any
    other pair (M from elsewhere, the halves swapped, a strided buffer) is concatenated."""
    from kda_cp.parallel.cp import _packed_row
    from kda_cp.scan import AffineMap

    K, V = 4, 3
    buf = torch.randn(2, 5, K, V + K)
    row = _packed_row(AffineMap(buf[..., V:], buf[..., :V]))
    assert row.data_ptr() == buf.data_ptr() and torch.equal(row, buf)
    swapped = torch.randn(2, 5, K, K + V)  # [M | S]: M first
    wide = torch.randn(2, 5, K, V + K + 1)[..., :V + K]  # the right order, rows not contiguous
    for S, M in ((buf[..., :V], torch.randn(2, 5, K, K)), (swapped[..., K:], swapped[..., :K]),
                 (wide[..., :V], wide[..., V:])):
        row = _packed_row(AffineMap(M, S))
        assert row.is_contiguous() and torch.equal(row, torch.cat([S, M], dim=-1))
        assert row.untyped_storage().data_ptr() != S.untyped_storage().data_ptr()


@pytest.mark.parametrize("groups", [2, 4])
def test_one_process_cp_with_gva_equals_recurrence(groups):
    """GVA: v, g, beta and the states with HV = groups * H heads; dq and dk sum over each group."""
    B, T, H, K, V = 1, 150, 2, 8, 6
    HV = groups * H
    q, k, _, _, _, _ = make_inputs(B, T, H, K, V, seed=40 + groups)
    _, _, v, g, beta, _ = make_inputs(B, T, HV, K, V, seed=50 + groups)
    cu = [0, 37, 101, 150]
    h0 = torch.randn(3, HV, K, V, dtype=torch.float64)
    do = torch.randn(B, T, HV, V, dtype=torch.float64)
    dfinal = torch.randn(3, HV, K, V, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    qx, kx = (x.repeat_interleave(groups, dim=2) for x in leaves[:2])  # value head j reads key head j // groups
    o_ref, ht_ref = naive_recurrent_kda(qx, kx, *leaves[2:5], initial_state=leaves[5], output_final_state=True,
                                        cu_seqlens=torch.tensor(cu))
    ((o_ref * do).sum() + (ht_ref * dfinal).sum()).backward()
    o, ht, grads = cp_chunk_kda_in_one_process(q, k, v, g, beta, world_size=3, lengths=[60, 1, 89], cu_seqlens=cu,
                                               initial_state=h0, output_final_state=True, do=do, dfinal=dfinal)
    assert_close("o", o_ref, o, 1e-10)
    assert_close("final_state", ht_ref, ht, 1e-10)
    for name, leaf, got in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), leaves, grads):
        assert got.shape == leaf.shape, name
        assert_close(name, leaf.grad, got, 1e-10)
