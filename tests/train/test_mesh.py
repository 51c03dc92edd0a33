"""kda_cp.train.distributed.ParallelDims: validation, coordinates, the named ("dp", "cp") mesh (gloo)."""

from __future__ import annotations

import pytest

from kda_cp.train.distributed import ParallelDims

from tests._dist import run_ranks


def test_validation():
    d = ParallelDims(dp=3, cp=2, world_size=6)
    assert (d.dp_enabled, d.cp_enabled) == (True, True)
    assert [d.coords(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(ValueError, match="dp \\* cp must equal the world size"):
        ParallelDims(dp=2, cp=2, world_size=6)
    with pytest.raises(ValueError, match="ParallelDims.cp"):
        ParallelDims(dp=4, cp=0, world_size=4)
    with pytest.raises(ValueError, match="parallel.cp=3"):
        ParallelDims.from_cp(4, 3)
    assert ParallelDims.from_cp(8, 2) == ParallelDims(dp=4, cp=2, world_size=8)
    with pytest.raises(ValueError, match="rank"):
        d.coords(6)
    with pytest.raises(RuntimeError, match="build_mesh"):
        _ = d.mesh
    assert d.cp_group is None


def _mesh_body(rank, world_size, dp, cp):
    import torch
    import torch.distributed as dist

    dims = ParallelDims(dp=dp, cp=cp, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp", "cp") and dims.build_mesh("cpu") is mesh
    cp_ranks = dist.get_process_group_ranks(dims.cp_group) if dims.cp_group is not None else [rank]
    dp_ranks = dist.get_process_group_ranks(dims.dp_group)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=dims.dp_cp_group)
    # drain(): asynchronous work nobody waits for, on each group, has finished when it returns
    n, outs = 1 << 21, []
    for group in (dims.dp_group, dims.cp_group or dims.dp_group, dims.dp_cp_group):
        size = dist.get_world_size(group)
        out = torch.zeros(size * n)
        dist.all_gather_into_tensor(out, torch.full((n,), rank + 1.0), group=group, async_op=True)  # handle dropped
        outs.append((out, dist.get_process_group_ranks(group)))
    dims.drain()
    gathered = [bool((out.view(len(r), n) == torch.tensor(r, dtype=torch.float32)[:, None] + 1).all()) for out, r in outs]
    return {"coords": dims.coords(rank), "local": (mesh.get_local_rank("dp"), mesh.get_local_rank("cp")),
            "cp": cp_ranks, "dp": dp_ranks, "sum": float(t), "drained": gathered}


@pytest.mark.parametrize("dp,cp", [(2, 2), (1, 4), (4, 1)], ids=["dp2xcp2", "dp1xcp4", "dp4xcp1"])
def test_mesh_groups(dp, cp):
    res = run_ranks(_mesh_body, 4, dp, cp)
    for rank, r in enumerate(res):
        assert r["coords"] == r["local"] == (rank // cp, rank % cp)
        assert r["cp"] == [rank // cp * cp + j for j in range(cp)]  # cp inner: a contiguous block
        assert r["dp"] == [rank % cp + i * cp for i in range(dp)]
        assert r["sum"] == 6.0  # the dp x cp group spans all ranks
        assert r["drained"] == [True] * 3


def _bad_world(rank, world_size):
    try:
        ParallelDims(dp=1, cp=1, world_size=1).build_mesh("cpu")
    except ValueError as e:
        return str(e)


def test_mesh_world_mismatch():
    assert all("world_size=1" in e for e in run_ranks(_bad_world, 2))
