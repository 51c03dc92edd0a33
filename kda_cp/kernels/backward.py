"""TileLang backward of KDA: the orchestrator of the backward stages (Hopper, bf16/fp16).

Public API (to be wired into ``kda_cp.ops.TileLangBackend`` by ops.py):

    chunk_kda_bwd(q, k, v, g, beta, *, scale, initial_state, do, dht, cu_seqlens=None,
                  chunk_size=64, g_min=-5.0, prepared=None) -> (dq, dk, dv, dg, dbeta, dh0)
    chunk_kda_state_grad(q, k, v, g, beta, *, scale, do, cu_seqlens=None, chunk_size=64, g_min=-5.0,
                         prepared=None) -> dh0

Stages (the math is tests/_bwd_mirror.py, checked in fp64 against autograd):

1. W, U, Aqk, eC per chunk from the forward (``prepared``, as chunk_kda's autograd keeps them;
   intra.py's decay kernel remakes Qg, Kd from q, k, g), or all six recomputed by intra.py's
   chunk-local kernel when no ``prepared`` is given.
2. bwd_state.py, two launches: the forward walk storing each chunk's start state Hs; the reverse
   walk storing each chunk's end-state gradient dHs and the initial state's gradient dh0.
3. bwd_intra.py "dv": V', dV' and the gradients of Aqk, Qg, Kd, eC, W, U.
4. bwd_intra.py "ut": the UT transform's backward: dv, dbeta, dB, dGk.
5. bwd_intra.py "dk": the decayed products' backward; dq, dk, dg.

What the forward keeps for the backward (ops.py's autograd; kernels.keep_for_backward): its inputs
and W, U, Aqk in the input dtype and eC in fp32, (K + V + C) values per token and head plus K / C:
with o, 906 MiB at S1 (T = 32768, H = 32, K = V = 128, bf16) against flash-linear-attention's
1024 MiB, measured by scripts/bench_backward.py. Qg and Kd (another 2K per token and head) are
remade by a cheap kernel (0.40 ms at S1) instead of the chunk-local kernel (1.10 ms). Autograd holds
the kept tensors until the backward returns, so the ``del``s below free them only when no one else
holds them (a ``prepared`` from chunk_kda_fwd_prepare): at K = V = 128 the backward's peak (at
"dv") is unchanged (3350 MiB at S1), at K = V = 64 keeping them through "dk" raises it by about
K + V + C values per token and head.
Transient backward buffers, per token and head: W, U, Qg, Kd (4 x K in the input dtype), Aqk (C in
the input dtype), dAqk, dB (2 x C in bf16), dW, dU (2 x K), dQg, dKd, dGk (3 x K in bf16), and per
chunk Hs, dHs (2 x K x V in the input dtype); they are freed as soon as the next stage no longer
needs them. Every fp32-accumulated intermediate is rounded once to bf16 (fp32's range, also for
fp16 input): the fp64 mirror with these roundings moves dq, dk, dg by < 4e-4 relative; for fp16
input, dAqk and dB bring 8 instead of 11 significant bits into "dk".

The state gradient (``chunk_kda_state_grad``) runs stage 1 and the reverse walk of stage 2 only:
G = dh0 of <o, do> with dht = 0, which context parallelism needs (docs/design.md §4.2). Both take the
forward's ``PreparedForward`` instead of running stage 1: the CP backward computes it once for the
state gradient and the backward.
"""
from __future__ import annotations

import torch

from ._common import build_chunk_tables, host_offsets
from .launch import check_tensor, kernel_inputs, prepared_tensors, tl_name, validate_inputs

__all__ = ["chunk_kda_bwd", "chunk_kda_state_grad"]


def _recompute_intra(qf, kf, vf, gf, bf, tables, H, K, V, C, dt, scale, dtype, dev, general=False):
    from .intra import build_intra_kernel

    NC = tables.num_chunks
    W = torch.empty(NC, H, C, K, device=dev, dtype=dtype)
    U = torch.empty(NC, H, C, V, device=dev, dtype=dtype)
    Qg = torch.empty(NC, H, C, K, device=dev, dtype=dtype)
    Kd = torch.empty(NC, H, C, K, device=dev, dtype=dtype)
    Aqk = torch.empty(NC, H, C, C, device=dev, dtype=dtype)
    Ec = torch.empty(NC, H, K, device=dev, dtype=torch.float32)
    build_intra_kernel(None, K, V, C, dt, scale=float(scale), general=general)(
        qf, kf, vf, gf, bf, tables.chunk_table, W, U, Qg, Kd, Aqk, Ec)
    return W, U, Qg, Kd, Aqk, Ec


def _walk_block_v(dev, N, H, V):
    """Value columns per block of the state walks: 32, or 16 when the (V / 16) * N * H blocks that
    gives still fit the SMs in one wave (each block walks its sequence's chunks in order, one per
    SM; with SMs idle, more and narrower blocks finish the walk sooner).
    H200 (docs/results/h200_tune_launches.json), 32 / 16 columns: T = 131072, H = 16 (128 blocks of
    16) forward walk 1.96 / 1.57 ms, reverse walk 2.39 / 2.09 ms; T = 32768, H = 32 (256 blocks of
    16) forward walk 0.51 / 0.79 ms."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return 16 if V % 16 == 0 and (V // 16) * N * H <= sms else 32


def chunk_kda_bwd(q, k, v, g, beta, *, scale: float, initial_state=None, do, dht=None, cu_seqlens=None,
                  chunk_size: int = 64, g_min: float | None = -5.0, prepared=None):
    """Gradients of L = <o, do> + <ht, dht> for the KDA chunk forward, with TileLang kernels.

    Math: S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
    o_t = scale * S_t^T q_t, S_{-1} = initial_state (zero if None), ht = the last state of each
    sequence. Derivation and stage order: tests/_bwd_mirror.py.

    Args:
        q, k: [B, T, H, K] bf16 or fp16, contiguous. v: [B, T, H, V], same dtype.
        g: [B, T, H, K] fp32 log decay per step (natural log, not cumsummed), in [g_min, 0].
        beta: [B, T, H] fp32 or q's dtype.
        scale: the forward's output scale (static: part of the kernels' cache key).
        initial_state: [N, H, K, V] fp32 or None (zero); N = B, or the number of sequences.
        do: [B, T, H, V] in q's dtype, contiguous: gradient of o.
        dht: [N, H, K, V] fp32 or None (zero): gradient of the final state.
        cu_seqlens: [N + 1] int32/int64 packed-sequence offsets (B == 1), read once on the host.
            Tokens past cu_seqlens[-1] get exact zero gradients.
        chunk_size: 64. g_min: declared gate bound in [-5, 0) (relied on, not checked).
        prepared: :func:`kda_cp.kernels.chunk_kda_fwd_prepare`'s result for these very inputs, or
            :func:`kda_cp.kernels.restore_prepared`'s from what the forward kept (then stage 1 only
            remakes Qg, Kd), or None (stage 1 recomputes everything). It is consumed: its tensors
            are freed stage by stage.
    Returns:
        (dq [B,T,H,K], dk [B,T,H,K], dv [B,T,H,V] in q's dtype; dg [B,T,H,K] fp32;
         dbeta [B,T,H] in beta's dtype; dh0 [N,H,K,V] fp32).
    Raises:
        ValueError on a shape, dtype, contiguity or option mismatch (the message shows the shapes),
        q, k, v or g not TMA_ALIGN-byte aligned, more than MAX_GRID_YZ sequences or heads, or a
        ``prepared`` made for other inputs or already consumed.
    Numerics: cumsums, exponentials, triangular solve, states and state gradients in fp32; GEMM
        operands in the input dtype (decayed products in bf16), fp32 accumulation.
    """
    from .bwd_intra import build_bwd_dk_kernel, build_bwd_dv_kernel, build_bwd_ut_kernel
    from .bwd_state import build_bwd_state_kernel

    B, T, H, K, V = validate_inputs(q, k, v, g, beta, cu_seqlens, chunk_size, g_min)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    check_tensor("do", do, (B, T, H, V), (q.dtype,))
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (N, H, K, V), (torch.float32,))
    if dht is not None:
        check_tensor("dht", dht, (N, H, K, V), (torch.float32,))
    dev, dtype, C = q.device, q.dtype, chunk_size
    offsets = None if cu_seqlens is None else host_offsets(cu_seqlens)
    start, end = (0, B * T) if offsets is None else (min(offsets[0], B * T), min(offsets[-1], B * T))

    def grad_buffers(*shapes_dtypes):  # allocated only where first written, to keep the peak down
        bufs = [torch.empty(*shape, device=dev, dtype=dt_) for shape, dt_ in shapes_dtypes]
        for b in bufs:  # the kernels write every row of a sequence; rows outside all of them get zeros
            if start > 0:
                b.view(B * T, -1)[:start].zero_()
            if end < B * T:
                b.view(B * T, -1)[end:].zero_()
        return bufs

    qk_grad = ((B, T, H, K), dtype)
    g_grad = ((B, T, H, K), torch.float32)
    v_grad, beta_grad = ((B, T, H, V), dtype), ((B, T, H), torch.float32)
    zeros_state = None
    if initial_state is None or dht is None:
        zeros_state = torch.zeros(N, H, K, V, device=dev, dtype=torch.float32)
    h0 = initial_state if initial_state is not None else zeros_state
    dht_ = dht if dht is not None else zeros_state
    if T == 0 or N == 0:
        dq, dk, dv, dg, dbeta = grad_buffers(qk_grad, qk_grad, v_grad, g_grad, beta_grad)
        return dq, dk, dv, dg, dbeta.to(beta.dtype), dht_.clone()

    tables = build_chunk_tables(B, T, cu_seqlens, C, dev)
    NC = tables.num_chunks
    dt = tl_name(dtype)
    qf, kf, vf, gf, bf = kernel_inputs(q, k, v, g, beta)
    general = g_min is None
    if prepared is None:
        W, U, Qg, Kd, Aqk, Ec = _recompute_intra(qf, kf, vf, gf, bf, tables, H, K, V, C, dt, scale, dtype, dev,
                                                 general)
    else:
        W, U, Qg, Kd, Aqk, Ec, _ = prepared_tensors(prepared, "chunk_kda_bwd", q, k, v, g, beta, scale, C,
                                                     cu_seqlens, consume=True, general=general)
        del prepared

    # ---- stage 2: chunk-start states and chunk-end state gradients ----
    Hs = torch.empty(NC, H, K, V, device=dev, dtype=dtype)
    dHs = torch.empty(NC, H, K, V, device=dev, dtype=dtype)
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32)
    dof = do.view(B * T, H, V)
    bv = _walk_block_v(dev, N, H, V)
    for walk in ("forward", "reverse"):
        build_bwd_state_kernel(None, K, V, C, dt, walk=walk, block_v=bv)(
            W, U, Qg, Kd, Aqk, Ec, dof, tables.seq_table, h0, dht_, Hs, dHs, dh0)
    del Qg

    # ---- stage 3: "dv" ----
    mid = torch.bfloat16  # fp32-accumulated intermediates stored in bf16 (range of fp32, even for fp16 input)
    dAqk = torch.empty(NC, H, C, C, device=dev, dtype=mid)
    dQg = torch.empty(NC, H, C, K, device=dev, dtype=mid)
    dKd = torch.empty(NC, H, C, K, device=dev, dtype=mid)
    dEc = torch.empty(NC, H, K, device=dev, dtype=torch.float32)
    dW = torch.empty(NC, H, C, K, device=dev, dtype=dtype)
    dU = torch.empty(NC, H, C, V, device=dev, dtype=dtype)
    build_bwd_dv_kernel(None, K, V, C, dt)(W, U, Kd, Aqk, Hs, dHs, dof, tables.chunk_table,
                                           dAqk, dQg, dKd, dEc, dW, dU)
    del Hs, dHs, Kd, Aqk

    # ---- stage 4: "ut" ----
    dv, dbeta = grad_buffers(v_grad, beta_grad)
    dB = torch.empty(NC, H, C, C, device=dev, dtype=mid)
    dGk = torch.empty(NC, H, C, K, device=dev, dtype=mid)
    build_bwd_ut_kernel(None, K, V, C, dt, general=general)(kf, vf, gf, bf, tables.chunk_table, W, U, dW, dU,
                                           dv.view(B * T, H, V), dbeta.view(B * T, H), dB, dGk)
    del W, U, dW, dU

    # ---- stage 5: "dk" ----
    dq, dk, dg = grad_buffers(qk_grad, qk_grad, g_grad)
    build_bwd_dk_kernel(None, K, C, dt, scale=float(scale), general=general)(
        qf, kf, gf, tables.chunk_table, dAqk, dB, dQg, dKd, dGk, dEc,
        dq.view(B * T, H, K), dk.view(B * T, H, K), dg.view(B * T, H, K))
    return dq, dk, dv, dg, dbeta.to(beta.dtype), dh0


def chunk_kda_state_grad(q, k, v, g, beta, *, scale: float, do, cu_seqlens=None, chunk_size: int = 64,
                         g_min: float | None = -5.0, prepared=None):
    """G = dh0 of <o, do> with dht = 0: the context-parallel state gradient (docs/design.md §4.2).

    o is affine in h0, so G does not depend on h0; no state is recomputed and no dq/dk/dv is formed:
    stage 1 (intra recompute) and the reverse walk of bwd_state.py only.

    Args:
        q, k: [B, T, H, K] bf16/fp16; v: [B, T, H, V]; g: [B, T, H, K] fp32 in [g_min, 0];
        beta: [B, T, H] fp32 or q's dtype; do: [B, T, H, V] q's dtype; all contiguous.
        scale: output scale. cu_seqlens: [N + 1] packed-sequence offsets (B == 1) or None.
        chunk_size: 64. g_min: declared gate bound in [-5, 0), or None (any g <= 0: the
            general-gate kernels).
        prepared: :func:`kda_cp.kernels.chunk_kda_fwd_prepare`'s result for these inputs and
            cu_seqlens, or None; read, not consumed: the CP backward passes the same one on to
            :func:`chunk_kda_bwd`, so stage 1 runs once for both.
    Returns:
        dh0 [N, H, K, V] fp32 (N = B, or the number of sequences), one row per sequence.
    Raises:
        ValueError on a shape, dtype, contiguity or option mismatch, q, k, v or g not TMA_ALIGN-byte
        aligned, more than MAX_GRID_YZ sequences or heads, or a ``prepared`` made for other inputs.
    """
    from .bwd_state import build_bwd_state_kernel

    B, T, H, K, V = validate_inputs(q, k, v, g, beta, cu_seqlens, chunk_size, g_min)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    check_tensor("do", do, (B, T, H, V), (q.dtype,))
    dev, dtype, C = q.device, q.dtype, chunk_size
    zeros = torch.zeros(N, H, K, V, device=dev, dtype=torch.float32)
    if T == 0 or N == 0:
        return zeros
    tables = build_chunk_tables(B, T, cu_seqlens, C, dev)
    dt = tl_name(dtype)
    if prepared is None:
        qf, kf, vf, gf, bf = kernel_inputs(q, k, v, g, beta)
        W, U, Qg, Kd, Aqk, Ec = _recompute_intra(qf, kf, vf, gf, bf, tables, H, K, V, C, dt, scale, dtype, dev,
                                                 g_min is None)
    else:
        W, U, Qg, Kd, Aqk, Ec, _ = prepared_tensors(prepared, "chunk_kda_state_grad", q, k, v, g, beta, scale,
                                                     C, cu_seqlens, general=g_min is None)
    dummy = torch.empty(1, H, K, V, device=dev, dtype=dtype)
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32)
    build_bwd_state_kernel(None, K, V, C, dt, walk="state_grad", block_v=_walk_block_v(dev, N, H, V))(
        W, U, Qg, Kd, Aqk, Ec, do.view(B * T, H, V), tables.seq_table, zeros, zeros, dummy, dummy, dh0)
    return dh0
