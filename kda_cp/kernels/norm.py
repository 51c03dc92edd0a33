"""The layer's output step and the gate's backward as TileLang kernels: one pass over memory each.

Gated RMSNorm, per row m of the [M, V] rows of (tokens x heads), forward and backward:

    r_m    = 1 / sqrt(mean_j x[m, j]^2 + eps),   xh = x r_m,   s = sigmoid(gate)
    y      = xh * w * s
    dgate  = dy * xh * w * s (1 - s)
    dx     = r_m (dxh - xh mean_j(dxh xh)),   dxh = dy * s * w
    dw[j]  = sum_m dy * s * xh                   (per-block partial sums, added by the caller)

The KDA gate's backward, for the [N, HV*K] rows of its pre-activation z (u = z + dt_bias, a_h =
exp(A_log[h]) of the column's head h):

    bounded (g = g_min sigmoid(a u)):   t = dg g_min s (1 - s), s = sigmoid(a u);  dz = t a,  dA_h += t a u
    softplus (g = -a softplus(u)):      dz = -dg a sigmoid(u);                      dA_h += dg g
    ddt_bias = sum over rows of dz

A block owns a tile of rows (and, for the gate, one head's K columns) in registers and walks a
strided share of the tiles, summing its weight / bias / A_log partials in fp32; the caller adds the
per-block partials, so the result is deterministic. Each reads its inputs once and writes its
outputs once. docs/design.md §9 has the math, docs/kernels.md the launches and their state.
"""

import functools

import torch
import tilelang.language as T

from ._common import compile_kernel, tl_dtype

__all__ = ["rms_norm_gated_fwd", "rms_norm_gated_bwd", "kda_gate_bwd", "norm_supported", "gate_supported",
           "build_rms_norm_gated_kernel", "build_gate_bwd_kernel"]

#: Rows of one register tile, and threads per block.
ROWS = 32
THREADS = 128
#: Blocks per SM of the walking backward kernels: one resident wave, by registers (ptxas for
#: sm_90a at V = K = 128: 150 registers a thread for the norm's backward, 118 for the gate's).
NORM_BWD_PER_SM = 3
GATE_BWD_PER_SM = 4


def _sigmoid(x):
    return T.float32(1) / (T.float32(1) + T.exp(-x))


def _norm_func(V, dtype, gdtype, wdtype, odtype, eps, backward):
    f32 = "float32"
    R = ROWS
    M = T.dynamic("M")
    S = T.dynamic("S")

    if not backward:
        @T.prim_func
        def kda_rms_norm_gated_fwd(
            X: T.Tensor([M, V], dtype),
            G: T.Tensor([M, V], gdtype),
            Wt: T.Tensor([V], wdtype),
            Y: T.Tensor([M, V], odtype),
        ):
            with T.Kernel(T.ceildiv(M, R), threads=THREADS) as bx:
                x = T.alloc_fragment([R, V], f32)
                sq = T.alloc_fragment([R, V], f32)
                rs = T.alloc_fragment([R], f32)
                m0 = bx * R
                for i, j in T.Parallel(R, V):
                    x[i, j] = T.if_then_else(m0 + i < M, T.cast(X[m0 + i, j], f32), T.float32(0))
                    sq[i, j] = x[i, j] * x[i, j]
                T.reduce_sum(sq, rs, dim=1)
                for i in T.Parallel(R):
                    rs[i] = T.rsqrt(rs[i] / T.float32(V) + T.float32(eps))
                for i, j in T.Parallel(R, V):
                    if m0 + i < M:
                        Y[m0 + i, j] = T.cast(x[i, j] * rs[i] * T.cast(Wt[j], f32)
                                              * _sigmoid(T.cast(G[m0 + i, j], f32)), odtype)

        return kda_rms_norm_gated_fwd

    @T.prim_func
    def kda_rms_norm_gated_bwd(
        X: T.Tensor([M, V], dtype),
        G: T.Tensor([M, V], gdtype),
        Wt: T.Tensor([V], wdtype),
        DY: T.Tensor([M, V], odtype),
        DX: T.Tensor([M, V], dtype),
        DG: T.Tensor([M, V], gdtype),
        DWp: T.Tensor([S, R, V], f32),
    ):
        with T.Kernel(S, threads=THREADS) as sp:
            x = T.alloc_fragment([R, V], f32)
            tmp = T.alloc_fragment([R, V], f32)
            dxh = T.alloc_fragment([R, V], f32)
            dwa = T.alloc_fragment([R, V], f32)
            rs = T.alloc_fragment([R], f32)
            c = T.alloc_fragment([R], f32)
            T.clear(dwa)
            ntile = T.ceildiv(M, R)
            for p in T.serial(T.ceildiv(ntile - sp, S)):  # tiles sp, sp + S, sp + 2S, ...
                m0 = (sp + p * S) * R
                for i, j in T.Parallel(R, V):
                    x[i, j] = T.if_then_else(m0 + i < M, T.cast(X[m0 + i, j], f32), T.float32(0))
                    tmp[i, j] = x[i, j] * x[i, j]
                T.reduce_sum(tmp, rs, dim=1)
                for i in T.Parallel(R):
                    rs[i] = T.rsqrt(rs[i] / T.float32(V) + T.float32(eps))
                for i, j in T.Parallel(R, V):
                    live = m0 + i < M
                    s = _sigmoid(T.if_then_else(live, T.cast(G[m0 + i, j], f32), T.float32(0)))
                    dy = T.if_then_else(live, T.cast(DY[m0 + i, j], f32), T.float32(0))
                    w = T.cast(Wt[j], f32)
                    xh = x[i, j] * rs[i]
                    dws = dy * s
                    dwa[i, j] = dwa[i, j] + dws * xh
                    dxh[i, j] = dws * w
                    tmp[i, j] = dws * w * xh
                    if live:
                        DG[m0 + i, j] = T.cast(dy * xh * w * s * (T.float32(1) - s), gdtype)
                T.reduce_sum(tmp, c, dim=1)
                for i, j in T.Parallel(R, V):
                    if m0 + i < M:
                        DX[m0 + i, j] = T.cast(rs[i] * (dxh[i, j] - x[i, j] * rs[i] * c[i] / T.float32(V)), dtype)
            for i, j in T.Parallel(R, V):
                DWp[sp, i, j] = dwa[i, j]

    return kda_rms_norm_gated_bwd


def _gate_func(HV, K, zdtype, g_min):
    """The gate's backward over [N, C] rows (C = HV * K, static: the row stride, so that loads
    vectorize); a block owns head h's K columns of a strided share of the row tiles. g_min None:
    the softplus form."""
    f32 = "float32"
    R = ROWS
    C = HV * K
    N = T.dynamic("N")
    S = T.dynamic("S")

    @T.prim_func
    def kda_gate_bwd(
        DGt: T.Tensor([N, C], f32),
        Z: T.Tensor([N, C], zdtype),
        A: T.Tensor([HV], f32),
        Bias: T.Tensor([C], f32),
        DZ: T.Tensor([N, C], zdtype),
        DBp: T.Tensor([S, R, C], f32),
        DAp: T.Tensor([S, R, C], f32),
    ):
        with T.Kernel(S, HV, threads=THREADS) as (sp, h):
            c0 = h * K
            dba = T.alloc_fragment([R, K], f32)
            daa = T.alloc_fragment([R, K], f32)
            T.clear(dba)
            T.clear(daa)
            a = T.exp(A[h])
            ntile = T.ceildiv(N, R)
            for p in T.serial(T.ceildiv(ntile - sp, S)):
                m0 = (sp + p * S) * R
                for i, j in T.Parallel(R, K):
                    live = m0 + i < N
                    dg = T.if_then_else(live, DGt[m0 + i, c0 + j], T.float32(0))
                    u = T.if_then_else(live, T.cast(Z[m0 + i, c0 + j], f32), T.float32(0)) + Bias[c0 + j]
                    if g_min is None:
                        d = -dg * a * _sigmoid(u)
                        # softplus(u) = max(u, 0) + log1p(e), e = exp(-|u|); log1p(e) as
                        # log(y) - ((y - 1) - e) / y with y = 1 + e (exact to fp32 rounding)
                        e = T.exp(-T.abs(u))
                        y1 = T.float32(1) + e
                        da = -dg * a * (T.max(u, T.float32(0)) + T.log(y1) - ((y1 - T.float32(1)) - e) / y1)
                    else:
                        s = _sigmoid(a * u)
                        t = dg * T.float32(g_min) * s * (T.float32(1) - s)
                        d = t * a
                        da = t * a * u
                    dba[i, j] = dba[i, j] + d
                    daa[i, j] = daa[i, j] + da
                    if live:
                        DZ[m0 + i, c0 + j] = T.cast(d, zdtype)
            for i, j in T.Parallel(R, K):
                DBp[sp, i, c0 + j] = dba[i, j]
                DAp[sp, i, c0 + j] = daa[i, j]

    return kda_gate_bwd


@functools.lru_cache(maxsize=None)
def build_rms_norm_gated_kernel(V, dtype, gdtype, wdtype, odtype, eps, *, backward):
    """Compile the gated RMSNorm's forward or backward for head dim V (rows M and blocks S dynamic).

    Forward: kernel(X[M, V], G[M, V], W[V], Y[M, V]). Backward: kernel(X, G, W, dY[M, V] (odtype),
    dX[M, V], dG[M, V], dWp[S, ROWS, V] f32: per-block partial weight gradients).
    """
    return compile_kernel(_norm_func(V, dtype, gdtype, wdtype, odtype, float(eps), backward),
                          name="rms_norm_gated_bwd" if backward else "rms_norm_gated_fwd")


@functools.lru_cache(maxsize=None)
def build_gate_bwd_kernel(HV, K, zdtype, g_min):
    """Compile the gate's backward for HV heads of K channels and the gate's form (g_min None:
    softplus); the rows N and blocks S dynamic.

    kernel(dg[N, C] f32, z[N, C], A_log[HV] f32, dt_bias[C] f32, dz[N, C] (z's dtype),
    dbp[S, ROWS, C] f32, dap[S, ROWS, C] f32), C = HV * K: per-block partial sums of dz (the bias
    gradient) and of the A_log gradient per column.
    """
    return compile_kernel(_gate_func(HV, K, zdtype, None if g_min is None else float(g_min)), name="gate_bwd")


_DTYPES = (torch.bfloat16, torch.float16)


def _hopper(x) -> bool:
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9


def norm_supported(x, weight, gate, out_dtype) -> tuple[bool, str]:
    """Whether the gated RMSNorm kernels cover the call: Hopper, x and gate bf16/fp16 with V in
    (64, 128) channels per head, a weight [V], weight and output bf16/fp16/fp32."""
    if not (_hopper(x) and gate.is_cuda and weight.is_cuda):
        return False, "not a Hopper (sm_90) CUDA tensor"
    if tuple(weight.shape) != (x.shape[-1],):
        return False, f"weight {tuple(weight.shape)}: the kernels take one weight per channel [V]"
    if x.dtype not in _DTYPES or gate.dtype not in _DTYPES or x.shape[-1] not in (64, 128):
        return False, f"x {x.dtype} with {x.shape[-1]} channels per head, gate {gate.dtype}: need bf16/fp16, V 64 or 128"
    if weight.dtype not in (*_DTYPES, torch.float32) or out_dtype not in (*_DTYPES, torch.float32):
        return False, f"weight {weight.dtype}, output {out_dtype}: need bf16, fp16 or fp32"
    if gate.numel() != x.numel():
        return False, "gate must hold one value per element of x"
    return True, ""


def gate_supported(z, A_log, dt_bias) -> tuple[bool, str]:
    """Whether the gate's backward kernel covers z [B, T, HV, K] (bf16/fp16, K 64 or 128) with
    A_log [HV] and dt_bias [HV * K] (or [HV, K], or None) on a Hopper GPU."""
    if not (_hopper(z) and A_log.is_cuda and (dt_bias is None or dt_bias.is_cuda)):
        return False, "not a Hopper (sm_90) CUDA tensor"
    if z.dtype not in _DTYPES or z.dim() != 4 or z.shape[-1] not in (64, 128):
        return False, f"z {z.dtype} {tuple(z.shape)}: need bf16/fp16 [B, T, HV, K], K 64 or 128"
    HV, K = z.shape[-2:]
    if A_log.numel() != HV or (dt_bias is not None and dt_bias.numel() != HV * K):
        return False, "A_log must hold HV values and dt_bias HV * K"
    return True, ""


def _ready(t, rows=None):
    """t contiguous (as [rows, -1] when rows is given) with a 16-byte aligned start, which the
    kernels' vector loads need (a split view of a wider projection may start anywhere)."""
    t = t.contiguous() if rows is None else t.reshape(rows, -1).contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _walkers(ntile, x, per_sm, per_tile_blocks=1):
    """Blocks that walk the tiles: per_sm per SM in all (one wave), at most one per tile."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return max(1, min(ntile, per_sm * sms // per_tile_blocks))


def rms_norm_gated_fwd(x, weight, gate, eps, out_dtype):
    """y [.., H * V] = RMSNorm(x) * weight * sigmoid(gate) on the kernel; x [.., H, V], gate with
    x's element count (module docstring)."""
    V = x.shape[-1]
    y = torch.empty(*x.shape[:-2], x.shape[-2] * V, dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return y
    kern = build_rms_norm_gated_kernel(V, tl_dtype(x.dtype), tl_dtype(gate.dtype), tl_dtype(weight.dtype),
                                       tl_dtype(out_dtype), float(eps), backward=False)
    M = x.numel() // V
    kern(_ready(x, M), _ready(gate, M), _ready(weight), y.view(M, V))
    return y


def rms_norm_gated_bwd(x, weight, gate, dy, eps):
    """(dx like x, dweight like weight, dgate like gate) of :func:`rms_norm_gated_fwd`."""
    V = x.shape[-1]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dg = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight), dg
    M = x.numel() // V
    S = _walkers(-(-M // ROWS), x, NORM_BWD_PER_SM)
    dwp = torch.empty(S, ROWS, V, dtype=torch.float32, device=x.device)
    kern = build_rms_norm_gated_kernel(V, tl_dtype(x.dtype), tl_dtype(gate.dtype), tl_dtype(weight.dtype),
                                       tl_dtype(dy.dtype), float(eps), backward=True)
    kern(_ready(x, M), _ready(gate, M), _ready(weight), _ready(dy, M), dx.view(M, V), dg.view(M, V), dwp)
    return dx, dwp.sum((0, 1)).to(weight.dtype), dg


def kda_gate_bwd(dg, z, A_log, dt_bias, g_min):
    """(dz like z, dA_log like A_log, ddt_bias like dt_bias or None) of the gate (module docstring)
    for dg [B, T, HV, K] (fp32) and the pre-activation z [B, T, HV, K]."""
    HV, K = z.shape[-2:]
    C = HV * K
    dz = torch.empty_like(z, memory_format=torch.contiguous_format)
    N = z.numel() // C
    if N == 0:
        dA = torch.zeros_like(A_log)
        return dz, dA, None if dt_bias is None else torch.zeros_like(dt_bias)
    bias = _ready((torch.zeros(C, device=z.device) if dt_bias is None else dt_bias.reshape(C)).float())
    S = _walkers(-(-N // ROWS), z, GATE_BWD_PER_SM, per_tile_blocks=HV)
    dbp = torch.empty(S, ROWS, C, dtype=torch.float32, device=z.device)
    dap = torch.empty_like(dbp)
    kern = build_gate_bwd_kernel(HV, K, tl_dtype(z.dtype), None if g_min is None else float(g_min))
    kern(_ready(dg.float(), N), _ready(z, N), _ready(A_log.float()), bias, dz.view(N, C), dbp, dap)
    dA = dap.sum((0, 1)).view(HV, K).sum(-1).to(A_log.dtype)
    ddt = None if dt_bias is None else dbp.sum((0, 1)).view(dt_bias.shape).to(dt_bias.dtype)
    return dz, dA, ddt
