"""Packed sequences across CP ranks (gloo): outputs, per-sequence states and every gradient equal
the single-device result; both exchange strategies agree; results are deterministic."""

import re

import pytest
import torch
import torch.distributed as dist

from kda_cp import naive_recurrent_kda
from kda_cp.parallel import cp_chunk_kda, shard_bounds, split_sequence
from kda_cp.parallel.varlen import shard_segments
from tests._dist import run_ranks
from tests._utils import assert_close, make_inputs

# (id, world size, shard lengths, global cu_seqlens, exchange)
SCENARIOS = [
    ("P1-packed", 1, [90], [0, 15, 70, 90], "allgather"),
    ("P2-boundary-inside", 2, [75, 75], [0, 40, 150], "allgather"),
    ("P3-boundary-on-shard-edges", 3, [50, 50, 50], [0, 50, 120, 150], "p2p"),
    ("P4-one-sequence-over-three-ranks", 4, [40, 40, 40, 40], [0, 10, 130, 160], "allgather"),
    ("P5-many-short-uneven", 5, [21, 19, 30, 1, 29], [0, 3, 7, 20, 21, 45, 60, 61, 99, 100], "p2p"),
    ("P8-single-sequence", 8, [12] * 8, [0, 96], "p2p"),
    ("P8-mixed", 8, [5, 17, 9, 20, 11, 3, 30, 15], [0, 22, 23, 64, 65, 66, 80, 110], "allgather"),
    # empty sequences first, last, inside a shard and on shard edges (30, 55): each keeps its state
    ("P3-empty-sequences", 3, [30, 25, 35], [0, 0, 12, 12, 30, 30, 55, 70, 90, 90], "allgather"),
    ("P4-empty-sequences-p2p", 4, [20, 20, 30, 20], [0, 20, 20, 20, 33, 40, 40, 90], "p2p"),
]


def _rank_fn(rank, world, inputs, lengths, cu, exchange, repeat):
    q, k, v, g, beta, h0, do, dfinal, weights = inputs
    runs = []
    for _ in range(repeat):
        local = [split_sequence(x, world, 1, lengths)[rank].clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        h = h0.clone().requires_grad_(True)
        o, final = cp_chunk_kda(*local, cp_group=dist.group.WORLD, initial_state=h, output_final_state=True,
                                cu_seqlens=torch.tensor(cu), exchange=exchange)
        do_local = split_sequence(do, world, 1, lengths)[rank]
        ((o * do_local).sum() + weights[rank] * (final * dfinal).sum()).backward()
        runs.append([o.detach(), final.detach()] + [x.grad for x in local] + [h.grad])
    return runs


def _reference(inputs, cu):
    q, k, v, g, beta, h0, do, dfinal, _ = inputs
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, final = naive_recurrent_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                   cu_seqlens=torch.tensor(cu))
    ((o * do).sum() + (final * dfinal).sum()).backward()
    return o.detach(), final.detach(), [x.grad for x in leaves]


def _inputs(T, n_seq, world, H=2, K=8, V=6):
    q, k, v, g, beta, _ = make_inputs(1, T, H, K, V)
    h0 = torch.randn(n_seq, H, K, V, dtype=torch.float64)
    do = torch.randn(1, T, H, V, dtype=torch.float64)
    dfinal = torch.randn(n_seq, H, K, V, dtype=torch.float64)
    w = torch.rand(world, dtype=torch.float64)
    return (q, k, v, g, beta, h0, do, dfinal, (w / w.sum()).tolist())


@pytest.mark.parametrize("world,lengths,cu,exchange", [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_packed_cp_equals_single_device(world, lengths, cu, exchange):
    T = sum(lengths)
    inputs = _inputs(T, len(cu) - 1, world)
    o_ref, final_ref, grads_ref = _reference(inputs, cu)
    results = [r[0] for r in run_ranks(_rank_fn, world, inputs, lengths, cu, exchange, 1)]
    assert_close("o", o_ref, torch.cat([r[0] for r in results], dim=1), 1e-10)
    for rank, ((a, b), res) in enumerate(zip(shard_bounds(T, world, lengths), results)):
        assert_close(f"final_state[rank {rank}]", final_ref, res[1], 1e-10)
        for name, ref, got in zip(("dq", "dk", "dv", "dg", "dbeta"), grads_ref[:5], res[2:7]):
            assert_close(f"{name}[rank {rank}]", ref[:, a:b], got, 1e-10)
        assert_close(f"dh0[rank {rank}]", grads_ref[5], res[7], 1e-10)


def test_strategies_agree_and_runs_are_deterministic():
    lengths, cu = [21, 19, 30, 1, 29], [0, 3, 7, 20, 21, 45, 60, 61, 99, 100]
    inputs = _inputs(100, len(cu) - 1, 5)
    by_strategy = {}
    for exchange in ("allgather", "p2p"):
        per_rank = run_ranks(_rank_fn, 5, inputs, lengths, cu, exchange, 2)
        for rank, (first, second) in enumerate(per_rank):
            for a, b in zip(first, second):
                assert torch.equal(a, b), f"{exchange}: rank {rank} differs between two identical runs"
        by_strategy[exchange] = [r[0] for r in per_rank]
    for rank in range(5):
        for a, b in zip(by_strategy["allgather"][rank], by_strategy["p2p"][rank]):
            assert_close(f"allgather vs p2p, rank {rank}", a, b, 1e-12)


def test_shard_segments():
    cu = [0, 10, 130, 160]
    s = shard_segments(cu, 40, 80)
    assert s.cu_seqlens == (0, 40) and s.seq_ids == (1,) and s.first_continues and s.chained and s.ends == (False,)
    s = shard_segments(cu, 0, 40)
    assert s.cu_seqlens == (0, 10, 40) and s.seq_ids == (0, 1) and not s.first_continues and s.ends == (True, False)
    s = shard_segments(cu, 120, 160)
    assert s.cu_seqlens == (0, 10, 40) and s.seq_ids == (1, 2) and s.first_continues and s.ends == (True, True)
    assert s.starts == (False, True)
    s = shard_segments([0, 50, 100], 50, 100)
    assert s.seq_ids == (1,) and not s.first_continues and not s.chained


def _bad_rank(rank, world, case):
    q, k, v, g, beta, _ = make_inputs(1, 30, 2, 8, 4)
    cu = [0, 12, 60]
    if case == "not-increasing":
        cu = [0, 40, 12, 60]
    if case == "not-from-zero":
        cu = [3, 12, 60]
    if case == "wrong-total":
        cu = [0, 12, 59]
    if case == "disagreeing-lengths" and rank == 1:
        q, k, v, g, beta = (x[:, :29] for x in (q, k, v, g, beta))
    h0 = None
    if case == "nan-initial-state":
        h0 = torch.randn(len(cu) - 1, 2, 8, 4, dtype=q.dtype)
        h0[1, 0, 3, 2] = float("nan")
    try:
        cp_chunk_kda(q, k, v, g, beta, cp_group=dist.group.WORLD, cu_seqlens=torch.tensor(cu), initial_state=h0)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case,pattern", [
    ("not-increasing", "must not decrease"),
    ("not-from-zero", "must start at 0"),
    ("wrong-total", r"ends at 59 but the ranks hold \[30, 30\]"),
    ("disagreeing-lengths", r"ends at 60 but the ranks hold \[30, 29\]"),
    ("nan-initial-state", "initial_state must be finite"),
])
def test_bad_cu_seqlens_raise_on_every_rank(case, pattern):
    for rank, msg in enumerate(run_ranks(_bad_rank, 2, case, timeout=90)):
        assert re.search(pattern, msg), f"rank {rank}: {msg!r}"


@pytest.mark.parametrize("h0,pattern", [(lambda HV: torch.randn(3, 1, 16, 12), r"= \[3, 4, 16, 12\] with N = 3 sequences"),
                                        (lambda HV: torch.randn(2, HV, 16, 12), r"= \[3, 4, 16, 12\] with N = 3 sequences"),
                                        (lambda HV: torch.randn(3, HV, 12, 16), r"= \[3, 4, 16, 12\] with N = 3 sequences"),
                                        (lambda HV: [1.0, 2.0], "initial_state must be a torch.Tensor, got list")],
                         ids=["heads", "sequences", "k-v-swapped", "not-a-tensor"])
def test_packed_initial_state_error_names_the_shape_expected(h0, pattern):
    """With cu_seqlens the states are [N sequences, HV, K, V] (GVA: v's heads), and the error says so."""
    T, H, HV, K, V = 80, 2, 4, 16, 12
    q, k = torch.randn(1, T, H, K), torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1)
    v, g, beta = torch.randn(1, T, HV, V), -torch.rand(1, T, HV, K), torch.rand(1, T, HV)
    with pytest.raises(ValueError, match=pattern):
        cp_chunk_kda(q, k, v, g, beta, cp_group=None, cu_seqlens=[0, 30, 30, 80], initial_state=h0(HV))
