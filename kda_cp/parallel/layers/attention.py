"""Causal softmax attention (no positional encoding) on a sequence sharded over a CP group.

The hybrid model (Kimi Linear: KDA and full attention layers 3:1, the attention layers NoPE) needs
every key and value of the sequence up to each query. Under context parallelism rank r holds the
contiguous tokens [a_r, a_r + T_r) of every sequence, so it all-gathers K and V over the CP group
(uneven shards allowed), keeps the prefix [0, a_r + T_r) its queries can see, and runs
``torch.nn.functional.scaled_dot_product_attention`` with a lower-right aligned causal mask:
local query i (global position a_r + i) attends to keys j <= a_r + i.

    O_r = softmax(Q_r K[:e]^T * scale + Mask) V[:e],     e = a_r + T_r,
    Mask[i, j] = 0 if j <= a_r + i else -inf

Backward: autograd runs through the same SDPA call, and the all-gather's backward is a
reduce-scatter: rank j receives the sum over ranks of dK, dV at its own positions. So outputs and
gradients equal those of the unsharded attention (to rounding).

Communication per rank and layer: the all-gather moves 2 * B * T * H * D values (K and V of the
whole sequence) to every rank in forward, and the reduce-scatter as many in backward: it grows
with T, unlike the KDA state exchange (docs/design.md §4.3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kda_cp.ops import check_cu_seqlens
from kda_cp.parallel.exchange import group_rank_and_size
from kda_cp.parallel.sharding import shard_lengths

__all__ = ["all_gather_sequence", "cp_attention", "causal_attention"]


# torch 2.13 renamed reduce_scatter_tensor (deprecated) to reduce_scatter_single.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _AllGatherSequence(torch.autograd.Function):
    """[B, T_r, ...] shards (lengths may differ) -> the whole [B, T, ...] on every rank.

    Backward: reduce-scatter of the full gradient (sum over ranks, each rank keeps its own rows).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, lengths: tuple[int, ...]) -> torch.Tensor:
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        n_max = max(lengths)
        pad = x.new_zeros(x.shape[0], n_max - x.shape[1], *x.shape[2:])
        x_pad = torch.cat([x, pad], dim=1).contiguous()
        parts = [torch.empty_like(x_pad) for _ in range(P)]
        dist.all_gather(parts, x_pad, group=group)
        ctx.group, ctx.lengths, ctx.rank, ctx.n_max = group, lengths, rank, n_max
        return torch.cat([p[:, :n] for p, n in zip(parts, lengths)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lengths, n_max = ctx.lengths, ctx.n_max
        pieces = torch.split(grad, list(lengths), dim=1)
        stacked = torch.stack(
            [torch.cat([p, p.new_zeros(p.shape[0], n_max - p.shape[1], *p.shape[2:])], dim=1) for p in pieces]
        )  # [P, B, n_max, ...]
        out = torch.empty_like(stacked[0])
        _reduce_scatter(out, stacked.flatten(0, 1).contiguous(), group=ctx.group)
        return out[:, : lengths[ctx.rank]], None, None


def all_gather_sequence(x: torch.Tensor, cp_group, lengths: list[int] | None = None) -> torch.Tensor:
    """The whole sequence from every rank's contiguous shard along dim 1 (differentiable).

    Args:
        x: [B, T_r, ...], this rank's shard (T_r may differ per rank, even be 0).
        cp_group: the CP group (collective: every rank calls it, and runs the backward).
        lengths: every rank's T_r (from :func:`kda_cp.parallel.sharding.shard_lengths`); gathered when None.

    Returns:
        [B, T, ...], T = sum of the lengths, in rank order. Its gradient is reduce-scattered back.
    """
    if group_rank_and_size(cp_group)[1] == 1:
        return x
    if lengths is None:
        lengths = shard_lengths(x, cp_group)
    return _AllGatherSequence.apply(x, cp_group, tuple(lengths))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int = 0, scale: float | None = None):
    """Causal SDPA where local query i sits at key position ``offset + i``.

    Args:
        q: [B, L, H, D]; k, v: [B, S, H, D] with S = offset + L (the keys a query can see).
        offset: global position of the first query (a_r under CP; 0 for a whole sequence).
        scale: softmax scale; None means D ** -0.5.

    Returns:
        o: [B, L, H, D] in q's dtype.

    Raises:
        ValueError: k does not hold exactly the offset + L keys the queries can see.
    """
    L, S = q.shape[1], k.shape[1]
    if S != offset + L:
        raise ValueError(f"causal_attention: keys must cover [0, offset + L) = [0, {offset + L}), got S = {S}")
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, *, D]
    if offset == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        from torch.nn.attention.bias import causal_lower_right

        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(L, S), scale=scale)
    return o.transpose(1, 2)


def cp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group=None, scale: float | None = None,
    lengths: list[int] | None = None, cu_seqlens: list[int] | None = None,
) -> torch.Tensor:
    """Causal attention (no positional encoding) of this rank's queries over the whole sequence.

    Args:
        q, k, v: [B, T_r, H, D], this rank's contiguous shard (the whole sequence without CP).
        cp_group: CP group, or None / size 1 for an unsharded sequence. Collective under CP.
        scale: softmax scale; None means D ** -0.5.
        lengths: every rank's shard length, when the caller has agreed them over the group
            (:class:`kda_cp.layers.AttentionLayer`); None exchanges them here.
        cu_seqlens: GLOBAL offsets of packed sequences as a host list or 1-D integer tensor
            (B = 1, from 0, non-decreasing, ending at the whole length), the same on every rank
            (AttentionLayer agrees them over the group; offsets that differ between ranks are not
            detected here): each query attends to the keys of its own sequence only, one SDPA
            call per sequence piece of this shard.

    Returns:
        o: [B, T_r, H, D]; equal, forward and backward, to the rows of the unsharded attention.

    Raises:
        ValueError: q, k, v are not [B, T, H, D] / [B, T, H, Dv] alike; cu_seqlens with B > 1 or
            offsets that are malformed or do not end at the whole length.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"cp_attention: q, k must be [B, T, H, D] and v [B, T, H, Dv] alike, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    single = group_rank_and_size(cp_group)[1] == 1
    if cu_seqlens is not None:  # before any exchange; under CP the whole length is checked below
        cu_seqlens = check_cu_seqlens(cu_seqlens, q.shape[1] if single else None, batch=q.shape[0])
    if single:
        if cu_seqlens is None:
            return causal_attention(q, k, v, 0, scale)
        start, k_all, v_all = 0, k, v
    else:
        if lengths is None:
            lengths = shard_lengths(q, cp_group)
        if cu_seqlens is not None:  # the same offsets and lengths on every rank: all raise alike
            cu_seqlens = check_cu_seqlens(cu_seqlens, sum(lengths))
        start = sum(lengths[: dist.get_rank(cp_group)])
        end = start + q.shape[1]
        k_all = all_gather_sequence(k, cp_group, lengths)[:, :end]
        v_all = all_gather_sequence(v, cp_group, lengths)[:, :end]
        if cu_seqlens is None:
            return causal_attention(q, k_all, v_all, start, scale)
    return _packed_attention(q, k_all, v_all, start, cu_seqlens, scale)


def _packed_attention(q, k_all, v_all, start: int, cu_seqlens: list[int], scale):
    """Causal attention of the queries at global positions [start, start + L) over the keys
    [0, start + L), each query limited to its own packed sequence: per sequence piece s0 <= a < b,
    causal_attention(q[a:b], K[s0:b], V[s0:b], offset a - s0)."""
    end = start + q.shape[1]
    pieces = []
    for s0, s1 in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        a, b = max(s0, start), min(s1, end)
        if a < b:
            pieces.append(causal_attention(q[:, a - start:b - start], k_all[:, s0:b], v_all[:, s0:b], a - s0, scale))
    if not pieces:  # an empty shard: K and V stay in the graph, so its backward joins the collective
        return causal_attention(q, k_all, v_all, start, scale)
    return torch.cat(pieces, dim=1)
