"""Causal depthwise short convolution, exact under context parallelism (docs/design.md §6).

KDA layers run a causal depthwise convolution of width W (4 by default) over q, k and v before the
SiLU (Kimi Linear Eq. 15). Output position t reads inputs t-W+1 .. t, so when the sequence is cut
into contiguous shards over the ranks of a CP group, rank r needs the last W-1 inputs that precede
its first token: the *halo*, which lives on rank r-1 (or on several earlier ranks when shards are
shorter than W-1). The backward pass sends the gradient of the halo back to where it came from.

Math (per channel d, weight w[d, 0..W-1], bias b[d]):

    y[t, d] = b[d] + sum_{j=0}^{W-1} w[d, j] * x[t - (W-1) + j, d]        x[s] = 0 for s < 0

which is ``torch.nn.functional.conv1d`` with ``groups=D`` and W-1 zeros of left padding.

Communication: one all-gather of the shard lengths and one of every rank's last min(T_r, W-1)
inputs (B*(W-1)*D values per rank) in forward, one all-reduce of the halo gradients (P*B*(W-1)*D values) in backward. Both are
independent of the sequence length. Works over gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kda_cp.ops import check_cu_seqlens
from kda_cp.parallel.exchange import check_and_agree, digest, dtype_code, group_rank_and_size
from kda_cp.parallel.sharding import shard_lengths

__all__ = ["causal_conv1d", "halo_exchange", "agree_conv_inputs"]


class _HaloExchange(torch.autograd.Function):
    """Returns the last ``halo`` inputs that precede this rank's shard; backward returns their grads.

    Forward: all-gather (length, tail) of every rank, where tail is the last min(T_r, halo) rows of
    the shard, left-padded to ``halo`` rows. Rank r concatenates the true tails of ranks < r and
    keeps the last ``halo`` rows (zeros where the sequence has fewer than ``halo`` earlier tokens).

    Backward: rank r splits the halo gradient back onto the tails of ranks < r, every rank
    all-reduces its [P, B, halo, D] contribution table, and rank j adds row j to the gradient of
    its own last rows.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, halo: int, group, lengths: tuple[int, ...]) -> torch.Tensor:
        B, T, D = x.shape
        P = dist.get_world_size(group)
        rank = dist.get_rank(group)
        n_tail = min(T, halo)
        tail = x.new_zeros(B, halo, D)
        if n_tail:
            tail[:, halo - n_tail :] = x[:, T - n_tail :]
        tails = [torch.empty_like(tail) for _ in range(P)]
        dist.all_gather(tails, tail.contiguous(), group=group)
        n_tails = [min(n, halo) for n in lengths]
        # Where each halo row comes from: (source rank, row in that rank's padded tail).
        sources: list[tuple[int, int]] = []
        for j in range(rank):
            sources.extend((j, halo - n_tails[j] + i) for i in range(n_tails[j]))
        sources = sources[-halo:] if halo else []
        pieces = [tails[j][:, i : i + 1] for j, i in sources]
        out = x.new_zeros(B, halo - len(pieces), D)
        if pieces:
            out = torch.cat([out, *pieces], dim=1)
        ctx.group, ctx.halo, ctx.rank, ctx.P = group, halo, rank, P
        ctx.sources, ctx.n_tail, ctx.T = sources, n_tail, T
        return out

    @staticmethod
    def backward(ctx, grad_halo: torch.Tensor):
        halo, P = ctx.halo, ctx.P
        B, _, D = grad_halo.shape
        table = grad_halo.new_zeros(P, B, halo, D)
        first = halo - len(ctx.sources)  # rows before this are zero padding, no source
        for row, (j, i) in enumerate(ctx.sources):
            table[j, :, i] += grad_halo[:, first + row]
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=ctx.group)
        grad_x = grad_halo.new_zeros(B, ctx.T, D)
        if ctx.n_tail:
            grad_x[:, ctx.T - ctx.n_tail :] = table[ctx.rank, :, halo - ctx.n_tail :]
        return grad_x, None, None, None


def halo_exchange(x: torch.Tensor, halo: int, cp_group, lengths: list[int] | None = None) -> torch.Tensor:
    """The ``halo`` inputs that precede this rank's shard in the global sequence (differentiable).

    Args:
        x: [B, T_r, D], this rank's contiguous shard of the sequence (dim 1). T_r may differ per rank
            and may be shorter than ``halo`` (then the halo spans several earlier ranks).
        halo: number of preceding rows to fetch (W - 1 for a width-W convolution), >= 0.
        cp_group: the context-parallel process group (collective: every rank must call this);
            None means no sharding (zeros are returned), not the default group.
        lengths: every rank's shard length (from :func:`kda_cp.parallel.sharding.shard_lengths`); gathered when None.

    Returns:
        [B, halo, D] in x's dtype: rows T_start - halo .. T_start - 1 of the global sequence, zeros
        where those positions are before the start of the sequence (always zeros on rank 0).

    Raises:
        ValueError: halo < 0.
    """
    if halo < 0:
        raise ValueError(f"halo must be >= 0, got {halo}")
    if halo == 0 or group_rank_and_size(cp_group)[1] == 1:
        return x.new_zeros(x.shape[0], halo, x.shape[2])
    if lengths is None:
        lengths = shard_lengths(x, cp_group)
    return _HaloExchange.apply(x, halo, cp_group, tuple(lengths))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}")
    D = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D, W] = [{D}, W] with W >= 1, got shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"bias must be [D] = [{D}], got shape {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"weight/bias dtype must match x ({x.dtype}), got {weight.dtype}")


def _conv_varlen(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor, start: int):
    """Causal conv over packed sequences whose taps never cross a sequence start.

    xp: [1, W - 1 + T_r, D], the shard with its W - 1 preceding rows (halo or zeros); ``start`` is the
    global position of the shard's first token and ``cu_seqlens`` the global offsets.
    """
    W = weight.shape[1]
    T = xp.shape[1] - (W - 1)
    cu = cu_seqlens.to(device=xp.device, dtype=torch.int64)
    pos = start + torch.arange(T, device=xp.device)  # global position of each output
    seq_start = cu[torch.searchsorted(cu, pos, right=True) - 1]
    y = xp.new_zeros(1, T, xp.shape[2]) if bias is None else bias.expand(1, T, -1).clone()
    for lag in range(W):  # tap weight[:, W-1-lag] reads the input at pos - lag
        valid = (pos - lag >= seq_start).to(xp.dtype)[None, :, None]
        y = y + xp[:, W - 1 - lag : W - 1 - lag + T] * valid * weight[:, W - 1 - lag]
    return y


def _check_cu_seqlens(cu_seqlens, x: torch.Tensor, total: int) -> torch.Tensor:
    check_cu_seqlens(cu_seqlens, total, batch=x.shape[0])
    return torch.as_tensor(cu_seqlens)


def agree_conv_inputs(x, weight, bias, cu_seqlens, cp_group, what: str = "causal_conv1d",
                      min_length: int = 0) -> list[int]:
    """Check this rank's conv inputs and agree with the others before any exchange (collective).

    Returns every rank's shard length. Raises ValueError on every rank when one rank's inputs are
    bad (shapes, dtypes, cu_seqlens, a shard shorter than ``min_length``) or the ranks disagree on
    B, D, W, bias, dtype or cu_seqlens.
    """
    def check():
        _check(x, weight, bias)
        if x.shape[1] < min_length:
            raise ValueError(f"every rank's shard must hold at least {min_length} token(s), got T_r = {x.shape[1]}")
        cs = check_cu_seqlens(cu_seqlens) if cu_seqlens is not None else []
        return x.shape[1], [x.shape[0], x.shape[2], weight.shape[1], int(bias is not None), dtype_code(x.dtype),
                            len(cs), digest(cs)]

    return check_and_agree(check, cp_group, what,
                           ("B", "D", "W", "bias", "dtype", "len(cu_seqlens)", "cu_seqlens digest"),
                           device=getattr(x, "device", None))


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cp_group=None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise 1-D convolution over the sequence dim, with the CP halo when sharded.

    Math:
        y[t, d] = bias[d] + sum_{j=0}^{W-1} weight[d, j] * x[t - (W-1) + j, d]  (x before the start = 0)

    Args:
        x: [B, T_r, D]; this rank's contiguous shard under CP (dim 1), the whole sequence otherwise.
        weight: [D, W], same dtype as x (an ``nn.Conv1d(D, D, W, groups=D)`` weight squeezed at dim 1).
        bias: [D] or None.
        cp_group: context-parallel process group; None or a group of size 1 means no sharding:
            x is the whole sequence, also in a multi-rank world (None is not the default group,
            unlike torch.distributed's ``group=None``; pass ``dist.group.WORLD`` for that).
            Collective under CP: every rank of the group must call it (and, when training, run
            backward with x requiring grad on every rank); shards may be uneven (even shorter than
            W - 1, or empty).
        cu_seqlens: int [N + 1] GLOBAL offsets of packed sequences (FlashAttention convention, B = 1),
            the same on every rank; taps never cross a sequence start, also when the sequence
            start falls inside the halo (docs/design.md §6, §5).

    Returns:
        y: [B, T_r, D] in x's dtype; equal (forward and backward) to slicing the unsharded result.

    Raises:
        ValueError: bad shapes or dtypes, or cu_seqlens that do not end at the global T (the
            message names the argument and the expected shape); under CP, on every rank when any
            rank's inputs fail or the ranks disagree on B, D, W, bias, dtype or cu_seqlens
            (checked before the halo exchange: nothing hangs).
    """
    rank, size = group_rank_and_size(cp_group)
    if size > 1:
        # Every rank checks its inputs before the halo exchange and all raise together: a bad
        # input on one rank must not leave the others blocked in a collective.
        lengths = agree_conv_inputs(x, weight, bias, cu_seqlens, cp_group)
    else:
        _check(x, weight, bias)
    W = weight.shape[1]
    if size > 1:
        start = sum(lengths[:rank])
        xp = torch.cat([halo_exchange(x, W - 1, cp_group, lengths), x], dim=1)
    else:
        lengths, start = [x.shape[1]], 0
        xp = F.pad(x, (0, 0, W - 1, 0))
    if cu_seqlens is not None:
        cu = _check_cu_seqlens(cu_seqlens, x, sum(lengths))
        return _conv_varlen(xp, weight, bias, cu, start)
    if x.shape[1] == 0:  # an empty shard: stay connected to the graph so backward's collective runs
        y = xp[:, :0] * weight[:, 0]
        return y if bias is None else y + bias
    y = F.conv1d(xp.transpose(1, 2), weight.unsqueeze(1), bias, groups=x.shape[-1])
    return y.transpose(1, 2)
