"""Context-parallel KDA: exact chunk_kda over a sequence sharded across the ranks of a group.

Forward on rank r (docs/design.md §3-§5; Kimi K3 report, CP by affine prefix scan):
  0. the state-independent half of the local forward (gates, decayed products, UT transform:
     ``Backend.prepare``), computed once and shared by steps 1 and 3;
  1. summarize the shard's last segment from it: (M, S~) with S_out = M S_in + S~. When that
     segment starts a sequence inside the shard, the pair becomes the constant map (0, M h0 + S~).
     Two roles skip the summary (``_summary_role``): a shard with nothing flowing in (rank 0, or
     a packed shard whose first sequence starts at its first token) runs step 3 first and hands
     over its end state as (0, S_end); the last rank without final-state outputs sends zeros (no
     rank reads its pair). At P = 2 neither rank runs the summary;
  2. exchange the pairs (all-gather + each rank's fold of the pairs before it, or a log-depth scan over point-to-point
     sends); the exclusive prefix gives the state entering the shard's first token. The
     all-gather is issued asynchronously; on the last rank (which sends zeros) step 0 runs while
     it is in flight. On a summarising rank step 0 must precede the summary, so there is nothing
     left to overlap: sharing step 0 saves a whole chunk-local pass, far more than the exchange
     of one (M, S) pair per rank costs;
  3. the ordinary chunk forward of the shard's segments from their true incoming states.
Backward on rank r, with D_r = dL/dS_out^r (gradient of the state leaving the shard):
  0. the chunk-local half, shared by steps 1 and 3: what the forward kept of it
     (``Backend.keep_for_backward``: the TileLang backend keeps W, U, Aqk, eC and remakes Qg, Kd),
     or else recomputed once where step 1 covers the whole shard (``_backward_prepare``);
  1. G_r = gradient of the shard's incoming state from its own outputs (and the final states
     of sequences that end inside it), with no gradient at the shard's end;
  2. exchange (M^T, G): D_r is the reverse exclusive scan of x -> M_j^T x + G_j over j > r,
     seeded with the gradient of the last sequence's final state;
  3. the ordinary chunk backward with dht = D_r at the shard's end.

Communication per rank and call, independent of T: one (M, S) pair of B*H*K*(K+V) values (fp32;
fp64 for fp64 inputs) per message; the all-gather moves P of them, the point-to-point scan
1 + ceil(log2(P - 1)). Besides: one small all-gather of metadata (the ranks agree on their inputs
first), and all-reduces of the per-sequence final states and initial-state gradients when used.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.distributed as dist

from kda_cp import reference, scan
from kda_cp.ops import check_cu_seqlens as check_offsets
from kda_cp.ops import (DEFAULT_G_MIN, Backend, BackendName, KDAOptions, apply_input_options, check_flags,
                        check_gate_args, check_inputs, check_preactivations, check_scale, chunk_kda, dense_on_cuda,
                        expand_value_heads, first_order_only, get_backend, segmented)
from kda_cp.parallel.exchange import (agree_or_raise, all_gather_stack, digest, dtype_code, float_code,
                                     group_rank_and_size, p2p_exclusive_scan, tensor_digest)
from kda_cp.parallel.varlen import ShardSegments, nonempty_sequences, shard_segments

__all__ = ["cp_chunk_kda", "cp_chunk_kda_in_one_process", "Exchange", "choose_exchange"]

Exchange = Literal["auto", "allgather", "p2p"]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: With more ranks than this, "auto" scans over point-to-point sends (O(log P) pairs per rank)
#: instead of all-gathering P pairs to every rank.
P2P_ABOVE = 8


def choose_exchange(exchange: Exchange, world_size: int) -> str:
    """Resolve "auto": all-gather for small groups, the log-depth point-to-point scan above P2P_ABOVE."""
    if exchange == "auto":
        return "p2p" if world_size > P2P_ABOVE else "allgather"
    if exchange not in ("allgather", "p2p"):
        raise ValueError(f"exchange must be 'auto', 'allgather' or 'p2p', got {exchange!r}")
    return exchange


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one call on one rank."""

    rank: int
    size: int
    segs: ShardSegments | None  # None: dense batch, one sequence per batch row spanning all ranks
    exchange: str
    scan_method: str
    has_h0: bool
    varlen_final_rows: int  # number of sequences (varlen) for final-state/h0 reductions
    keep: tuple[int, ...] | None = None  # the non-empty sequences' rows when some are empty (varlen)

    @property
    def chained(self) -> bool:
        return self.rank > 0 if self.segs is None else self.segs.chained

    @property
    def first_continues(self) -> bool:
        return self.rank > 0 if self.segs is None else self.segs.first_continues


def _with_rows(base: torch.Tensor, keep: tuple[int, ...], rows: torch.Tensor) -> torch.Tensor:
    """A copy of ``base`` [N, ...] with rows ``keep`` replaced by ``rows``: the non-empty sequences'
    states or gradients put back among the empty ones'."""
    return base.clone().index_copy_(0, torch.tensor(keep, device=rows.device), rows)


def _local_h0(h0_global, s_in, plan):
    """Initial states of the local segments: S_in for a continuing first segment, else h0 rows."""
    if plan.segs is None:
        return s_in if plan.first_continues else h0_global
    rows = h0_global[list(plan.segs.seq_ids)]
    if plan.first_continues:
        rows = torch.cat([s_in, rows[1:]], dim=0)
    return rows


def _fold(maps: scan.AffineMap, rank: int, method, reverse: bool, seed=None, scratch=False) -> torch.Tensor:
    """Rank ``rank``'s fold of the stacked pairs: its incoming state (forward, from zero) or the
    gradient of its end state (reverse, from ``seed``, zero when None). "sequential" chains the
    states (one product per pair; with ``scratch`` over the S rows of ``maps``, a buffer the caller
    discards); "log_depth" composes a tree of maps first."""
    if method == "sequential":
        x = (scan.transposed_state_at if reverse else scan.state_at)(maps, rank, seed, scratch=scratch)
    else:
        f = (scan.transposed_suffix_at if reverse else scan.prefix_at)(maps, rank, method)
        x = f.S if seed is None else scan.apply(f, seed)
    return x.contiguous()  # the kernels take a contiguous state


def _exclusive(pair: scan.AffineMap, plan: _Plan, group, reverse: bool, overlap=None, seed=None) -> torch.Tensor:
    """This rank's exclusive prefix (forward) or transposed suffix (reverse) of the pairs, applied:
    the state entering the shard, or the gradient at its end from ``seed`` (zero when None).

    ``overlap``: a callable run while the all-gather is in flight (its result is discarded here;
    the callable keeps what it needs).
    """
    if plan.exchange == "p2p":
        if overlap is not None:
            overlap()
        if reverse:
            pair = scan.AffineMap(pair.M.transpose(-1, -2), pair.S)
        f = p2p_exclusive_scan(pair, group, reverse=reverse)
        return (f.S if seed is None else scan.apply(f, seed)).contiguous()
    V = pair.S.shape[-1]
    packed = all_gather_stack(_packed_row(pair), group, overlap=overlap)
    maps = scan.AffineMap(packed[..., V:], packed[..., :V])
    # scratch: for P > 1 the gathered buffer is new and ours alone; at P = 1 the fold writes nothing
    return _fold(maps, plan.rank, plan.scan_method, reverse, seed, scratch=True)


def _row_in_place(pair: scan.AffineMap) -> torch.Tensor | None:
    """The contiguous [..., K, V + K] buffer whose halves S and M are (the summary kernel's
    output), or None."""
    S, M = pair.S, pair.M
    V, K = S.shape[-1], M.shape[-1]
    if (S.dtype == M.dtype and S.device == M.device and S.shape[:-1] == M.shape[:-1]
            and S.untyped_storage().data_ptr() == M.untyped_storage().data_ptr()
            and M.storage_offset() == S.storage_offset() + V and S.stride() == M.stride()):
        row = S.as_strided((*S.shape[:-1], V + K), S.stride(), S.storage_offset())
        if row.is_contiguous():
            return row
    return None


def _packed_row(pair: scan.AffineMap) -> torch.Tensor:
    """The pair as this rank's row of the all-gather, [..., K, V + K]: S then M, the summary
    kernel's own output layout, which is sent without a copy; other pairs are concatenated."""
    row = _row_in_place(pair)
    return torch.cat([pair.S, pair.M], dim=-1) if row is None else row


def _sum_over_ranks(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Sum over the group into a new tensor (never in place: x may be the caller's gradient)."""
    if size > 1:
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
    return x


# ---- the stages of one shard, shared by the distributed op and the one-process driver ----------


def _shard_pair(backend, opts, plan, prepared, h0) -> scan.AffineMap:
    """Forward 1: the shard's map of the chain state (constant when its last segment starts here),
    from the chunk-local tensors that the shard's forward then reuses (``prepared``)."""
    M, St = backend.summary_prepared(prepared, opts, last_only=plan.segs is not None)
    sdt = M.dtype
    if plan.chained:
        return scan.AffineMap(M, St.to(sdt))
    h0_last = h0 if plan.segs is None else h0[plan.segs.seq_ids[-1]][None]
    return scan.AffineMap(torch.zeros_like(M), scan.apply(scan.AffineMap(M, St.to(sdt)), h0_last.to(sdt)))


def _summary_role(plan, opts) -> str:
    """How this rank gets the pair it contributes to the forward exchange.

    "forward_first": nothing flows into the shard (rank 0, or a packed shard whose first sequence
        starts at its first token): it runs its forward from the known initial states at once and
        hands over the end state of its last sequence as a constant map (0, S_end). No summary.
    "unused": the last rank without final-state outputs: no rank reads its pair (the forward scan is
        exclusive, and in the backward its M only multiplies the zero final-state gradient). Zeros.
    "summary": everything else: the shard's affine map from the summary pass.
    """
    if not plan.first_continues:
        return "forward_first"
    if plan.rank == plan.size - 1 and not opts.output_final_state:
        return "unused"
    return "summary"


def _handover_pair(plan, ht, sdt) -> scan.AffineMap:
    """The constant map (0, state after the shard's last sequence) of a forward-first rank."""
    S = (ht if plan.segs is None else ht[-1:]).to(sdt)
    return scan.AffineMap(S.new_zeros(*S.shape[:-1], S.shape[-2]), S)


def _unused_pair(plan, k, v, sdt) -> scan.AffineMap:
    n = k.shape[0] if plan.segs is None else 1
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    return scan.AffineMap(k.new_zeros(n, H, K, K, dtype=sdt), k.new_zeros(n, H, K, V, dtype=sdt))


def _cu_local(plan, device):
    """The shard's local packed-sequence offsets, or None for a dense shard."""
    return None if plan.segs is None else plan.segs.local_cu_seqlens(device)


def _shard_prepare(backend, opts, plan, q, k, v, g, beta):
    """The state-independent half of the local forward (gates, decayed products, UT transform),
    shared by the summary, the forward, the state gradient and the backward of the shard."""
    cu_local = _cu_local(plan, q.device)
    return backend.prepare(q, k, v, g, beta, opts, cu_local)


def _shard_forward(backend, opts, plan, q, k, v, g, beta, h0, s_in, prepared=None):
    """Forward 3: the local chunk forward from the true incoming states -> (o, ht, h0_local)."""
    h0_local = _local_h0(h0, s_in, plan)
    cu_local = _cu_local(plan, q.device)
    o, ht = backend.fwd(q, k, v, g, beta, h0_local, opts, cu_local, prepared=prepared)
    return o, ht, h0_local


def _final_rows(plan, ht, h0) -> torch.Tensor:
    """This shard's share of the final states: the rows of the sequences that end here."""
    if plan.segs is None:
        return ht.to(h0.dtype) if plan.rank == plan.size - 1 else torch.zeros_like(h0)
    final = h0.new_zeros(plan.varlen_final_rows, *h0.shape[1:])
    for i, s in enumerate(plan.segs.seq_ids):
        if plan.segs.ends[i]:
            final[s] = ht[i].to(h0.dtype)
    return final


def _inner_dht(plan, dfinal, h0_local) -> torch.Tensor:
    """dht of each local segment from the final-state gradients; the last row is set later."""
    dht = torch.zeros_like(h0_local)
    if dfinal is not None and plan.segs is not None:
        for i, s in enumerate(plan.segs.seq_ids[:-1]):
            dht[i] = dfinal[s]
    return dht


def _shard_state_grad(backend, opts, plan, q, k, v, g, beta, h0_local, do, dht, dfinal,
                      prepared=None) -> torch.Tensor:
    """Backward 1: G, the gradient of the shard's incoming chain state from this shard alone."""
    segs, sdt = plan.segs, h0_local.dtype
    G = torch.zeros_like(h0_local[:1] if segs is not None else h0_local)
    if plan.first_continues:
        if segs is None or segs.num_segments == 1:
            cu_local = _cu_local(plan, q.device)
            G = backend.state_grad(q, k, v, g, beta, do, opts, cu_local, prepared=prepared).to(sdt)
        else:  # the first segment ends inside the shard, with its sequence's final-state gradient
            n = segs.cu_seqlens[1]
            G = backend.bwd(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], h0_local[:1],
                            do[:, :n], dht[:1], opts).dh0.to(sdt)
    # A sequence that ends exactly where this shard begins hands its final-state gradient to the
    # chain through this shard's map (whose M is then zero).
    if dfinal is not None and segs is not None and plan.rank > 0 and not segs.first_continues:
        G = G + dfinal[segs.seq_ids[0] - 1][None]
    return G


def _backward_prepare(backend, opts, plan, q, k, v, g, beta, kept=()):
    """The chunk-local tensors for the state gradient and the backward of the shard: from what the
    forward kept (``Backend.keep_for_backward``), else computed once for both where the state
    gradient runs over the whole shard; else None (each recomputes)."""
    if kept:
        return backend.restore_prepared(q, k, v, g, beta, kept, opts, _cu_local(plan, q.device))
    if plan.first_continues and (plan.segs is None or plan.segs.num_segments == 1):
        return _shard_prepare(backend, opts, plan, q, k, v, g, beta)
    return None


def _end_seed(plan, dfinal):
    """What the reverse scan starts from: the final-state gradient of the chain that leaves the
    last shard (None: zero)."""
    if dfinal is None:
        return None
    return dfinal if plan.segs is None else dfinal[-1:]


def _end_dht(plan, d_end, dht) -> torch.Tensor:
    """Backward 2: the gradient at the shard's end, D_r (from the reverse scan), put into dht."""
    if plan.segs is None:
        return d_end
    dht = dht.clone()
    dht[-1:] = d_end
    return dht


def _shard_backward(backend, opts, plan, q, k, v, g, beta, h0_local, do, dht, prepared=None):
    """Backward 3: the local chunk backward -> (grads, this shard's rows of dh0 or None)."""
    cu_local = _cu_local(plan, q.device)
    grads = backend.bwd(q, k, v, g, beta, h0_local, do, dht, opts, cu_local, prepared=prepared)
    if not plan.has_h0:
        return grads, None
    sdt = h0_local.dtype
    if plan.segs is None:
        rows = grads.dh0.to(sdt) if plan.rank == 0 else torch.zeros_like(grads.dh0, dtype=sdt)
    else:
        rows = h0_local.new_zeros(plan.varlen_final_rows, *h0_local.shape[1:])
        for i, s in enumerate(plan.segs.seq_ids):
            if plan.segs.starts[i]:
                rows[s] = grads.dh0[i].to(sdt)
    return grads, rows


def _forward_stages(backend, opts, plan, q, k, v, g, beta, h0):
    """The forward of one shard as a coroutine, driven by cp_chunk_kda (over the group) and by
    cp_chunk_kda_in_one_process (over stacked shards): yields (pair, overlap) for the exclusive
    scan (overlap: work to run while the pairs are in flight, or None), receives the incoming
    state, returns (o, ht, h0_local, prepared)."""
    sdt = h0.dtype
    role = _summary_role(plan, opts)
    if role == "forward_first":  # nothing flows in: run now, hand the final state over
        prepared = _shard_prepare(backend, opts, plan, q, k, v, g, beta)
        o, ht, h0_local = _shard_forward(backend, opts, plan, q, k, v, g, beta, h0, None, prepared)
        yield _handover_pair(plan, ht, sdt), None
        return o, ht, h0_local, prepared
    if role == "unused":  # the state-independent work runs while the pairs are in flight
        later = []
        s_in = yield _unused_pair(plan, k, v, sdt), lambda: later.append(
            _shard_prepare(backend, opts, plan, q, k, v, g, beta))
        prepared = later[0]
    else:  # the summary derives from the chunk-local tensors, which the forward then reuses
        prepared = _shard_prepare(backend, opts, plan, q, k, v, g, beta)
        s_in = yield _shard_pair(backend, opts, plan, prepared, h0), None
    o, ht, h0_local = _shard_forward(backend, opts, plan, q, k, v, g, beta, h0, s_in, prepared)
    return o, ht, h0_local, prepared


def _backward_stages(backend, opts, plan, q, k, v, g, beta, h0_local, do, dfinal, kept):
    """The backward of one shard as a coroutine: yields its state gradient G (the S part of the
    transposed pair) and the reverse scan's seed, receives the gradient at the shard's end (the
    reverse scan applied to the seed), returns (grads, dh0 rows or None)."""
    dht = _inner_dht(plan, dfinal, h0_local)
    prepared = _backward_prepare(backend, opts, plan, q, k, v, g, beta, kept)
    G = _shard_state_grad(backend, opts, plan, q, k, v, g, beta, h0_local, do, dht, dfinal, prepared)
    d_end = yield G, _end_seed(plan, dfinal)
    dht = _end_dht(plan, d_end, dht)
    return _shard_backward(backend, opts, plan, q, k, v, g, beta, h0_local, do, dht, prepared)


def _resume(stages, value):
    """Send ``value`` into a stage coroutine waiting at its one yield; its return value."""
    try:
        stages.send(value)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a CP stage coroutine yielded twice")


class CPChunkKDAFunction(torch.autograd.Function):
    """Autograd of cp_chunk_kda. Collectives run in forward and backward on every rank."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, group, backend: Backend, opts: KDAOptions, plan: _Plan):
        h0_all = h0.to(reference._compute_dtype(q.dtype))
        # empty packed sequences run nowhere: the stages see the others' rows only
        h0 = h0_all if plan.keep is None else h0_all[list(plan.keep)]
        stages = _forward_stages(backend, opts, plan, q, k, v, g, beta, h0)
        pair, overlap = next(stages)
        s_in = _exclusive(pair, plan, group, reverse=False, overlap=overlap)
        o, ht, h0_local, prepared = _resume(stages, s_in)
        kept = backend.keep_for_backward(prepared)  # what the backward need not recompute
        del prepared
        ctx.save_for_backward(q, k, v, g, beta, h0_local, *kept)
        ctx.pair, ctx.group, ctx.backend, ctx.opts, ctx.plan = pair, group, backend, opts, plan
        ctx.n_all = h0_all.shape[0]
        if not opts.output_final_state:
            return o, None
        # Final states: each sequence's row is filled by the rank where it ends, then summed.
        final = _sum_over_ranks(_final_rows(plan, ht, h0), group, plan.size)
        if plan.keep is not None:  # an empty sequence's final state is its initial state (replicated)
            final = _with_rows(h0_all, plan.keep, final)
        return o, final

    @staticmethod
    @first_order_only("cp_chunk_kda")
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, h0_local, *kept = ctx.saved_tensors
        group, backend, opts, plan = ctx.group, ctx.backend, ctx.opts, ctx.plan
        dfinal_all = None
        if opts.output_final_state and dfinal is not None:
            # The final states are replicated on every rank: their gradient is the sum over ranks.
            dfinal = dfinal_all = _sum_over_ranks(dfinal.to(h0_local.dtype), group, plan.size)
            if plan.keep is not None:
                dfinal = dfinal_all[list(plan.keep)]
        else:
            dfinal = None
        stages = _backward_stages(backend, opts, plan, q, k, v, g, beta, h0_local, do, dfinal, kept)
        G, seed = next(stages)
        pair = ctx.pair
        if _row_in_place(pair) is not None:  # the summary's buffer: G takes the spent S~ half, the row goes as it is
            G = pair.S.copy_(G)
        d_end = _exclusive(scan.AffineMap(pair.M, G), plan, group, reverse=True, seed=seed)
        grads, dh0 = _resume(stages, d_end)
        if dh0 is not None:
            # Gradient of the replicated initial states: rows filled where each sequence starts.
            dh0 = _sum_over_ranks(dh0, group, plan.size)
            if plan.keep is not None:  # empty sequences pass their final-state gradient to h0
                base = dfinal_all if dfinal_all is not None else dh0.new_zeros(ctx.n_all, *dh0.shape[1:])
                dh0 = _with_rows(base, plan.keep, dh0)
        return (
            grads.dq.to(q.dtype), grads.dk.to(k.dtype), grads.dv.to(v.dtype), grads.dg.to(g.dtype),
            grads.dbeta.to(beta.dtype), dh0, None, None, None, None,
        )


def cp_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cp_group,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    chunk_size: int = 64,
    backend: BackendName = "auto",
    exchange: Exchange = "auto",
    scan_method: scan.ScanMethod = "sequential",
    check_gate: bool = True,
    g_min: float | None = DEFAULT_G_MIN,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    segment_len: int | str | None = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over a sequence sharded across ``cp_group``; equals :func:`kda_cp.chunk_kda` on the whole.

    Math: the module docstring (docs/design.md §3-§5); the recurrence of Kimi Linear Eq. 1.

    Args:
        q, k: [B, T_r, H, K], this rank's contiguous shard (rank r holds the r-th piece along T).
        v: [B, T_r, H, V]; g: [B, T_r, H, K] (log decay, <= 0); beta: [B, T_r, H].
            T_r >= 1 may differ between ranks and need not be a multiple of ``chunk_size``.
        cp_group: the process group of the CP ranks (torch.distributed). None means no CP (the
            tensors are whole sequences, as ``cp_context=None`` in flash-linear-attention), which
            is only accepted where torch.distributed is not initialized or has one rank: in a
            multi-rank world None is an error (it is not the default group; pass
            ``dist.group.WORLD`` for that, or call :func:`kda_cp.chunk_kda` for whole sequences).
        scale: output scale; default K ** -0.5.
        initial_state: [N, H, K, V], the state before the first token of each sequence (N = B, or
            the number of packed sequences), the same tensor on every rank (replicated). Its
            gradient is the full dL/dS_0 on every rank.
        output_final_state: also return each sequence's state after its last token, replicated on
            every rank; its gradient is summed over ranks (a replicated value).
        cu_seqlens: GLOBAL offsets of packed sequences (FlashAttention convention, B = 1), the
            same on every rank; sequences may cross any number of rank boundaries. A zero-length
            sequence keeps its initial state (its final state; docs/design.md §5).
        chunk_size, backend, check_gate, g_min, allow_neg_eigval: as in :func:`kda_cp.chunk_kda`.
        segment_len: as in :func:`kda_cp.chunk_kda`; this rank cuts the sequences of its own shard
            (a rank's choice: the ranks need not agree).
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel: as
            in :func:`kda_cp.chunk_kda` (per-token transforms, applied to each shard; A_log and
            dt_bias are replicated, their gradients this rank's share).
        exchange: "allgather" (P pairs to every rank, then each folds those before it), "p2p" (log-depth scan
            over point-to-point sends), or "auto" (all-gather up to P2P_ABOVE ranks).
        scan_method: schedule of a rank's fold after an all-gather: "sequential" (the chain of
            states, one batched product per earlier rank: the fewest kernels and FLOPs for the
            group sizes that all-gather) or "log_depth" (a pairwise tree of maps, then applied).

    Returns:
        (o [B, T_r, H, V] for this shard, final_state [N, H, K, V] or None).

    Raises:
        ValueError: on every rank of the group when any rank's inputs are malformed (any exception
            while checking them is turned into this), the ranks disagree on B, H, K, V, dtype,
            the options (exchange, scan_method, scale, g_min), cu_seqlens or the values of
            ``initial_state`` (a digest of its bytes), cu_seqlens is not increasing from 0 to the
            sum of the local lengths, or a shard is empty; when this process is not in
            ``cp_group``; cp_group=None in an initialized world of more than one rank. Also a
            bad ``backend`` name or ``scale``.
        NotImplementedError: on the rank whose inputs ``backend="tilelang"`` does not cover (the
            other ranks get the ValueError naming it); in backward, a double backward
            (``create_graph=True``), on every rank.

    Gradients of the replicated ``initial_state`` and final states assume the global loss is the
    sum of the ranks' losses (as data-parallel training does): do not all-reduce
    ``initial_state.grad`` over the CP group again.

    Collective: every rank of ``cp_group`` must call it (and run backward) in the same order.
    """
    if cp_group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # each rank would compute its shard as a whole sequence: a silently wrong answer
        raise ValueError(
            f"cp_chunk_kda: cp_group=None in an initialized process group of {dist.get_world_size()} ranks: pass the "
            "CP group (e.g. dist.group.WORLD), or call kda_cp.chunk_kda when each rank holds whole sequences"
        )
    rank, size = group_rank_and_size(cp_group)
    error, cu_code, unsupported, cs_local = None, [0, 0], None, None
    try:
        check_flags(output_final_state=output_final_state, check_gate=check_gate,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
        q, k = expand_value_heads(q, k, v)
        if use_qk_l2norm_in_kernel or use_gate_in_kernel or use_beta_sigmoid_in_kernel or A_log is not None \
                or dt_bias is not None:
            if check_gate and isinstance(g, torch.Tensor) and isinstance(beta, torch.Tensor):
                check_gate_args(q, g, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel, g_min=g_min)
                check_preactivations(g, beta, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
            q, k, g, beta = apply_input_options(
                q, k, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, g_min=g_min, allow_neg_eigval=allow_neg_eigval)
        if scan_method not in ("sequential", "log_depth"):
            raise ValueError(f"scan_method must be 'sequential' or 'log_depth', got {scan_method!r}")
        if cu_seqlens is not None:
            if q.dim() != 4 or q.shape[0] != 1:
                raise ValueError(f"cu_seqlens needs B == 1 (sequences packed along T), got q {list(q.shape)}")
            cs_local = check_offsets(cu_seqlens)
            n_seq = len(cs_local) - 1
            cu_code = [len(cs_local), digest(cs_local)]
            check_inputs(q, k, v, g, beta, None, None, chunk_size, check_gate, g_min, layout_warning=False,
                         allow_neg_eigval=allow_neg_eigval)
            if initial_state is not None:  # [N sequences, HV, K, V], then dtype and device (as for one), then values
                if not isinstance(initial_state, torch.Tensor):
                    raise ValueError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
                want = [n_seq, v.shape[2], k.shape[3], v.shape[3]]
                if list(initial_state.shape) != want:
                    raise ValueError(f"initial_state must be [N, HV, K, V] = {want} with N = {n_seq} sequences "
                                     f"(cu_seqlens), got {list(initial_state.shape)}")
                check_inputs(q, k, v, g, beta, initial_state[:1], None, chunk_size, False, g_min,
                             layout_warning=False)
                if check_gate and initial_state.numel() and not bool(torch.isfinite(initial_state).all()):
                    raise ValueError("initial_state must be finite (NaN or Inf in the input)")
        else:
            check_inputs(q, k, v, g, beta, initial_state, None, chunk_size, check_gate, g_min, layout_warning=False,
                         allow_neg_eigval=allow_neg_eigval)
        if q.shape[1] < 1:
            raise ValueError("every rank's shard must hold at least one token (T_r >= 1)")
        check_scale(scale)
        exchange_kind = choose_exchange(exchange, size)
        dense = dense_on_cuda(q, k, v, g, beta)
        impl = get_backend(backend, *dense, None, g_min, chunk_size)  # a bad backend fails here
        impl = segmented(impl, segment_len, chunk_size)
    except Exception as exc:  # any failure on one rank must reach every rank (no hang)
        error = f"cp_chunk_kda on rank {rank}: {exc}"
        exchange_kind = "allgather"
        if isinstance(exc, NotImplementedError):  # inputs the backend asked for does not cover: keep the type
            unsupported = exc
    if size == 1:
        if error is not None:
            raise (NotImplementedError if unsupported is not None else ValueError)(error)
        cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens, device=q.device)
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu,
                         output_final_state=output_final_state, chunk_size=chunk_size, backend=backend,
                         check_gate=False, g_min=g_min, allow_neg_eigval=allow_neg_eigval, segment_len=segment_len)
    ok_shapes = error is None
    shape = list(q.shape) if ok_shapes else [0, 0, 0, 0]
    V = v.shape[-1] if ok_shapes else 0
    same = [shape[0], shape[2], shape[3], V, dtype_code(q.dtype) if ok_shapes else 0, int(initial_state is not None),
            int(output_final_state), chunk_size if ok_shapes else 0, int(cu_seqlens is not None)]
    options = [int(exchange_kind == "p2p"), int(scan_method == "sequential"),
               float_code(scale) if ok_shapes else 0, float_code(g_min) if ok_shapes else 0, *cu_code,
               tensor_digest(initial_state) if ok_shapes and size > 1 else 0,
               int(use_qk_l2norm_in_kernel), int(use_gate_in_kernel), int(use_beta_sigmoid_in_kernel),
               tensor_digest(A_log) if ok_shapes else 0, tensor_digest(dt_bias) if ok_shapes else 0,
               int(allow_neg_eigval)]
    device = q.device if ok_shapes else None
    try:
        table = agree_or_raise(same + options + [shape[1]], error, cp_group, "cp_chunk_kda", device=device)
    except ValueError as exc:
        if unsupported is not None:
            raise NotImplementedError(str(exc)) from unsupported
        raise
    n_same = len(same)
    if not bool((table[:, 1:1 + n_same] == table[0, 1:1 + n_same]).all()):
        names = {dtype_code(dt): str(dt).replace("torch.", "") for dt in _FLOAT_DTYPES}
        rows = [[*r[:4], names.get(r[4], "?"), *(bool(x) for x in r[5:7]), r[7], bool(r[8])]
                for r in table[:, 1:1 + n_same].tolist()]
        raise ValueError(
            "cp_chunk_kda: ranks disagree on [B, H, K, V, dtype, has_initial_state, output_final_state, "
            "chunk_size, packed]: " + "; ".join(f"rank {i}: {r}" for i, r in enumerate(rows))
        )
    differ = (table[:, 1 + n_same:-1] != table[0, 1 + n_same:-1]).any(dim=0).tolist()
    if any(differ):
        names = ["exchange", "scan_method", "scale", "g_min", "len(cu_seqlens)", "cu_seqlens", "initial_state",
                 "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "A_log", "dt_bias",
                 "allow_neg_eigval"]
        raise ValueError(
            f"cp_chunk_kda: ranks disagree on the options [{', '.join(n for n, d in zip(names, differ) if d)}]; every "
            "rank of the group must pass the same values (initial_state, cu_seqlens, A_log and dt_bias are "
            "replicated: the same tensor everywhere)"
        )
    lengths = table[:, -1].tolist()
    start = sum(lengths[:rank])
    segs, n_rows, keep, n_all = None, 0, None, 0
    if cu_seqlens is not None:
        cs = cs_local  # checked above on this rank, agreed over the group
        if cs[-1] != sum(lengths):
            raise ValueError(f"cp_chunk_kda: cu_seqlens ends at {cs[-1]} but the ranks hold {lengths} "
                             f"= {sum(lengths)} tokens")
        n_all = len(cs) - 1
        cs, keep = nonempty_sequences(cs)
        segs = shard_segments(cs, start, start + lengths[rank])
        n_rows = len(cs) - 1
    B, _, H, K = q.shape
    opts = KDAOptions(scale=K**-0.5 if scale is None else float(scale), chunk_size=chunk_size,
                      output_final_state=output_final_state, g_min=g_min)
    q, k, v, g, beta = dense
    plan = _Plan(rank, size, segs, exchange_kind, scan_method, initial_state is not None, n_rows, keep)
    sdt = reference._compute_dtype(q.dtype)
    n_states = B if segs is None else n_all
    h0 = q.new_zeros(n_states, H, K, V, dtype=sdt) if initial_state is None else initial_state
    return CPChunkKDAFunction.apply(q, k, v, g, beta, h0, cp_group, impl, opts, plan)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {list(x.shape)} on {x.device}"
    return type(x).__name__


@torch.no_grad()
def cp_chunk_kda_in_one_process(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    world_size: int,
    lengths: list[int] | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    do: torch.Tensor | None = None,
    dfinal: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: BackendName = "auto",
    scan_method: scan.ScanMethod = "sequential",
    g_min: float | None = -5.0,
    allow_neg_eigval: bool = False,
):
    """Run the CP algorithm for all ``world_size`` shards of a global sequence in one process.

    The same per-shard stages as :func:`cp_chunk_kda` (summary, scan, local forward; state
    gradient, reverse scan, local backward), with the exchange replaced by stacking the shards'
    pairs. For checking the CP path of the GPU kernels on one device, and for benchmarks.

    Args:
        q, k, v, g, beta: the GLOBAL tensors ([B, T, H, *]; with GVA v, g and beta have HV heads, a
            multiple of q and k's H); shards are cut by ``lengths`` (default the even split of
            :func:`kda_cp.parallel.shard_bounds`).
        cu_seqlens, initial_state, output_final_state, scale, chunk_size, backend, g_min,
            allow_neg_eigval: as in :func:`cp_chunk_kda`.
        do: gradient of o, [B, T, H, V] like v; when given, the backward runs.
        dfinal: gradient of the final states [N, H, K, V] (with output_final_state and do only).

    Returns:
        (o [B, T, H, V], final_state or None, grads or None) with grads = (dq, dk, dv, dg, dbeta,
        dh0) of <o, do> + <final_state, dfinal>; dh0 is None without an initial state.

    Raises:
        ValueError: as :func:`kda_cp.chunk_kda` for the global inputs; bad world_size, lengths or
            scan_method; do not shaped like v; dfinal not [N, H, K, V], or given without
            output_final_state and do.
    """
    from kda_cp.parallel.sharding import shard_bounds

    check_flags(output_final_state=output_final_state)
    cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens)
    H_qk = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    q, k = expand_value_heads(q, k, v)  # GVA: q, k to v's HV heads; dq, dk summed back below
    check_inputs(q, k, v, g, beta, initial_state, cu, chunk_size, True, g_min, allow_neg_eigval=allow_neg_eigval)
    check_scale(scale)
    if scan_method not in ("sequential", "log_depth"):
        raise ValueError(f"scan_method must be 'sequential' or 'log_depth', got {scan_method!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    n_states = B if cu is None else cu.numel() - 1
    if do is not None and (not isinstance(do, torch.Tensor) or not do.is_floating_point()
                           or tuple(do.shape) != tuple(v.shape) or do.device != v.device):
        raise ValueError(f"do (the gradient of o) must be a float tensor shaped like v, {list(v.shape)}, on "
                         f"{v.device}, got {_describe(do)}")
    if dfinal is not None:
        if not output_final_state or do is None:
            raise ValueError("dfinal (the gradient of the final states) needs output_final_state=True and do")
        want = [n_states, H, K, V]
        if not isinstance(dfinal, torch.Tensor) or not dfinal.is_floating_point() or list(dfinal.shape) != want \
                or dfinal.device != v.device:
            raise ValueError(f"dfinal must be a float tensor [N, H, K, V] = {want} on {v.device}, got {_describe(dfinal)}")
    bounds = shard_bounds(T, world_size, lengths)
    if any(b <= a for a, b in bounds):
        raise ValueError(f"every shard must hold at least one token, got bounds {bounds}")
    opts = KDAOptions(scale=K**-0.5 if scale is None else float(scale), chunk_size=chunk_size,
                      output_final_state=output_final_state, g_min=g_min)
    impl = get_backend(backend, q, k, v, g, beta, None, g_min, chunk_size)
    cs, keep = (None, None) if cu is None else nonempty_sequences(check_offsets(cu, T))
    n_rows = 0 if cs is None else len(cs) - 1
    plans = [
        _Plan(r, world_size, None if cs is None else shard_segments(cs, a, b), "allgather", scan_method,
              initial_state is not None, n_rows, keep)
        for r, (a, b) in enumerate(bounds)
    ]
    sdt = reference._compute_dtype(q.dtype)
    h0_all = q.new_zeros(n_states, H, K, V, dtype=sdt) if initial_state is None else initial_state.to(sdt)
    h0 = h0_all if keep is None else h0_all[list(keep)]  # empty sequences run nowhere (as cp_chunk_kda)

    def shard(x, r):
        a, b = bounds[r]
        return x[:, a:b].contiguous()

    ins = [[shard(x, r) for x in (q, k, v, g, beta)] for r in range(world_size)]
    # the distributed op's stages for every shard, the exchange replaced by stacking the pairs
    stages = [_forward_stages(impl, opts, plans[r], *ins[r], h0) for r in range(world_size)]
    pairs = []
    for st in stages:
        pair, overlap = next(st)
        if overlap is not None:
            overlap()
        pairs.append(pair)
    maps = scan.AffineMap(torch.stack([p.M for p in pairs]), torch.stack([p.S for p in pairs]))
    # each rank's own fold of the gathered pairs, as cp_chunk_kda computes it after an all-gather;
    # every shard's prepared tensors are alive here, as on P ranks
    outs, kept = [], []
    for r, st in enumerate(stages):
        out = _resume(st, _fold(maps, r, scan_method, reverse=False))
        kept.append(impl.keep_for_backward(out[3]))  # trimmed at once: what the backward need not recompute
        outs.append(out[:3])
    o = torch.cat([x[0] for x in outs], dim=1)
    final = sum(_final_rows(plans[r], outs[r][1], h0) for r in range(world_size)) if output_final_state else None
    if final is not None and keep is not None:
        final = _with_rows(h0_all, keep, final)
    if do is None:
        return o, final, None
    dfin_all = dfin = dfinal.to(sdt) if (output_final_state and dfinal is not None) else None
    if dfin is not None and keep is not None:
        dfin = dfin_all[list(keep)]
    stages = [_backward_stages(impl, opts, plans[r], *ins[r], outs[r][2], shard(do, r), dfin, kept[r])
              for r in range(world_size)]
    del kept
    Gs, seeds = zip(*[next(st) for st in stages])
    tmaps = scan.AffineMap(torch.stack([p.M for p in pairs]), torch.stack(Gs))
    grads, dh0 = [], None
    for r, st in enumerate(stages):
        gr, rows = _resume(st, _fold(tmaps, r, scan_method, reverse=True, seed=seeds[r]))
        grads.append(gr)
        if rows is not None:
            dh0 = rows if dh0 is None else dh0 + rows
    if dh0 is not None and keep is not None:
        dh0 = _with_rows(dfin_all if dfin_all is not None else dh0.new_zeros(n_states, *dh0.shape[1:]), keep, dh0)
    cat = [torch.cat([getattr(gr, name) for gr in grads], dim=1) for name in ("dq", "dk", "dv", "dg", "dbeta")]
    if H_qk != H:  # GVA: each key head's gradient sums over the value heads of its group
        cat[:2] = [d.unflatten(2, (H_qk, H // H_qk)).sum(3) for d in cat[:2]]
    return o, final, (*cat, dh0)
