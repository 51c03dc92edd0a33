"""strategy=ulysses: head-parallel all-to-all around chunk_kda equals the unsharded op (gloo)."""

from __future__ import annotations

import pytest
import torch

from kda_cp.ops import chunk_kda
from kda_cp.parallel.layers.ulysses import resolve_impl, ulysses_kda

from tests._deepspeed import require_deepspeed
from tests._dist import run_ranks


def _inputs(B, T, H, K, V, seed=0, HV=None):
    """q, k with H heads; v, g, beta with HV heads (GVA; HV = H by default)."""
    HV = H if HV is None else HV
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = r(B, T, H, K)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, HV, V)
    g = -5 * torch.sigmoid(r(B, T, HV, K))
    beta = torch.sigmoid(r(B, T, HV))
    return q, k, v, g, beta


def _body(rank, world_size, inputs, do, impl, segment_len=None):
    import torch.distributed as dist

    T_r = inputs[0].shape[1] // world_size
    sl = slice(rank * T_r, (rank + 1) * T_r)
    xs = [t[:, sl].clone().requires_grad_(True) for t in inputs]
    o = ulysses_kda(*xs, cp_group=dist.group.WORLD, chunk_size=16, impl=impl, segment_len=segment_len)
    (o * do[:, sl]).sum().backward()
    return {"o": o.detach(), "grads": [x.grad for x in xs]}


@pytest.mark.parametrize("impl", ["torch", "deepspeed"])
@pytest.mark.parametrize("P,H,HV,L", [(2, 4, 4, None), (4, 4, 4, None), (4, 2, 4, None), (2, 4, 4, 16)],
                         ids=["p2-h4", "p4-h4", "p4-gva-h2-hv4", "p2-h4-segments"])
def test_ulysses_matches_unsharded(P, H, HV, L, impl):
    if impl == "deepspeed":
        require_deepspeed()
    B, T, K, V = 2, 40, 8, 6
    inputs = [t.requires_grad_(True) for t in _inputs(B, T, H, K, V, HV=HV)]
    do = torch.randn(B, T, HV, V, dtype=torch.float64)
    o, _ = chunk_kda(*inputs, chunk_size=16)
    (o * do).sum().backward()
    res = run_ranks(_body, P, [t.detach() for t in inputs], do, impl, L)
    torch.testing.assert_close(torch.cat([r["o"] for r in res], 1), o.detach(), rtol=1e-11, atol=1e-11)
    for i, name in enumerate(["dq", "dk", "dv", "dg", "dbeta"]):
        got = torch.cat([r["grads"][i] for r in res], 1)
        torch.testing.assert_close(got, inputs[i].grad, rtol=1e-10, atol=1e-11, msg=lambda m: f"{name}: {m}")


def _bad_body(rank, world_size, inputs, T_r, bad_gate_rank=None, case=None):
    import torch.distributed as dist

    xs = [t[:, : T_r[rank]].clone() for t in inputs]
    if rank == bad_gate_rank:
        xs[3][0, 3, 1, 2] = 0.5  # a positive log decay in one head of one rank's shard
    kwargs = {}
    if case == "fewer-heads-on-rank-1" and rank == 1:
        xs = [t[:, :, :2] for t in xs]
    if case == "bad-backend-on-rank-1" and rank == 1:
        kwargs["backend"] = "bogus"
    if case == "bad-g_min-type-on-rank-1" and rank == 1:
        kwargs["g_min"] = "x"
    try:
        ulysses_kda(*xs, cp_group=dist.group.WORLD, chunk_size=16, impl="torch", **kwargs)
    except ValueError as e:
        return str(e)
    return None


def test_ulysses_bad_input():
    errs = run_ranks(_bad_body, 2, _inputs(1, 20, 3, 4, 4), [10, 10])
    assert all("num_heads % cp" in e for e in errs)
    errs = run_ranks(_bad_body, 2, _inputs(1, 20, 2, 4, 4), [10, 7])
    assert all("equal shards" in e for e in errs)
    # a bad value on one rank: every rank raises (before the all-to-all), none waits for the timeout
    errs = run_ranks(_bad_body, 2, _inputs(1, 20, 2, 4, 4), [10, 10], 1, timeout=60)
    assert "g is a log decay" in errs[1] and "rank(s) [1]" in errs[0], errs
    # ranks that disagree, or one rank with a bad option: every rank raises, before the exchange
    errs = run_ranks(_bad_body, 2, _inputs(1, 20, 4, 4, 4), [10, 10], None, "fewer-heads-on-rank-1", timeout=60)
    assert all("ranks disagree on [B, H, K, V, dtype, g_min]" in e for e in errs), errs
    for case, message in (("bad-backend-on-rank-1", "backend must be one of"), ("bad-g_min-type-on-rank-1", "g_min")):
        errs = run_ranks(_bad_body, 2, _inputs(1, 20, 2, 4, 4), [10, 10], None, case, timeout=60)
        assert message in errs[1] and "rank(s) [1]" in errs[0], (case, errs)
    with pytest.raises(ValueError, match="ulysses_impl"):
        resolve_impl("nccl")
