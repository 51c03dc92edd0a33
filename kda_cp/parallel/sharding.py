"""Cutting a global sequence into contiguous per-rank shards and putting it back together.

Rank r of a CP group of size P holds tokens [r * T / P, (r + 1) * T / P) (docs/design.md §4; contiguous,
in order: a recurrence needs in-order shards, not zigzag). Shards may have unequal lengths.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kda_cp.parallel.exchange import all_gather_stack, group_rank_and_size

__all__ = ["shard_bounds", "split_sequence", "shard_sequence", "gather_sequence", "shard_lengths"]


def shard_bounds(total: int, world_size: int, lengths: list[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each rank's shard.

    Args:
        total: global sequence length T.
        world_size: CP degree P >= 1.
        lengths: optional explicit per-rank lengths (summing to T) for uneven shards; default is
            the even split floor(r * T / P).

    Raises:
        ValueError: world_size not an int >= 1, or lengths not ints, of the wrong count or sum, or negative.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if lengths is not None and any(isinstance(n, bool) or not isinstance(n, int) for n in lengths):
        raise ValueError(f"lengths must be ints (one shard length per rank), got {lengths!r}")
    if lengths is None:
        cuts = [(r * total) // world_size for r in range(world_size + 1)]
    else:
        if len(lengths) != world_size or sum(lengths) != total or min(lengths) < 0:
            raise ValueError(
                f"lengths must be {world_size} non-negative shard lengths summing to T = {total}, got {lengths}"
            )
        cuts = [0]
        for n in lengths:
            cuts.append(cuts[-1] + n)
    return list(zip(cuts[:-1], cuts[1:]))


def split_sequence(x: torch.Tensor, world_size: int, dim: int = 1, lengths: list[int] | None = None) -> list[torch.Tensor]:
    """All P shards of ``x`` along ``dim`` (views), for running the shards in one process."""
    return [x.narrow(dim, a, b - a) for a, b in shard_bounds(x.shape[dim], world_size, lengths)]


def shard_sequence(x: torch.Tensor, cp_group, dim: int = 1, lengths: list[int] | None = None) -> torch.Tensor:
    """This rank's contiguous shard of the global ``x`` along ``dim`` (a view)."""
    rank, size = group_rank_and_size(cp_group)
    return split_sequence(x, size, dim, lengths)[rank]


def gather_sequence(x: torch.Tensor, cp_group, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` in rank order; shards may differ in length.

    Raises:
        ValueError: shards that differ in a dimension other than ``dim``.
    """
    rank, size = group_rank_and_size(cp_group)
    if size == 1:
        return x
    dim = dim % x.dim()
    shape = torch.tensor([*x.shape], dtype=torch.int64, device=x.device if dist.get_backend(cp_group) == "nccl" else "cpu")
    shapes = all_gather_stack(shape, cp_group).cpu()
    others = [d for d in range(x.dim()) if d != dim]
    if any((shapes[:, d] != shapes[0, d]).any() for d in others):
        raise ValueError(f"gather_sequence: shards must agree on every dim but {dim}; got shapes {shapes.tolist()}")
    n_max = int(shapes[:, dim].max())
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, n_max - x.shape[dim]]
    stacked = all_gather_stack(torch.nn.functional.pad(x, pad), cp_group)
    return torch.cat([stacked[r].narrow(dim, 0, int(shapes[r, dim])) for r in range(size)], dim=dim)


def shard_lengths(x: torch.Tensor, cp_group, dim: int = 1) -> list[int]:
    """Every rank's shard length along ``dim``, in rank order (one all-gather; [T] without a group)."""
    _, size = group_rank_and_size(cp_group)
    if size == 1:
        return [x.shape[dim]]
    on_gpu = dist.get_backend(cp_group) == "nccl"
    length = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device if on_gpu else "cpu")
    return [int(n) for n in all_gather_stack(length, cp_group).view(-1).tolist()]
