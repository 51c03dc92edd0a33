"""Head-parallel sequence parallelism (DeepSpeed Ulysses) around the single-device KDA op.

The other way to shard a sequence (docs/design.md §8), here to be measured against the affine-scan CP of
:func:`kda_cp.parallel.cp_chunk_kda`. With P ranks in the CP group and H heads (H % P == 0):

    [B, T/P, H, *]  --all-to-all-->  [B, T, H/P, *]     every rank: the whole sequence, H/P heads
    o_heads = chunk_kda(q, k, v, g, beta) on those heads (no state crosses a rank)
    [B, T, H/P, V]  --all-to-all-->  [B, T/P, H, V]     back to this rank's tokens, all heads

The all-to-all is its own transpose, so the backward is the same two exchanges in reverse.
Communication per rank and layer: (P-1)/P of the shard's q, k, v, g, beta and o, i.e. it grows
with T, where the scan CP sends one state pair per rank.

Two implementations of the exchange, same numbers:
- ``impl="deepspeed"``: ``deepspeed.sequence.layer.DistributedAttention`` (scatter heads, gather the
  sequence; batch dim 0). It all-to-alls three tensors, so g travels with k and beta with v
  (concatenated on the last dim in a common dtype, split again inside; the round trip is exact).
  Needs deepspeed and ``deepspeed.comm`` initialized (done here over the existing process group).
- ``impl="torch"``: :func:`seq_to_head` / :func:`head_to_seq`, autograd Functions over
  ``torch.distributed.all_to_all_single`` (supported by gloo and NCCL).

Shards must be equal (T % P == 0): the all-to-all exchanges equal blocks. The short convolution
before the op still needs its halo from the previous rank (:mod:`kda_cp.parallel.layers.conv`).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.distributed as dist

from kda_cp.ops import BACKENDS, check_inputs, check_segment_len, chunk_kda, expand_value_heads
from kda_cp.parallel.exchange import check_and_agree, dtype_code, float_code, group_rank_and_size

__all__ = ["ulysses_kda", "seq_to_head", "head_to_seq", "UlyssesImpl", "resolve_impl"]

logger = logging.getLogger(__name__)

UlyssesImpl = Literal["auto", "deepspeed", "torch"]


def _a2a_seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    P = dist.get_world_size(group)
    B, T_r, H = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(B, T_r, P, H // P, *rest).movedim(2, 0).contiguous()  # [P, B, T_r, H/P, *]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j] = rank j's tokens, my heads
    return recv.movedim(0, 1).reshape(B, P * T_r, H // P, *rest)


def _a2a_head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    P = dist.get_world_size(group)
    B, T, Hp = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(B, P, T // P, Hp, *rest).movedim(1, 0).contiguous()  # [P, B, T_r, H/P, *]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j] = my tokens, rank j's heads
    return recv.movedim(0, 2).reshape(B, T // P, P * Hp, *rest)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _a2a_seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a_head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _a2a_head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a_seq_to_head(grad, ctx.group), None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """[B, T/P, H, *] sequence shards -> [B, T, H/P, *] head shards (differentiable all-to-all).

    Rank j of the group gets heads [j H/P, (j+1) H/P) of the whole sequence. Collective: every
    rank of ``group`` calls it with the same B, T/P, H and trailing dims.

    Raises:
        ValueError: x is not at least 3-D, or H is not divisible by the group size P.
    """
    _check_heads(x, group, "seq_to_head", "H")
    return _SeqToHead.apply(x, group)


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, T, H/P, *] head shards -> [B, T/P, H, *] sequence shards (the inverse of :func:`seq_to_head`).

    Collective, like :func:`seq_to_head`.

    Raises:
        ValueError: x is not at least 3-D, or T is not divisible by the group size P.
    """
    _check_heads(x, group, "head_to_seq", "T")
    return _HeadToSeq.apply(x, group)


def _check_heads(x: torch.Tensor, group, what: str, split: str) -> None:
    P = dist.get_world_size(group)
    dim = {"H": 2, "T": 1}[split]
    if x.dim() < 3 or x.shape[dim] % P:
        raise ValueError(f"{what}: x must be [B, T, H, ...] with {split} divisible by the group size {P}, "
                         f"got {tuple(x.shape)}")


def resolve_impl(impl: str) -> str:
    """"auto" -> "deepspeed" when deepspeed imports, else "torch"; ValueError on anything else."""
    if impl == "auto":
        try:
            import deepspeed.sequence.layer  # noqa: F401
        except Exception:  # not installed, or no usable accelerator
            return "torch"
        return "deepspeed"
    if impl not in ("deepspeed", "torch"):
        raise ValueError(f"ulysses_impl must be 'auto', 'deepspeed' or 'torch', got {impl!r}")
    return impl


def _deepspeed_attention(local_fn, group):
    import deepspeed
    import deepspeed.comm as ds_dist
    from deepspeed.sequence.layer import DistributedAttention

    if not ds_dist.is_initialized():  # wraps the existing torch.distributed process group
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    return DistributedAttention(local_fn, group, scatter_idx=2, gather_idx=1)


def ulysses_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cp_group,
    chunk_size: int = 64,
    backend: str = "auto",
    g_min: float | None = -5.0,
    impl: UlyssesImpl = "auto",
    check_gate: bool = True,
    allow_neg_eigval: bool = False,
    segment_len: int | str | None = "auto",
) -> torch.Tensor:
    """KDA on a sequence sharded over ``cp_group``, head-parallel (Ulysses).

    Args:
        q, k: [B, T_r, H, K]; v: [B, T_r, H, V]; g: [B, T_r, H, K] (log decay); beta: [B, T_r, H]:
            this rank's contiguous shard, T_r = T / P on every rank. Or v, g, beta with HV heads,
            a multiple of H (GVA; q and k are then repeated to HV heads before the exchange).
        cp_group: the CP group (collective), or None / size 1 (then plain chunk_kda).
        chunk_size, backend, g_min, check_gate, allow_neg_eigval, segment_len: as in
            :func:`kda_cp.chunk_kda` (the value checks run on every rank's shard before the exchange;
            each rank splits the whole sequences of its heads).
        impl: "deepspeed" (DistributedAttention), "torch" (own all-to-all), or "auto".

    Returns:
        o: [B, T_r, H, V]; equal to the rows of the unsharded chunk_kda (no initial/final state).

    Raises:
        ValueError: on every rank of the group when any rank's shard fails :func:`kda_cp.ops.check_inputs`
            (shapes, g outside [g_min, 0], NaN/Inf, beta outside [0, 1]), H not divisible by P,
            unequal shard lengths, or a bad ``impl``. Checked before any exchange: nothing hangs. Also
            on a rank that is not a member of ``cp_group``.
    """
    kw = dict(chunk_size=chunk_size, backend=backend, g_min=g_min, allow_neg_eigval=allow_neg_eigval,
              segment_len=segment_len)
    P = group_rank_and_size(cp_group)[1]  # ValueError on a rank outside cp_group

    if P == 1:
        return chunk_kda(q, k, v, g, beta, check_gate=check_gate, **kw)[0]
    # Every rank checks its own shard before any exchange, and all ranks raise together: a bad
    # value on one rank must not leave the others blocked in the all-to-all.
    def check():
        nonlocal q, k
        resolve_impl(impl)  # a bad name raises here, on its rank
        check_segment_len(segment_len, chunk_size)
        # GVA: Ulysses shards heads, so every value head takes its own copy of q and k
        q, k = expand_value_heads(q, k, v)
        check_inputs(q, k, v, g, beta, chunk_size=chunk_size, check_gate=check_gate, g_min=g_min, layout_warning=False,
                     allow_neg_eigval=allow_neg_eigval)
        if q.shape[2] % P:
            raise ValueError(f"parallel.strategy=ulysses needs num_heads % cp == 0 (the value heads with GVA), "
                             f"got {q.shape[2]} heads, cp={P}")
        if backend not in BACKENDS:  # a bad name fails here, on its rank, not inside the exchange
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        B, T_r, H, K = q.shape
        return T_r, [B, H, K, v.shape[-1], dtype_code(q.dtype), float_code(g_min)]

    lengths = check_and_agree(check, cp_group, "ulysses_kda", ("B", "H", "K", "V", "dtype", "g_min"),
                              device=getattr(q, "device", None))
    impl = resolve_impl(impl)
    if len(set(lengths)) != 1:
        raise ValueError(
            f"parallel.strategy=ulysses needs equal shards (data.seq_len % cp == 0), got shard lengths {lengths}"
        )
    kw["check_gate"] = False  # checked above, on every rank's shard
    if impl == "torch":
        qh, kh, vh, gh, bh = (seq_to_head(t, cp_group) for t in (q, k, v, g, beta))
        o, _ = chunk_kda(qh, kh, vh, gh, bh, **kw)
        return head_to_seq(o, cp_group)

    K = k.shape[-1]
    kg_dtype = torch.promote_types(k.dtype, g.dtype)
    vb_dtype = torch.promote_types(v.dtype, beta.dtype)

    def local(qh, kgh, vbh):
        kh, gh = kgh[..., :K].to(k.dtype), kgh[..., K:].to(g.dtype)
        vh, bh = vbh[..., :-1].to(v.dtype), vbh[..., -1].to(beta.dtype)
        return chunk_kda(qh, kh, vh, gh, bh, **kw)[0]

    kg = torch.cat([k.to(kg_dtype), g.to(kg_dtype)], dim=-1)
    vb = torch.cat([v.to(vb_dtype), beta.to(vb_dtype)[..., None]], dim=-1)
    return _deepspeed_attention(local, cp_group)(q, kg, vb, 0)
