"""Context-parallel KDA: exact chunk_kda over a sequence sharded across the ranks of a group.

Forward on rank r (DESIGN.md §3; Kimi K3 report, CP by affine prefix scan):
  1. summarize the shard from a zero state: (M_r, S~_r) with S_out = M_r S_in + S~_r;
  2. all-gather the pairs; exclusive scan gives S_in^r = (pair_{r-1} o ... o pair_0)(S_0);
  3. the ordinary chunk forward from S_in^r gives this shard's o.
Backward on rank r, with D_r = dL/dS_out^r:
  1. G_r = dh0 of the shard's outputs alone (dht = 0);
  2. all-gather G; D_r = reverse exclusive scan of x -> M_j^T x + G_j over j > r, started at the
     gradient of the global final state;
  3. the ordinary chunk backward from S_in^r with dht = D_r gives exact dq, dk, dv, dg, dbeta.

Communication per rank and call: B*H*K*(K+V) values forward and B*H*K*V backward (fp32),
times P for the all-gather; independent of T.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kda_cp import reference, scan
from kda_cp.ops import Backend, KDAOptions, check_inputs, chunk_kda, get_backend, BackendName
from kda_cp.parallel.exchange import agree_or_raise, all_gather_stack, group_rank_and_size

__all__ = ["cp_chunk_kda"]

_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


class _Saved(NamedTuple):
    maps: scan.AffineMap  # every rank's (M, S~), stacked [P, B, H, K, *]
    s_in: torch.Tensor  # this rank's true incoming state [B, H, K, V]


class CPChunkKDAFunction(torch.autograd.Function):
    """Autograd of cp_chunk_kda. Collectives run in forward and backward on every rank."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, group, backend: Backend, opts: KDAOptions, scan_method):
        rank, size = group_rank_and_size(group)
        M, St = backend.summary(k, v, g, beta, opts)
        sdt = M.dtype
        maps = scan.AffineMap(all_gather_stack(M, group), all_gather_stack(St.to(sdt), group))
        prefix = scan.exclusive_scan(maps, scan_method)
        h0 = h0.to(sdt)
        s_in = scan.apply(scan.AffineMap(prefix.M[rank], prefix.S[rank]), h0)
        o, _ = backend.fwd(q, k, v, g, beta, s_in, opts)
        ctx.save_for_backward(q, k, v, g, beta)
        ctx.saved = _Saved(maps, s_in)
        ctx.group, ctx.backend, ctx.opts, ctx.scan_method = group, backend, opts, scan_method
        ctx.rank = rank
        if opts.output_final_state:
            last = scan.AffineMap(maps.M[-1], maps.S[-1])
            final = scan.apply(scan.compose(last, scan.AffineMap(prefix.M[-1], prefix.S[-1])), h0)
            return o, final
        return o, None

    @staticmethod
    def backward(ctx, do, dfinal):
        import torch.distributed as dist

        q, k, v, g, beta = ctx.saved_tensors
        maps, s_in = ctx.saved
        group, backend, opts, rank = ctx.group, ctx.backend, ctx.opts, ctx.rank
        sdt = s_in.dtype
        if do is None:
            do = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
        G = backend.state_grad(q, k, v, g, beta, do, opts).to(sdt)
        G_all = all_gather_stack(G, group)
        if opts.output_final_state and dfinal is not None:
            # The final state is replicated on every rank: its gradient is the sum over ranks.
            dfinal = dfinal.to(sdt).contiguous()
            if maps.M.shape[0] > 1:
                dist.all_reduce(dfinal, group=group)
        else:
            dfinal = torch.zeros_like(s_in)
        suffix = scan.reverse_transposed_exclusive_scan(scan.AffineMap(maps.M, G_all), ctx.scan_method)
        d_r = scan.apply(scan.AffineMap(suffix.M[rank], suffix.S[rank]), dfinal)
        grads = backend.bwd(q, k, v, g, beta, s_in, do, d_r, opts)
        # Gradient of the (replicated) initial state: t_0(D_0) = M_0^T D_0 + G_0, the same on every rank.
        d_0 = scan.apply(scan.AffineMap(suffix.M[0], suffix.S[0]), dfinal)
        dh0 = maps.M[0].transpose(-1, -2) @ d_0 + G_all[0]
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
    chunk_size: int = 64,
    backend: BackendName = "auto",
    scan_method: scan.ScanMethod = "log_depth",
    check_gate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over a sequence sharded across ``cp_group``; equals :func:`kda_cp.chunk_kda` on the whole.

    Math: DESIGN.md §3 (module docstring); the recurrence of Kimi Linear Eq. 1.

    Args:
        q, k: [B, T_r, H, K], this rank's contiguous shard (rank r holds the r-th piece along T).
        v: [B, T_r, H, V]; g: [B, T_r, H, K] (log decay, <= 0); beta: [B, T_r, H].
            T_r may differ between ranks and need not be a multiple of ``chunk_size``.
        cp_group: the process group of the CP ranks (torch.distributed), or None for one device.
        scale: output scale; default K ** -0.5.
        initial_state: [B, H, K, V], the state before the first token of the whole sequence, the
            same tensor on every rank (replicated). Its gradient is the full dL/dS_0 on every rank.
        output_final_state: also return the state after the last token of the whole sequence,
            replicated on every rank; its gradient is summed over ranks (a replicated value).
        chunk_size, backend, check_gate: as in :func:`kda_cp.chunk_kda`.
        scan_method: "log_depth" or "sequential" schedule of the local scan over the gathered pairs.

    Returns:
        (o [B, T_r, H, V] for this shard, final_state [B, H, K, V] or None).

    Raises:
        ValueError: on every rank of the group when any rank's inputs are malformed or the ranks
            disagree on B, H, K, V, dtype or the optional arguments; when this process is not in
            ``cp_group``.

    Collective: every rank of ``cp_group`` must call it (and run backward) in the same order.
    """
    rank, size = group_rank_and_size(cp_group)
    error = None
    try:
        check_inputs(q, k, v, g, beta, initial_state, None, chunk_size, check_gate)
    except ValueError as exc:
        error = f"cp_chunk_kda on rank {rank}: {exc}"
    if size == 1:
        if error is not None:
            raise ValueError(error)
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, chunk_size=chunk_size, backend=backend,
                         check_gate=False)
    shape = list(q.shape) if q.dim() == 4 else [0, 0, 0, 0]
    V = v.shape[-1] if v.dim() == 4 else 0
    meta = [shape[0], shape[2], shape[3], V, _DTYPES.get(q.dtype, 0), int(initial_state is not None),
            int(output_final_state), chunk_size]
    table = agree_or_raise(meta, error, cp_group, "cp_chunk_kda")
    ref = table[0, 1:]
    if not bool((table[:, 1:] == ref).all()):
        raise ValueError(
            "cp_chunk_kda: ranks disagree on [B, H, K, V, dtype, has_initial_state, output_final_state, "
            f"chunk_size]: {table[:, 1:].tolist()}"
        )
    B, _, H, K = q.shape
    opts = KDAOptions(scale=K**-0.5 if scale is None else float(scale), chunk_size=chunk_size,
                      output_final_state=output_final_state)
    impl = get_backend(backend, q, k, v, g, beta)
    sdt = reference._compute_dtype(q.dtype)
    h0 = q.new_zeros(B, H, K, V, dtype=sdt) if initial_state is None else initial_state
    return CPChunkKDAFunction.apply(q, k, v, g, beta, h0, cp_group, impl, opts, scan_method)
