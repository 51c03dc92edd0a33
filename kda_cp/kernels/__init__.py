"""TileLang forward kernels for KDA (Kimi Delta Attention) on Hopper.

Public API (wired into ``kda_cp.ops.chunk_kda`` by ops.py):

    chunk_kda_fwd(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
                  chunk_size=64, g_min=-5.0, gate=None) -> (o, final_state | None)
        (gate: a KernelGate, the gate and beta's sigmoid applied inside the kernel)
    chunk_kda_summary(k, v, g, beta, *, chunk_size=64, g_min=-5.0) -> (M, S_tilde)
    chunk_kda_fwd_prepare(q, k, v, g, beta, *, scale, cu_seqlens, ...) -> PreparedForward
    chunk_kda_summary_prepared(prepared, *, last_only=False) -> (M, S_tilde)
    keep_for_backward(prepared) -> (W, U, Aqk, eC);  restore_prepared(q, k, v, g, beta, kept, ...)
    is_supported(q, k, v, g, beta, cu_seqlens=None) -> (bool, reason)

Recurrence (docs/design.md §1), per batch element / sequence and head, log decay g in natural log:

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

Modules: launch.py (host side: checks, allocation, launches, the prepared forward), intra.py (gate
cumsum + decayed K K^T / Q K^T + UT transform, chunk-parallel), state.py (state pass fused with the
output; summary mode), backward.py with bwd_intra.py and bwd_state.py (the backward), _common.py
(chunk tables, launch shapes). Compiled kernels are cached per static configuration (K, V, chunk
size, dtype, scale, flags); T, the number of chunks, the number of sequences and H are runtime
values, so a new sequence length never recompiles.
"""

from .launch import (
    MAX_GRID_YZ,
    SUPPORTED_HEAD_DIMS,
    TMA_ALIGN,
    KernelGate,
    PreparedForward,
    chunk_kda_fwd,
    chunk_kda_fwd_prepare,
    chunk_kda_summary,
    chunk_kda_summary_prepared,
    is_supported,
    keep_for_backward,
    restore_prepared,
)

__all__ = ["chunk_kda_fwd", "KernelGate", "chunk_kda_fwd_prepare", "PreparedForward", "chunk_kda_summary",
           "chunk_kda_summary_prepared", "keep_for_backward", "restore_prepared", "is_supported", "SUPPORTED_HEAD_DIMS",
           "MAX_GRID_YZ", "TMA_ALIGN"]
