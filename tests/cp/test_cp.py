"""cp_chunk_kda over gloo ranks equals the single-device result: outputs and every gradient."""

import pytest
import torch
import torch.distributed as dist

from kda_cp import naive_recurrent_kda
from kda_cp.parallel import cp_chunk_kda, shard_bounds, split_sequence
from tests._dist import run_ranks
from tests._utils import assert_close, make_inputs

# (id, world size, global T, shard lengths or None for the even split)
SCENARIOS = [
    ("P1", 1, 70, None),
    ("P2-even", 2, 128, None),
    ("P2-uneven", 2, 150, [101, 49]),
    ("P3-mid-chunk-cuts", 3, 150, [64, 23, 63]),
    ("P4-tiny-shard", 4, 150, [10, 70, 1, 69]),
]


def _cp_rank(rank, world, inputs, lengths, scan_method):
    q, k, v, g, beta, h0, do, dfinal, weights = inputs
    group = dist.group.WORLD
    local = [split_sequence(x, world, 1, lengths)[rank].clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0 = h0.clone().requires_grad_(True)
    o, final = cp_chunk_kda(*local, cp_group=group, initial_state=h0, output_final_state=True,
                            scan_method=scan_method)
    do_local = split_sequence(do, world, 1, lengths)[rank]
    # The replicated final state enters each rank's loss with a weight; the weights sum to 1.
    loss = (o * do_local).sum() + weights[rank] * (final * dfinal).sum()
    loss.backward()
    return [o.detach(), final.detach()] + [x.grad for x in local] + [h0.grad]


def _reference(inputs):
    q, k, v, g, beta, h0, do, dfinal, _ = inputs
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, final = naive_recurrent_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    ((o * do).sum() + (final * dfinal).sum()).backward()
    return o.detach(), final.detach(), [x.grad for x in leaves]


def _inputs(T, world, B=2, H=3, K=8, V=6):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, with_h0=True)
    do = torch.randn(B, T, H, V, dtype=torch.float64)
    dfinal = torch.randn(B, H, K, V, dtype=torch.float64)
    weights = torch.rand(world, dtype=torch.float64)
    return (q, k, v, g, beta, h0, do, dfinal, (weights / weights.sum()).tolist())


@pytest.mark.parametrize("world,T,lengths", [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_cp_equals_single_device(world, T, lengths):
    inputs = _inputs(T, world)
    o_ref, final_ref, grads_ref = _reference(inputs)
    results = run_ranks(_cp_rank, world, inputs, lengths, "log_depth")
    bounds = shard_bounds(T, world, lengths)
    assert_close("o", o_ref, torch.cat([r[0] for r in results], dim=1), 1e-10)
    names = ("dq", "dk", "dv", "dg", "dbeta")
    for rank, ((a, b), res) in enumerate(zip(bounds, results)):
        assert_close(f"final_state[rank {rank}]", final_ref, res[1], 1e-10)
        for name, ref, got in zip(names, grads_ref[:5], res[2:7]):
            if b > a:
                assert_close(f"{name}[rank {rank}]", ref[:, a:b], got, 1e-10)
        assert_close(f"dh0[rank {rank}]", grads_ref[5], res[7], 1e-10)


def _cp_rank_packed_summary(rank, world, inputs, lengths, scan_method):
    """_cp_rank with the summary handed out as the TileLang kernels hand it: views of one
    [..., K, V + K] buffer, S~ then M (sent without a copy; G takes the S~ half in the backward)."""
    from kda_cp.ops import TorchBackend

    plain = TorchBackend.summary_prepared

    def packed(self, prepared, opts, last_only):
        M, S = plain(self, prepared, opts, last_only)
        buf = torch.cat([S, M], dim=-1)
        return buf[..., S.shape[-1]:], buf[..., :S.shape[-1]]

    TorchBackend.summary_prepared = packed
    return _cp_rank(rank, world, inputs, lengths, scan_method)


@pytest.mark.parametrize("scan_method", ["sequential", "log_depth"])
def test_cp_with_the_summary_buffer_sent_as_it_is(scan_method):
    inputs = _inputs(150, 4)
    o_ref, final_ref, grads_ref = _reference(inputs)
    lengths = [40, 30, 50, 30]
    results = run_ranks(_cp_rank_packed_summary, 4, inputs, lengths, scan_method)
    assert_close("o", o_ref, torch.cat([r[0] for r in results], dim=1), 1e-10)
    for rank, ((a, b), res) in enumerate(zip(shard_bounds(150, 4, lengths), results)):
        assert_close(f"final_state[rank {rank}]", final_ref, res[1], 1e-10)
        for name, ref, got in zip(("dq", "dk", "dv", "dg", "dbeta"), grads_ref[:5], res[2:7]):
            assert_close(f"{name}[rank {rank}]", ref[:, a:b], got, 1e-10)
        assert_close(f"dh0[rank {rank}]", grads_ref[5], res[7], 1e-10)


def test_scan_methods_agree():
    inputs = _inputs(150, 3)
    seq = run_ranks(_cp_rank, 3, inputs, [40, 60, 50], "sequential")
    tree = run_ranks(_cp_rank, 3, inputs, [40, 60, 50], "log_depth")
    for rank in range(3):
        for a, b in zip(seq[rank], tree[rank]):
            assert_close(f"rank {rank}", a, b, 1e-12)


def _error_rank(rank, world, case):
    q, k, v, g, beta, h0 = make_inputs(1, 40, 2, 8, 4, with_h0=True)
    group = dist.group.WORLD
    if case == "bad-g-on-rank-1" and rank == 1:
        g = g[..., 0]
    if case == "ranks-disagree-on-H" and rank == 0:
        q, k, v, g, beta = (x[:, :, :1] for x in (q, k, v, g, beta))
        h0 = h0[:, :1]
    if case == "bad-initial-state":
        h0 = h0[:, :, :3]
    kwargs = {}
    if case == "bad-backend-on-rank-1" and rank == 1:
        kwargs["backend"] = "bogus"
    if case == "nan-scale-on-rank-1" and rank == 1:
        kwargs["scale"] = float("nan")
    if case == "not-in-group":
        group = dist.new_group(ranks=[0])
        if rank == 0:
            return "skipped"
    if case == "cp-group-none":  # would give each rank its shard's single-device answer
        group = None
    try:
        cp_chunk_kda(q, k, v, g, beta, cp_group=group, initial_state=h0, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case,expect", [
    ("bad-backend-on-rank-1", [r"rank\(s\) \[1\]", r"rank 1: backend must be one of"]),
    ("nan-scale-on-rank-1", [r"rank\(s\) \[1\]", r"rank 1: scale must be a finite number"]),
    ("bad-g-on-rank-1", [r"rank\(s\) \[1\]", r"rank 1: g must be the per-channel log decay"]),
    ("ranks-disagree-on-H", ["ranks disagree", "ranks disagree"]),
    ("bad-initial-state", [r"initial_state must be \[N, H, K, V\]"] * 2),
    ("not-in-group", ["skipped", r"global rank 1 of 2\) is not a member of the given cp_group: call it only"]),
    ("cp-group-none", [r"cp_group=None in an initialized process group of 2 ranks"] * 2),
])
def test_bad_input_raises_on_every_rank(case, expect):
    import re

    messages = run_ranks(_error_rank, 2, case, timeout=90)
    for rank, (msg, pattern) in enumerate(zip(messages, expect)):
        assert re.search(pattern, msg), f"rank {rank}: {msg!r} does not match {pattern!r}"


def _mutation_rank(rank, world):
    # one seed on every rank: initial_state is replicated, and the ranks check that it agrees
    q, k, v, g, beta, h0 = make_inputs(1, 40, 2, 8, 4, with_h0=True, seed=5)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta)]
    _, final = cp_chunk_kda(*leaves, cp_group=dist.group.WORLD, initial_state=h0, output_final_state=True)
    grad = torch.ones_like(final)
    torch.autograd.backward([final], [grad])
    return grad


def test_backward_leaves_the_callers_gradient_untouched():
    for grad in run_ranks(_mutation_rank, 2):
        assert torch.equal(grad, torch.ones_like(grad))


def _option_mismatch_rank(rank, world, case):
    q, k, v, g, beta, _ = make_inputs(1, 32, 2, 8, 4)
    kwargs = {}
    if case == "exchange":
        kwargs["exchange"] = "p2p" if rank else "allgather"
    if case == "cu_seqlens":
        kwargs["cu_seqlens"] = torch.tensor([0, 64] if rank == 0 else [0, 9, 64])
    if case == "cu_seqlens-same-count-and-weighted-sum":  # equal length and sum((i + 1) * c): a weak check's blind spot
        kwargs["cu_seqlens"] = torch.tensor([0, 2, 6, 8, 64] if rank == 0 else [0, 3, 4, 9, 64])
    if case == "scale":
        kwargs["scale"] = 0.5 if rank else 0.25
    if case == "initial_state":  # one element differs by one ulp on rank 1
        h0 = torch.randn(1, 2, 8, 4, dtype=q.dtype, generator=torch.Generator().manual_seed(3))
        if rank == 1:
            h0[0, 1, 2, 3] = torch.nextafter(h0[0, 1, 2, 3], torch.tensor(1.0, dtype=h0.dtype))
        kwargs["initial_state"] = h0
    try:
        cp_chunk_kda(q, k, v, g, beta, cp_group=dist.group.WORLD, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case", ["exchange", "cu_seqlens", "cu_seqlens-same-count-and-weighted-sum", "scale",
                                  "initial_state"])
def test_ranks_that_disagree_on_options_raise_instead_of_hanging(case):
    for rank, msg in enumerate(run_ranks(_option_mismatch_rank, 2, case, timeout=90)):
        assert "ranks disagree on the options" in msg, f"rank {rank}: {msg!r}"
        assert case.split("-")[0] in msg.split("[")[1], f"rank {rank}: {msg!r} does not name {case}"


def _signed_zero_rank(rank, world):
    # initial_state equal on both ranks, with -0.0 on rank 1 where rank 0 holds +0.0
    leaves = make_inputs(1, 48, 2, 8, 4, seed=5)[:5]
    h0 = torch.randn(1, 2, 8, 4, dtype=leaves[0].dtype, generator=torch.Generator().manual_seed(4))
    h0[0, 0, :3] = -0.0 if rank else 0.0
    local = [split_sequence(x, world, 1)[rank] for x in leaves]
    _, final = cp_chunk_kda(*local, cp_group=dist.group.WORLD, initial_state=h0, output_final_state=True)
    return final


def test_initial_states_equal_up_to_the_sign_of_zero_agree():
    finals = run_ranks(_signed_zero_rank, 2, timeout=90)
    assert torch.equal(finals[0], finals[1])


def _double_backward_rank(rank, world):
    q, k, v, g, beta, h0 = make_inputs(1, 40, 2, 8, 4, with_h0=True, requires_grad=True, seed=0)
    local = [split_sequence(x, world, 1)[rank] for x in (q, k, v, g, beta)]
    o, final = cp_chunk_kda(*local, cp_group=dist.group.WORLD, initial_state=h0, output_final_state=True)
    loss = (o * torch.randn_like(o)).sum() + (final * torch.randn_like(final)).sum()
    try:
        torch.autograd.grad(loss, (q, h0), create_graph=True, retain_graph=True)
    except NotImplementedError as exc:
        message = str(exc)
    else:
        message = "no error"
    dq, dh0 = torch.autograd.grad(loss, (q, h0))  # first order through the same graph still runs
    return message, bool(dh0.abs().sum() > 0)


def test_double_backward_raises_on_every_rank():
    for rank, (msg, first_order) in enumerate(run_ranks(_double_backward_rank, 2)):
        assert msg.startswith("cp_chunk_kda: double backward (create_graph=True)"), f"rank {rank}: {msg!r}"
        assert first_order


def _non_member_rank(rank, world):
    from kda_cp.parallel import causal_conv1d, ulysses_kda

    group = dist.new_group(ranks=[0])  # collective: every rank creates it, rank 1 is outside
    if rank == 0:
        return []
    q, k, v, g, beta, _ = make_inputs(1, 16, 2, 8, 4, seed=0)
    x, w = torch.randn(1, 16, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    calls = [lambda: cp_chunk_kda(q, k, v, g, beta, cp_group=group),
             lambda: ulysses_kda(q, k, v, g, beta, cp_group=group),
             lambda: causal_conv1d(x, w, cp_group=group)]
    out = []
    for call in calls:
        try:
            call()
        except ValueError as exc:
            out.append(str(exc))
        else:
            out.append("no error")
    return out


def test_a_rank_outside_the_group_is_told_so():
    """Every distributed op called with a group this rank is not in: the error says so (torch
    hands non-members a placeholder whose size reads -1)."""
    for msg in run_ranks(_non_member_rank, 2)[1]:
        assert "(global rank 1 of 2) is not a member of the given cp_group" in msg and "-1" not in msg, msg


@pytest.mark.parametrize("group", ["world", 3, object()], ids=["str", "int", "object"])
def test_a_cp_group_that_is_not_a_process_group_is_refused(group):
    """Without an initialized process group, a string or an int as cp_group used to run as no CP."""
    q, k, v, g, beta, _ = make_inputs(1, 20, 2, 8, 8, seed=5)
    with pytest.raises(ValueError, match="cp_group must be a torch.distributed ProcessGroup or None"):
        cp_chunk_kda(q, k, v, g, beta, cp_group=group)
