"""Grouped value attention (v with HV = a multiple of H heads) and negative eigenvalues (beta in
[0, 2], allow_neg_eigval) through chunk_kda and cp_chunk_kda, against the fp64 per-token
recurrence on the key heads repeated per group; CP over gloo with packed sequences crossing ranks,
with the bounded gate and with general gates (g_min=None)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from kda_cp import chunk_kda, naive_recurrent_kda
from kda_cp.parallel import cp_chunk_kda, split_sequence

from tests._dist import run_ranks
from tests._utils import assert_close, make_inputs

TOL = 1e-10


def _inputs(T, H, groups, n_seq, neg_eigval, seed, K=8, V=6):
    """q, k with H heads; v, g, beta, states with HV = H * groups; beta in (0, 2) when neg_eigval."""
    HV = H * groups
    q, k, v, g, beta, _ = make_inputs(1, T, HV, K, V, seed=seed)
    q, k = q[:, :, :H].contiguous(), k[:, :, :H].contiguous()
    if neg_eigval:
        beta = 2 * beta
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.randn(n_seq, HV, K, V, generator=gen, dtype=torch.float64)
    do = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    dfinal = torch.randn(n_seq, HV, K, V, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, h0, do, dfinal


def _reference(q, k, v, g, beta, h0, do, dfinal, cu):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    groups = v.shape[2] // q.shape[2]
    qr, kr = (x.repeat_interleave(groups, dim=2) for x in leaves[:2])
    o, final = naive_recurrent_kda(qr, kr, *leaves[2:5], initial_state=leaves[5], output_final_state=True,
                                   cu_seqlens=torch.tensor(cu))
    ((o * do).sum() + (final * dfinal).sum()).backward()
    return [o.detach(), final.detach(), *(x.grad for x in leaves)]


NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.mark.parametrize("groups,neg_eigval", [(2, False), (4, False), (1, True), (2, True)],
                         ids=["gva2", "gva4", "neg-eigval", "gva2-neg-eigval"])
def test_chunk_kda_matches_the_recurrence(groups, neg_eigval):
    cu = [0, 30, 31, 77]  # T = 77: not a multiple of the chunk size 16
    q, k, v, g, beta, h0, do, dfinal = _inputs(77, 2, groups, 3, neg_eigval, seed=groups + 10 * neg_eigval)
    ref = _reference(q, k, v, g, beta, h0, do, dfinal, cu)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, final = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=torch.tensor(cu),
                         chunk_size=16, allow_neg_eigval=neg_eigval)
    ((o * do).sum() + (final * dfinal).sum()).backward()
    for name, r, x in zip(NAMES, ref, [o, final, *(x.grad for x in leaves)]):
        assert_close(name, r, x.detach(), TOL)


def _rank_fn(rank, world, inputs, lengths, cu, neg_eigval, **opts):
    q, k, v, g, beta, h0, do, dfinal = inputs
    local = [split_sequence(x, world, 1, lengths)[rank].clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    h = h0.clone().requires_grad_(True)
    o, final = cp_chunk_kda(*local, cp_group=dist.group.WORLD, initial_state=h, output_final_state=True,
                            cu_seqlens=torch.tensor(cu), allow_neg_eigval=neg_eigval, **opts)
    do_local = split_sequence(do, world, 1, lengths)[rank]
    ((o * do_local).sum() + (final * dfinal).sum() / world).backward()
    return [o.detach(), final.detach()] + [x.grad for x in local] + [h.grad]


def _check_ranks(ref, res, finite=False):
    """The ranks' rows against the single-device reference; final states and dh0 replicated."""
    got = [torch.cat([r[0] for r in res], 1), res[0][1]]
    got += [torch.cat([r[i] for r in res], 1) for i in range(2, 7)] + [res[0][7]]
    for r in res[1:]:
        assert torch.equal(r[1], res[0][1]) and torch.equal(r[7], res[0][7])
    for name, r, x in zip(NAMES, ref, got):
        assert not finite or torch.isfinite(x).all(), name
        assert_close(name, r, x, TOL)


@pytest.mark.parametrize("lengths,cu,groups,neg_eigval", [
    ([40, 37], [0, 20, 61, 77], 2, True),
    ([30, 17, 30], [0, 5, 50, 51, 77], 4, False),
    ([20, 20, 20, 17], [0, 70, 77], 2, True),  # one sequence over four ranks
], ids=["P2-gva2-neg-eigval", "P3-gva4", "P4-gva2-neg-eigval"])
def test_cp_matches_single_device(lengths, cu, groups, neg_eigval):
    inputs = _inputs(sum(lengths), 2, groups, len(cu) - 1, neg_eigval, seed=len(lengths))
    ref = _reference(*inputs, cu)
    _check_ranks(ref, run_ranks(partial(_rank_fn, chunk_size=16), len(lengths), inputs, lengths, cu, neg_eigval))


def _general_gates(T, HV, K, seed):
    """g <= 0 unbounded (g_min=None): most channels drawn from (-40, 0), so each 64-token chunk's
    cumsum goes far below -1000 and single steps below -20, and two slow channels per head near
    -1e-3 that carry the state across the whole sequence and across ranks."""
    gen = torch.Generator().manual_seed(seed)
    g = -40.0 * torch.rand(1, T, HV, K, generator=gen, dtype=torch.float64)
    g[..., :2] = -1e-3 * (0.5 + torch.rand(1, T, HV, 2, generator=gen, dtype=torch.float64))
    return g


@pytest.mark.parametrize("lengths,cu,groups,neg_eigval", [
    ([200, 193], [0, 130, 131, 393], 1, False),
    ([130, 141, 122], [0, 70, 300, 301, 393], 2, True),  # a sequence over three ranks
    ([100, 97, 110, 86], [0, 45, 350, 393], 2, False),  # a sequence over four ranks
], ids=["P2", "P3-gva2-neg-eigval", "P4-gva2"])
def test_cp_general_gates_match_the_recurrence(lengths, cu, groups, neg_eigval):
    """cp_chunk_kda with g_min=None (the default chunk of 64) on gates with steps below -20 and
    chunk cumsums below -1000 next to slow channels: outputs, final states and every gradient
    equal the fp64 per-token recurrence and are finite."""
    T = sum(lengths)
    q, k, v, _, beta, h0, do, dfinal = _inputs(T, 2, groups, len(cu) - 1, neg_eigval, seed=20 + len(lengths))
    g = _general_gates(T, v.shape[2], q.shape[3], seed=30 + len(lengths))
    assert g.min() < -20 and g[0, :64].sum(0).min() < -1000 and g[..., :2].min() > -2e-3
    inputs = (q, k, v, g, beta, h0, do, dfinal)
    ref = _reference(*inputs, cu)
    _check_ranks(ref, run_ranks(partial(_rank_fn, g_min=None), len(lengths), inputs, lengths, cu, neg_eigval),
                 finite=True)


def test_bad_gva_and_beta_raise():
    q, k, v, g, beta, *_ = _inputs(20, 3, 1, 1, False, seed=0)
    v4 = torch.randn(1, 20, 4, v.shape[-1], dtype=torch.float64)
    with pytest.raises(ValueError, match="HV = 4 value heads and q, k have H = 3"):
        chunk_kda(q, k, v4, g, beta)
    g4, beta4 = torch.cat([g, g[:, :, :1]], 2), torch.cat([beta, beta[:, :, :1]], 2)
    with pytest.raises(ValueError, match="HV = 4 value heads and q, k have H = 0"):  # not a division by zero
        chunk_kda(q[:, :, :0], k[:, :, :0], v4, g4, beta4)
    with pytest.raises(ValueError, match=r"beta .* must lie in \[0, 1\] \(allow_neg_eigval=True allows"):
        chunk_kda(q, k, v, g, 1.5 * beta + 0.6)
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\] \(allow_neg_eigval\)"):
        chunk_kda(q, k, v, g, 2.5 * beta + 0.6, allow_neg_eigval=True)
