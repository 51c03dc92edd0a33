"""Collectives used by context parallelism: stacking per-rank tensors, agreeing on inputs, and the
log-depth point-to-point scan.

Every function here but ``group_rank_and_size`` is a collective: all ranks of ``group`` must call
it, in the same order.
"""

from __future__ import annotations

import hashlib
import struct

import torch
import torch.distributed as dist

__all__ = ["group_rank_and_size", "all_gather_stack", "agree_or_raise", "check_and_agree", "digest", "dtype_code",
           "float_code", "tensor_digest", "p2p_exclusive_scan"]


def digest(values) -> int:
    """A 62-bit BLAKE2b digest of a sequence of ints: ranks compare it (through
    :func:`agree_or_raise`) to agree on a variable-length list, e.g. cu_seqlens, without sending it."""
    data = b"".join(int(v).to_bytes(16, "little", signed=True) for v in values)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def tensor_digest(x: torch.Tensor | None) -> int:
    """A 62-bit BLAKE2b digest of a tensor's shape, dtype and bytes (0 for None), for ranks to check
    that a replicated tensor (e.g. initial_state) is the same everywhere. Copies it to the CPU.
    Floating values are hashed after ``+ 0``, so -0.0 and +0.0 (equal values) give one digest."""
    if x is None:
        return 0
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((tuple(x.shape), str(x.dtype))).encode())
    if x.numel():
        x = x.detach()
        if x.is_floating_point():
            x = x + 0  # -0.0 + 0 is +0.0 in IEEE arithmetic
        h.update(x.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 2


def float_code(x: float | None) -> int:
    """The bits of a float (None -> 0) as an int64, to compare float options exactly across ranks
    (NaN and Inf included; no rounding)."""
    return 0 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def dtype_code(dtype) -> int:
    """A small int naming a floating dtype (0 for anything else), for :func:`agree_or_raise`."""
    return {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}.get(dtype, 0)

# torch >= 2.13 names the single-tensor all-gather all_gather_single; older releases
# all_gather_into_tensor. Both take a flat output of P * numel elements on gloo and NCCL.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_rank_and_size(group) -> tuple[int, int]:
    """(rank in group, group size); (0, 1) when group is None or distributed is not initialized.

    ``None`` means "no context parallelism: this rank holds whole sequences", as in
    flash-linear-attention (``cp_context=None``), also in a multi-rank world; unlike the
    ``group=None`` of torch.distributed's collectives it never means the default group.

    Raises:
        ValueError: ``group`` is not a ProcessGroup; this process is not a member of ``group``
            (``dist.new_group`` hands ranks outside the group a placeholder of no size).
    """
    if group is None:
        return 0, 1
    # dist.new_group hands ranks outside the group an int placeholder (GroupMember.NON_GROUP_MEMBER)
    outside = dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER
    if not outside and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise ValueError(f"cp_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        return 0, 1
    rank = -1 if outside else dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()} of {dist.get_world_size()}) is not a member of the given "
            "cp_group: call it only on the ranks of that group, with the group this rank belongs to"
        )
    return rank, dist.get_world_size(group)


def all_gather_stack(x: torch.Tensor, group, overlap=None) -> torch.Tensor:
    """Stack ``x`` from every rank of ``group`` on a new dim 0: [P, *x.shape]. Same shape on all ranks.

    ``overlap``: optional callable run after the all-gather is issued and before waiting for it.
    """
    _, size = group_rank_and_size(group)
    if size == 1:
        if overlap is not None:
            overlap()
        return x[None]
    out = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    work = _all_gather_flat(out, x.contiguous().view(-1), group=group, async_op=True)
    if overlap is not None:
        overlap()
    work.wait()
    return out.view(size, *x.shape)


def agree_or_raise(meta: list[int], error: str | None, group, what: str, device=None) -> torch.Tensor:
    """Exchange small integer metadata and a failure flag so that every rank raises together.

    Each rank validates its inputs first, then calls this with its metadata (``meta``) and its
    error message (or None). If any rank failed, every rank raises ValueError: the failing rank
    with its own message, the others naming the failing ranks. Nothing waits on a rank that
    stopped early, so a bad input never hangs the group.

    Returns:
        [P, len(meta) + 1] int64 (CPU) with each rank's flag and metadata.
    """
    rank, size = group_rank_and_size(group)
    row = torch.tensor([0 if error is None else 1, *meta], dtype=torch.int64)
    if size == 1:
        table = row[None]
    else:
        backend = dist.get_backend(group)
        if backend == "nccl":  # NCCL needs the inputs' GPU (the rank's own device)
            dev = device if device is not None and torch.device(device).type == "cuda" else torch.device(
                "cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cpu")
        table = all_gather_stack(row.to(dev), group).cpu()
    if error is not None:
        raise ValueError(error)
    bad = [r for r in range(size) if table[r, 0] != 0]
    if bad:
        raise ValueError(f"{what}: rank(s) {bad} of the cp_group rejected their inputs (see their errors)")
    return table


def check_and_agree(check, group, what: str, fields: tuple[str, ...], device=None) -> list[int]:
    """Validate this rank's inputs, then agree with every rank of ``group`` before any exchange.

    ``check()`` raises on bad local input, or returns (this rank's shard length, one int per name
    in ``fields``: shapes, :func:`dtype_code`, :func:`float_code`, :func:`digest`, ...). Any
    exception on any rank, or ranks whose fields differ, raise ValueError on every rank (through
    :func:`agree_or_raise`), so nothing blocks in a later collective; a rank whose own check
    raised NotImplementedError raises that type, with the same message.

    Returns:
        every rank's shard length, by rank.
    """
    rank = group_rank_and_size(group)[0]
    error, row, unsupported = None, [0] * (1 + len(fields)), None  # a failing rank sends a row of the same length
    try:
        length, meta = check()
        row = [length, *meta]
        assert len(row) == 1 + len(fields), (what, fields, row)
    except Exception as exc:
        error = f"{what} on rank {rank}: {exc}"
        unsupported = exc if isinstance(exc, NotImplementedError) else None
    try:
        table = agree_or_raise(row, error, group, what, device=device)
    except ValueError as exc:
        if unsupported is not None:  # what this rank's inputs asked for is not implemented: keep the type
            raise NotImplementedError(str(exc)) from unsupported
        raise
    if not bool((table[:, 2:] == table[0, 2:]).all()):
        raise ValueError(f"{what}: ranks disagree on [{', '.join(fields)}]; every rank of the group must pass "
                         f"its shard of the same tensors (rows per rank: {table[:, 2:].tolist()})")
    return table[:, 1].tolist()


def _peer(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not dist.group.WORLD else rank


def _sendrecv(send: torch.Tensor | None, to: int | None, recv_like: torch.Tensor, frm: int | None, group):
    """Send ``send`` to group rank ``to`` and receive a tensor like ``recv_like`` from ``frm``."""
    ops, out = [], None
    if frm is not None:
        out = torch.empty_like(recv_like)
        ops.append(dist.P2POp(dist.irecv, out, _peer(group, frm), group))
    if to is not None:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), _peer(group, to), group))
    if ops:  # batched, so NCCL groups the send and the receive (no ordering deadlock)
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out


def p2p_exclusive_scan(pair, group, *, reverse: bool = False):
    """Exclusive scan of affine maps over the ranks of ``group`` by point-to-point sends.

    Hillis-Steele: one shift, then ceil(log2(P - 1)) rounds; each round a rank sends one (M, S) pair
    (B*H*K*(K+V) values) and receives one. Forward (``reverse=False``): rank r gets
    pair_{r-1} o ... o pair_0 (identity on rank 0). Reverse: rank r gets
    pair_{r+1} o ... o pair_{P-1} (identity on the last rank); pass transposed maps for the
    backward of the state chain.

    Args:
        pair: this rank's (M [..., K, K], S [..., K, V]) as a :class:`kda_cp.scan.AffineMap`.

    Returns:
        this rank's exclusive prefix (or suffix) as an AffineMap.
    """
    from kda_cp import scan

    rank, size = group_rank_and_size(group)
    K = pair.M.shape[-1]
    ident = scan.identity_like(pair)
    if size == 1:
        return ident
    step = -1 if reverse else 1

    def inside(r):
        return r if 0 <= r < size else None

    packed = torch.cat([pair.M, pair.S], dim=-1)
    got = _sendrecv(packed, inside(rank + step), packed, inside(rank - step), group)
    acc = ident if got is None else scan.AffineMap(got[..., :K], got[..., K:])
    d = 1
    while d < size - 1:  # after the shift acc covers 1 rank; P - 1 is the most any rank needs
        packed = torch.cat([acc.M, acc.S], dim=-1)
        got = _sendrecv(packed, inside(rank + step * d), packed, inside(rank - step * d), group)
        if got is not None:
            acc = scan.compose(acc, scan.AffineMap(got[..., :K], got[..., K:]))
        d *= 2
    return acc
