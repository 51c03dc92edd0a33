"""Host-side launch code of the forward kernels: input checks, the kernels' flat views, buffer
allocation and launches of the chunk-local, state and summary kernels, and the prepared forward
(the state-independent half that CP and the backward reuse). The kernels themselves are built in
intra.py and state.py; the package (kda_cp.kernels) re-exports the public names.
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._common import build_chunk_tables, host_offsets

__all__ = ["chunk_kda_fwd", "chunk_kda_fwd_prepare", "PreparedForward", "chunk_kda_summary",
           "chunk_kda_summary_prepared", "keep_for_backward", "restore_prepared", "is_supported", "SUPPORTED_HEAD_DIMS",
           "MAX_GRID_YZ", "TMA_ALIGN"]

SUPPORTED_HEAD_DIMS = (64, 128)
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


#: CUDA's limit on a grid's y and z extents: the state passes launch one block row per head (y) and
#: per sequence (z), so a call covers at most this many heads and sequences (batch rows or packed
#: sequences).
MAX_GRID_YZ = 65535

#: Byte alignment of q, k, v and g's data pointers: the forward's chunk-local kernel reads them by
#: TMA (and the backward's "ut" k and g), whose descriptors need a 16-byte aligned global address
#: (fresh tensors are; a view with an odd storage offset may not be). chunk_kda copies such inputs.
TMA_ALIGN = 16


def is_supported(q, k, v, g, beta, cu_seqlens=None, gated=False):
    """Whether the TileLang kernels cover these inputs (``gated``: g is the gate's pre-activation in
    q's dtype, :class:`KernelGate`).

    Returns:
        (True, "") or (False, reason). Covered: CUDA tensors on a Hopper GPU (sm_90), q/k/v in
        bf16 or fp16 with K == V in {64, 128} (K != V is not tested, so not claimed), g fp32, beta
        fp32 or q's dtype, B == 1 when cu_seqlens is given, at most MAX_GRID_YZ heads and
        sequences, q/k/v/g data pointers TMA_ALIGN-byte aligned, tilelang importable.
    """
    try:
        import tilelang  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return False, f"tilelang not importable: {e}"
    if not (q.is_cuda and k.is_cuda and v.is_cuda and g.is_cuda and beta.is_cuda):
        return False, "inputs are not all CUDA tensors"
    if not _hopper(q.device):
        return False, f"GPU capability {torch.cuda.get_device_capability(q.device)} is not Hopper (9.x)"
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False, f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}: need all bf16 or all fp16"
    if gated and q.dtype != torch.bfloat16:
        return False, f"the gate inside the kernel needs bf16 inputs, got {q.dtype}"
    if g.dtype != (q.dtype if gated else torch.float32):
        return False, f"g dtype {g.dtype}: need {q.dtype if gated else torch.float32}"
    if beta.dtype not in (torch.float32, q.dtype):
        return False, f"beta dtype {beta.dtype}: need float32 or {q.dtype}"
    if (q.dim() != 4 or v.dim() != 4 or q.shape[-1] not in SUPPORTED_HEAD_DIMS
            or v.shape[-1] != q.shape[-1]):
        return False, (f"head dims q {tuple(q.shape)}, v {tuple(v.shape)}: need K == V in "
                       f"{SUPPORTED_HEAD_DIMS}")
    if cu_seqlens is not None and q.shape[0] != 1:
        return False, f"cu_seqlens needs B == 1, got q {tuple(q.shape)}"
    if any(t.data_ptr() % TMA_ALIGN for t in (q, k, v, g)):
        return False, f"q/k/v/g data pointers not all {TMA_ALIGN}-byte aligned (read by TMA)"
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if n > MAX_GRID_YZ or q.shape[2] > MAX_GRID_YZ:
        return False, f"{n} sequences and {q.shape[2]} heads: the state passes take at most {MAX_GRID_YZ} of each"
    return True, ""


class KernelGate(NamedTuple):
    """The gate applied inside the chunk-local kernel (flash-linear-attention's use_gate_in_kernel):
    g is then the gate's pre-activation z in q's dtype and the kernel uses
    g = g_min * sigmoid(exp(A_log) * (z + dt_bias)); with ``beta_scale`` set, beta is a
    pre-activation and the kernel uses beta_scale * sigmoid(beta). The fp32 g is never written."""

    A_log: torch.Tensor
    """[H] fp32, contiguous."""
    dt_bias: torch.Tensor
    """[H, K] fp32, contiguous (zeros for no bias)."""
    beta_scale: float | None = None
    """None (beta as given), 1.0, or 2.0 (negative eigenvalues)."""


def check_tensor(name, t, shape, dtypes, aligned=False):
    """ValueError unless tensor ``t`` has this shape, one of ``dtypes``, is contiguous and (``aligned``) TMA-aligned."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {dtypes}")
    if not t.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(t.shape)}, stride {t.stride()}) must be contiguous")
    if aligned and t.data_ptr() % TMA_ALIGN:
        raise ValueError(f"{name} starts at a data pointer that is not {TMA_ALIGN}-byte aligned (storage offset "
                         f"{t.storage_offset()}): the chunk kernels read it by TMA; pass a fresh "
                         f"tensor (e.g. {name}.clone())")


def validate_inputs(q, k, v, g, beta, cu_seqlens, chunk_size, g_min, aligned=True, gate=None):
    """Check the kernels' inputs and options (ValueError naming the shapes); returns (B, T, H, K, V).
    With a :class:`KernelGate`, g is the gate's pre-activation in q's dtype."""
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q and v must be 4-D, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    check_tensor("q", q, (B, T, H, K), _SUPPORTED_DTYPES, aligned)
    check_tensor("k", k, (B, T, H, K), (q.dtype,), aligned)
    check_tensor("v", v, (B, T, H, V), (q.dtype,), aligned)
    check_tensor("g", g, (B, T, H, K), (torch.float32,) if gate is None else (q.dtype,), aligned)
    if gate is not None:
        check_tensor("A_log", gate.A_log, (H,), (torch.float32,))
        check_tensor("dt_bias", gate.dt_bias, (H, K), (torch.float32,))
        if gate.beta_scale not in (None, 1.0, 2.0):
            raise ValueError(f"beta_scale must be None, 1 or 2, got {gate.beta_scale}")
    check_tensor("beta", beta, (B, T, H), (torch.float32, q.dtype))
    if K not in SUPPORTED_HEAD_DIMS or V != K:
        raise ValueError(f"head dims K={K}, V={V}: need K == V in {SUPPORTED_HEAD_DIMS} "
                         f"(q {tuple(q.shape)}, v {tuple(v.shape)})")
    if chunk_size != 64:
        raise ValueError(f"chunk_size must be 64, got {chunk_size}")
    if g_min is None:
        if gate is not None:
            raise ValueError("the gate inside the kernel is the bounded one: pass its g_min in [-5, 0)")
    elif not (-5.0 <= g_min < 0.0):
        raise ValueError(f"g_min must lie in [-5, 0) or be None (any g <= 0), got {g_min}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1, got q {tuple(q.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if N > MAX_GRID_YZ or H > MAX_GRID_YZ:
        raise ValueError(f"{N} sequences and H={H} heads: the TileLang kernels take at most {MAX_GRID_YZ} of each "
                         f"(CUDA's grid limit); split the batch or the packed sequences into several calls")
    return B, T, H, K, V


def kernel_inputs(q, k, v, g, beta):
    """The flat [B * T, H, *] views the kernels take, beta in fp32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    b32 = beta if beta.dtype == torch.float32 else beta.float()  # [B, T, H]: small copy
    return (q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, H, V), g.view(B * T, H, K),
            b32.view(B * T, H))


def tl_name(dtype):
    """TileLang's name of a torch dtype."""
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]


def chunk_kda_fwd(q, k, v, g, beta, *, scale: float, initial_state=None, output_final_state=False,
                  cu_seqlens=None, chunk_size: int = 64, g_min: float | None = -5.0, prepared=None, gate=None):
    """KDA forward with the TileLang chunk kernels.

    Math: S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
    o_t = scale * S_t^T q_t, S_{-1} = initial_state (zero if None); chunked form of docs/design.md §2.

    Args:
        q, k: [B, T, H, K] bf16 or fp16, contiguous. v: [B, T, H, V], same dtype.
        g: [B, T, H, K] fp32, per-step log decay (natural log, not cumsummed), g in [g_min, 0].
        beta: [B, T, H], fp32 or q's dtype (converted to fp32, a [B, T, H] copy).
        scale: output scale (typically K ** -0.5); part of the compiled kernel's cache key.
        initial_state: [N, H, K, V] fp32 or None; N = B, or the number of sequences with cu_seqlens.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: [N + 1] int32/int64 on q's device (FlashAttention convention) with B == 1;
            each packed sequence starts from its own initial_state row. Read on the host (a
            sync), except for kda_cp's own copy (``_common.device_offsets``, what chunk_kda passes).
        chunk_size: 64 (the only tuned value). g_min: the declared gate bound in [-5, 0); the
            kernels rely on g >= -5 (16-token sub-chunks), they do not check it. None: the
            general-gate kernels, any g <= 0 (each step floored at GENERAL_FLOOR, the own
            sub-chunk blocks of the decayed products summed pairwise; slower).
        prepared: :func:`chunk_kda_fwd_prepare`'s result for these inputs (then only the state pass
            runs), or None.
        gate: a :class:`KernelGate`: g (and beta, with its beta_scale) are pre-activations that
            the chunk-local kernel turns into the gate as it loads them.
    Returns:
        o [B, T, H, V] in q's dtype, and final_state [N, H, K, V] fp32 or None.
    Raises:
        ValueError on a shape, dtype, contiguity or option mismatch (message shows the shapes), q,
        k, v or g not TMA_ALIGN-byte aligned, more than MAX_GRID_YZ sequences or heads, or a
        ``prepared`` made for other shapes, scale, chunk size or cu_seqlens.
    Numerics: cumsum, exponentials, triangular solve and state in fp32; GEMM operands bf16 (or
        fp16 for fp16 inputs) with fp32 accumulation. Measured relative RMS error vs an fp64
        recurrence on the same rounded inputs (H200): 3.6e-3 to 4.7e-3 for bf16, ~2e-3 for fp16
        (docs/kernels.md, "Accuracy").
    """
    B, T, H, K, V = validate_inputs(q, k, v, g, beta, cu_seqlens, chunk_size, g_min, gate=gate)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (N, H, K, V), (torch.float32,))
    from ._common import state_launch
    from .state import build_state_output_kernel
    dev = q.device
    if T == 0 or N == 0:
        o = torch.empty_like(v)
        ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
        if ht is not None:
            ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return o, ht
    if prepared is None:  # the chunk-local kernel first: the GPU starts while the host goes on
        W, U, Qg, Kd, Aqk, Ec, tables = _launch_intra(q, k, v, g, beta, scale, cu_seqlens, chunk_size, g_min, gate)
    else:
        W, U, Qg, Kd, Aqk, Ec, tables = prepared_tensors(prepared, "chunk_kda_fwd", q, k, v, g, beta, scale,
                                                          chunk_size, cu_seqlens, general=g_min is None)
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    block_v, threads = state_launch(torch.cuda.get_device_properties(dev).multi_processor_count, N, H, V)
    state = build_state_output_kernel(None, K, V, chunk_size, tl_name(q.dtype), with_h0=initial_state is not None,
                                      store_ht=output_final_state, block_v=block_v, threads=threads)
    h0 = initial_state if initial_state is not None else torch.empty(N, H, K, V, device=dev, dtype=torch.float32)  # unread
    ht_arg = ht if ht is not None else torch.empty(N, H, K, V, device=dev, dtype=torch.float32)  # unwritten
    state(W, U, Qg, Kd, Aqk, Ec, tables.seq_table, h0, o.view(B * T, H, V), ht_arg)
    return o, ht


def _prepared_key(q, k, v, g, beta, scale, chunk_size, cu_seqlens, general=False):
    """What a PreparedForward was computed from: the very tensors (storage and version), their
    shapes and dtype, the scale, chunk size, packed-sequence offsets and gate kernels (general)."""
    tensors = tuple((x.data_ptr(), x._version) for x in (q, k, v, g, beta))
    cu = None if cu_seqlens is None else host_offsets(cu_seqlens)
    return (tensors, tuple(q.shape), tuple(v.shape), q.dtype, str(q.device), float(scale), chunk_size, cu,
            bool(general))


def prepared_tensors(prepared, who, q, k, v, g, beta, scale, chunk_size, cu_seqlens, consume=False, general=False):
    """The tensors of ``prepared`` after checking it was made for exactly these inputs (and the
    same gate kernels: ``general`` for g_min=None)."""
    key = _prepared_key(q, k, v, g, beta, scale, chunk_size, cu_seqlens, general)
    if prepared.tensors is None:
        raise ValueError(f"{who}: `prepared` was already consumed by chunk_kda_bwd")
    if prepared.key != key:
        raise ValueError(f"{who}: `prepared` was made for other inputs (tensors, shapes, dtype, scale, "
                         f"chunk size, cu_seqlens or g_min): {prepared.key} vs {key}")
    W, U, Qg, Kd, Aqk, Ec, tables = prepared.tensors
    if Qg is None:  # kept by the forward for the backward (keep_for_backward): remake Qg, Kd
        from .intra import build_decay_kernel
        B, T, H, K = q.shape
        Qg, Kd = torch.empty_like(W), torch.empty_like(W)
        build_decay_kernel(None, K, chunk_size, tl_name(q.dtype), scale=float(scale), general=general)(
            q.view(B * T, H, K), k.view(B * T, H, K), g.view(B * T, H, K), tables.chunk_table, Qg, Kd)
        prepared.tensors = (W, U, Qg, Kd, Aqk, Ec, tables)
    tensors = prepared.tensors
    if consume:
        prepared.tensors = None
    return tensors


@dataclass
class PreparedForward:
    """The state-independent half of the forward (chunk_kda_fwd_prepare): per chunk and head, W, U,
    Qg, Kd, Aqk in the input dtype and eC in fp32, plus the chunk tables. ``key`` ties it to the
    inputs it was made for. The forward, the CP summary (chunk_kda_summary_prepared), the state
    gradient and the backward all start from these tensors; chunk_kda_bwd consumes them (sets
    ``tensors`` to None) so that it can free each one as soon as its stages are done with it."""

    tensors: tuple
    key: tuple


def keep_for_backward(prepared: PreparedForward) -> tuple:
    """What the forward keeps for the backward out of ``prepared``: (W, U, Aqk, eC).

    The backward's walks also need Qg and Kd, which the backward remakes from q, k, g with a cheap
    kernel (gate cumsum and elementwise work, no GEMM); W, U (the triangular solve) and Aqk (the
    decayed products) are the expensive part. Per token and head this holds K + V + C values in the
    input dtype plus K / C in fp32: 648 MiB at T = 32768, H = 32, K = V = 128 in bf16 (with the
    output o, 904 MiB; flash-linear-attention's chunk_kda holds 1024 MiB there, both measured by
    scripts/bench_backward.py). Raises ValueError if ``prepared`` was already consumed."""
    if prepared.tensors is None:
        raise ValueError("keep_for_backward: `prepared` was already consumed by chunk_kda_bwd")
    W, U, _, _, Aqk, Ec, _ = prepared.tensors
    return W, U, Aqk, Ec


def restore_prepared(q, k, v, g, beta, kept, *, scale: float, cu_seqlens=None, chunk_size: int = 64,
                     g_min: float | None = -5.0) -> PreparedForward:
    """A :class:`PreparedForward` for the backward from :func:`keep_for_backward`'s tensors and the
    forward's inputs as autograd hands them back (they may be other tensors than the forward's,
    e.g. after activation checkpointing or offloading; the key is taken from these). Qg and Kd are
    remade by the first consumer (chunk_kda_state_grad or chunk_kda_bwd)."""
    B, T = q.shape[:2]
    W, U, Aqk, Ec = kept
    tables = build_chunk_tables(B, T, cu_seqlens, chunk_size, q.device)
    if W.shape[0] != tables.num_chunks:
        raise ValueError(f"restore_prepared: kept tensors for {W.shape[0]} chunks, the inputs have "
                         f"{tables.num_chunks}")
    return PreparedForward((W, U, None, None, Aqk, Ec, tables),
                           _prepared_key(q, k, v, g, beta, scale, chunk_size, cu_seqlens, g_min is None))


def chunk_kda_fwd_prepare(q, k, v, g, beta, *, scale: float, cu_seqlens=None, chunk_size: int = 64,
                          g_min: float | None = -5.0, gate=None) -> PreparedForward:
    """The chunk-local kernel alone (gate cumsum, decayed products, UT transform: docs/design.md §2):
    everything of the forward that does not depend on the incoming state. Context parallelism runs
    it once per shard and derives the shard's (M, S~) from it (:func:`chunk_kda_summary_prepared`);
    then ``chunk_kda_fwd(..., prepared=...)`` runs only the state pass. Arguments and errors as in :func:`chunk_kda_fwd`; T >= 1 and N >= 1.
    """
    validate_inputs(q, k, v, g, beta, cu_seqlens, chunk_size, g_min, gate=gate)
    return PreparedForward(_launch_intra(q, k, v, g, beta, scale, cu_seqlens, chunk_size, g_min, gate),
                           _prepared_key(q, k, v, g, beta, scale, chunk_size, cu_seqlens, g_min is None))


def _launch_intra(q, k, v, g, beta, scale, cu_seqlens, chunk_size, g_min=-5.0, gate=None):
    """Allocate the chunk-local tensors and launch the chunk-local kernel on validated inputs:
    (W, U, Qg, Kd, Aqk, eC, tables)."""
    from .intra import build_intra_kernel
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    C = chunk_size
    tables = build_chunk_tables(B, T, cu_seqlens, C, dev)
    NC = tables.num_chunks
    qf, kf, vf, gf, bf = kernel_inputs(q, k, v, g, beta)
    W = torch.empty(NC, H, C, K, device=dev, dtype=q.dtype)
    U = torch.empty(NC, H, C, V, device=dev, dtype=q.dtype)
    Qg = torch.empty(NC, H, C, K, device=dev, dtype=q.dtype)
    Kd = torch.empty(NC, H, C, K, device=dev, dtype=q.dtype)
    Aqk = torch.empty(NC, H, C, C, device=dev, dtype=q.dtype)
    Ec = torch.empty(NC, H, K, device=dev, dtype=torch.float32)
    if gate is None:
        build_intra_kernel(None, K, V, C, tl_name(q.dtype), scale=float(scale), general=g_min is None)(
            qf, kf, vf, gf, bf, tables.chunk_table, W, U, Qg, Kd, Aqk, Ec)
    else:
        build_intra_kernel(None, K, V, C, tl_name(q.dtype), scale=float(scale), gate_min=float(g_min),
                           beta_scale=gate.beta_scale)(
            qf, kf, vf, gf, bf, gate.A_log, gate.dt_bias, tables.chunk_table, W, U, Qg, Kd, Aqk, Ec)
    return W, U, Qg, Kd, Aqk, Ec, tables


def summary_pieces(dev, rows, H, K, V, num_chunks):
    """Into how many pieces to cut each sequence for the summary: the state kernel runs one block
    per (piece, head, 64 of the V + K columns), one at a time on an SM. When the blocks leave at
    least half the SMs idle, cutting each sequence into p pieces (at least 16 chunks each on
    average) puts p times as many to work, up to one per SM. H200, 132 SMs, bf16
    inputs (the register-operand kernel, one block per SM; `scripts/tune_summary.py`,
    docs/results/h200_tune_summary.json): T=131072, H=16 (64 blocks) 2.73 / 1.76 / 1.79 ms whole /
    in 2 / in 4 pieces; T=32768, H=32 (128 blocks) 0.70 / 0.91 / 1.05 ms, so no cut there (TF32
    operands, one block per SM: 10.1 ms whole, 5.6 ms in 2 pieces at T=131072)."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    blocks = max(1, rows * H * ((V + K) // 64))
    if 2 * blocks > sms:
        return 1
    return max(1, min(sms // blocks, num_chunks // (16 * max(rows, 1))))


def _piece_table(seq, pieces):
    """[N, 4] sequence table -> [N * pieces, 4]: each sequence's chunks cut into `pieces` runs
    (first chunk, number of chunks), in order; built on the device (no host sync)."""
    c0, nc = seq[:, :1].long(), seq[:, 1:2].long()
    b = c0 + nc * torch.arange(pieces + 1, device=seq.device) // pieces  # [N, pieces + 1]
    out = torch.zeros(seq.shape[0], pieces, 4, dtype=torch.int32, device=seq.device)
    out[..., 0] = b[:, :-1]
    out[..., 1] = b[:, 1:] - b[:, :-1]
    return out.view(-1, 4)


def summary_run(W, U, Kd, Ec, seq, num_chunks, pieces=None, operands="bf16x2"):
    """Run the summary state kernel over the sequences of `seq` ([N, 4] int32 on the device):
    (M [N, H, K, K], S~ [N, H, K, V]) fp32. W is [NC, H, C, K] (fp32: Kd is Kd^T [NC, H, K, C]).
    With pieces > 1 each sequence is cut at chunk boundaries into that many parts, summarised in
    parallel and composed in order (scan.compose, IEEE fp32): the same maps up to fp32 rounding.
    With one piece, M and S~ are views of the kernel's output [N, H, K, V + K] (S~ then M), which
    CP's all-gather sends as it is (parallel.cp._packed_row)."""
    from .. import scan
    from .state import build_summary_kernel

    _, H, C, K = W.shape
    V = U.shape[-1]
    rows = seq.shape[0]
    p = summary_pieces(W.device, rows, H, K, V, num_chunks) if pieces is None else pieces
    SM = torch.empty(rows * p, H, K, V + K, device=W.device, dtype=torch.float32)
    build_summary_kernel(None, K, V, C, dtype=tl_name(W.dtype), operands=operands)(
        W, U, Kd, Ec, seq if p == 1 else _piece_table(seq, p), SM)
    SM = SM.view(rows, p, H, K, V + K)
    acc = scan.AffineMap(SM[:, 0, ..., V:], SM[:, 0, ..., :V])
    for i in range(1, p):
        acc = scan.compose(scan.AffineMap(SM[:, i, ..., V:], SM[:, i, ..., :V]), acc)
    return acc.M, acc.S


def chunk_kda_summary_prepared(prepared: PreparedForward, *, last_only: bool = False):
    """The affine maps (M, S~) of the sequences of a prepared forward, from its chunk-local tensors.

    Context parallelism needs both the shard's forward and its summary; this derives the summary
    from what :func:`chunk_kda_fwd_prepare` already computed (W, U, Kd in the input dtype, eC in
    fp32), so the chunk-local kernel runs once per shard instead of twice (docs/design.md §4.1).

    Math: as :func:`chunk_kda_summary`, per sequence n of the prepared inputs (row b of a dense
    batch, or packed sequence n): S_out = M S_in + S~ with M = prod_c (Diag(eC_c) - Kd_c^T W_c) over
    the sequence's chunks, S~ its end state from zero.

    Args:
        prepared: a :class:`PreparedForward` (any head dim / dtype it supports).
        last_only: summarise only the last sequence (for a CP shard: the segment that continues on
            the next rank).
    Returns:
        (M [N, H, K, K] fp32, S_tilde [N, H, K, V] fp32); N = 1 with ``last_only``. An empty
        sequence gets (I, 0). Strided views of one buffer where the kernel ran as one piece.
    With ``last_only`` the launch is sized for that one sequence (cut into more pieces), so its map
    may differ from the full call's last row by fp32 rounding.
    Numerics: W and Kd are exact as operands and the state and V' are split into two pieces (bf16
        input: two bf16 pieces, bf16 MMAs; fp16: two TF32 pieces), so every product (and so the
        chain of M) is carried at fp32-level accuracy: within ~1e-5 relative of the same chain in
        fp64 on the same tensors (tests/kernels/test_kernels_gpu.py). The factors
        Diag(eC) - Kd^T W themselves are the forward's: W and Kd rounded to the input dtype, as the
        single-device forward applies them. So M is as accurate as the forward's own state (relative
        RMS vs fp64 ~1e-3 to 3e-3 for bf16, growing slowly with the number of chunks), not as
        :func:`chunk_kda_summary` (~2e-5), which recomputes W and Kd in fp32.
    """
    if prepared.tensors is None:
        raise ValueError("chunk_kda_summary_prepared: `prepared` was already consumed by chunk_kda_bwd")
    W, U, _, Kd, _, Ec, tables = prepared.tensors
    if Kd is None:
        raise ValueError("chunk_kda_summary_prepared: `prepared` holds only what the backward keeps "
                         "(restore_prepared); pass chunk_kda_fwd_prepare's result")
    seq = tables.seq_table[-1:] if last_only else tables.seq_table
    return summary_run(W, U, Kd, Ec, seq, tables.num_chunks)


def chunk_kda_summary(k, v, g, beta, *, chunk_size: int = 64, g_min: float | None = -5.0):
    """The segment's affine map (docs/design.md §3) in one fp32-accurate state pass.

    Math: for each batch element b and head h, with M_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)):
        M       = M_{T-1} ... M_0                               (K x K, S_out = M S_in + S_tilde)
        S_tilde = the state after token T-1 starting from S = 0  (K x V)
    computed from the augmented state [0 | I] with pseudo-values [U | 0] (ends as [S_tilde | M]).

    Args:
        k: [B, T, H, K] bf16/fp16; v: [B, T, H, V] same dtype; g: [B, T, H, K] fp32 log decay per
            step in [g_min, 0]; beta: [B, T, H] fp32 or k's dtype. All contiguous. No q: the
            summary does not depend on it. No cu_seqlens: each batch row is one segment.
        chunk_size: 64. g_min: declared gate bound in [-5, 0), or None for any g <= 0 (the
            general-gate chunk-local kernel, as :func:`chunk_kda_fwd`).
    Returns:
        (M [B, H, K, K] fp32, S_tilde [B, H, K, V] fp32), strided views of one buffer where the
        kernel ran as one piece.
    Raises:
        ValueError on a shape, dtype, contiguity or option mismatch, or more than MAX_GRID_YZ
        batch rows or heads.
    Numerics: cumsum, exponentials and the triangular solve in fp32 on CUDA cores; every GEMM is a
        3xTF32 split (never plain TF32 or bf16), so M keeps fp32 accuracy (measured relative RMS vs
        fp64 over 1000 tokens: M 1.8e-5, S_tilde 1.4e-6).
    """
    B, T, H, K, V = validate_inputs(k, k, v, g, beta, None, chunk_size, g_min, aligned=False)  # no TMA reads
    from .intra import build_intra_summary_kernel
    dev = k.device
    C = chunk_size
    if T == 0:
        eye = torch.eye(K, device=dev, dtype=torch.float32).expand(B, H, K, K).contiguous()
        return eye, torch.zeros(B, H, K, V, device=dev, dtype=torch.float32)
    tables = build_chunk_tables(B, T, None, C, dev)
    NC = tables.num_chunks
    dt = tl_name(k.dtype)
    _, kf, vf, gf, bf = kernel_inputs(k, k, v, g, beta)
    W = torch.empty(NC, H, C, K, device=dev, dtype=torch.float32)
    U = torch.empty(NC, H, C, V, device=dev, dtype=torch.float32)
    KdT = torch.empty(NC, H, K, C, device=dev, dtype=torch.float32)
    Ec = torch.empty(NC, H, K, device=dev, dtype=torch.float32)
    build_intra_summary_kernel(None, K, V, C, dt, general=g_min is None)(kf, vf, gf, bf, tables.chunk_table, W, U,
                                                                         KdT, Ec)
    return summary_run(W, U, KdT, Ec, tables.seq_table, NC)
