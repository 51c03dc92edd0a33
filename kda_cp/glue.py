"""The elementwise work around the KDA op (the layer's "glue"), written once and fused on CUDA.

Four functions, each plain torch:

    conv_silu_norm   y = SiLU(ShortConv(x)) over stacked q|k|v channels, then L2Norm of q and k
    l2_norm          x / max(||x||_2, eps) over the last dim
    kda_gate         g = g_min * sigmoid(exp(A_log_h) * (z + dt_bias))          (g_min set)
                     g = -exp(A_log_h) * softplus(z + dt_bias)                   (g_min None)
    rms_norm_gated   y = x / sqrt(mean(x^2) + eps) * weight * sigmoid(gate)      per head

On CUDA tensors each runs as one ``torch.compile`` (Inductor) graph, and on Hopper the TileLang
kernels of :mod:`kda_cp.kernels` take over where they cover the call (measured faster than the
compiled forms: docs/kernels.md): conv_silu_norm forward and backward (kernels.conv),
rms_norm_gated forward and backward, and kda_gate's backward (kernels.norm: one pass each, dz,
dA_log and ddt_bias together). kda_gate and rms_norm_gated have hand-written backwards (the
kernels' math, in torch where no kernel covers the call). KDA_CP_GLUE_KERNELS=0 selects the
compiled glue everywhere, =bwd the kernels for the backward only. On CPU the functions run
eagerly: the same code is the oracle the fused forms are tested against. Every function computes
in fp32 (fp64 for fp64 inputs) and casts once on output.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
import torch.nn.functional as F

from kda_cp.ops import first_order_only

__all__ = ["conv_silu_norm", "l2_norm", "kda_gate", "rms_norm_gated", "linear_split", "lags_in_sequence",
           "use_compiled"]


def _cdt(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


def _shift_in(x, halo, lag):
    """Row t of the result is the input at t - lag: x's earlier rows, then ``halo``'s last rows."""
    if lag == 0:
        return x
    T, W1 = x.shape[1], halo.shape[1]
    if T < lag:  # a shard shorter than the lag: all rows come from the halo
        return torch.cat([halo, x], dim=1)[:, W1 - lag : W1 - lag + T]
    # two padded reads (masked loads once fused; no concatenated copy is written)
    return F.pad(x[:, : T - lag], (0, 0, lag, 0)) + F.pad(halo[:, W1 - lag :], (0, 0, 0, T - lag))


def _shift_out(a, lag):
    """Row t of the result is a's row t + lag (zeros past the end)."""
    if lag == 0:
        return a
    T = a.shape[1]
    return F.pad(a[:, lag:], (0, 0, 0, min(lag, T)))[:, :T]


def _conv(x, w, halo, lags):
    """Pre-activation of the causal depthwise conv, fp32: sum over lags of w[:, W-1-lag] x[t - lag]."""
    W = w.shape[1]
    y = x.to(w.dtype) * w[:, W - 1]
    for lag in range(1, W):
        tap = _shift_in(x, halo, lag).to(w.dtype) * w[:, W - 1 - lag]
        if lags is not None:  # packed sequences: no tap reaches before the token's sequence start
            tap = torch.where((lags >= lag)[None, :, None], tap, 0.0)
        y = y + tap
    return y


def _heads(y, splits, head_dim):
    B, T, _ = y.shape
    q, k, v = y.split(splits, dim=-1)
    H = splits[0] // head_dim
    return q.reshape(B, T, H, head_dim), k.reshape(B, T, H, head_dim), v.reshape(B, T, H, splits[2] // H)


def _csn_fwd(x, weight, halo, lags, splits, head_dim, eps):
    y = F.silu(_conv(x, weight.to(_cdt(x.dtype)), halo, lags))
    q, k, v = _heads(y, splits, head_dim)
    return _l2_norm(q, eps).to(x.dtype), _l2_norm(k, eps).to(x.dtype), v.to(x.dtype).contiguous()


def _l2_norm_bwd(y, dn, eps):
    """Gradient of n = y / max(||y||, eps) for the output gradient dn."""
    r = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    n = y / r.clamp_min(eps)
    proj = torch.where(r > eps, (n * dn).sum(-1, keepdim=True), 0.0)
    return (dn - n * proj) / r.clamp_min(eps)


def _csn_bwd(x, weight, halo, lags, dq, dk, dv, splits, head_dim, eps):
    cdt = _cdt(x.dtype)
    w = weight.to(cdt)
    W = w.shape[1]
    B, T, C = x.shape
    if T == 0:  # an empty shard: nothing reaches x, the weight or the halo
        return torch.zeros_like(x), torch.zeros_like(weight), torch.zeros_like(halo)
    pre = _conv(x, w, halo, lags)  # recomputed: only x, the weight and the halo are kept
    s = torch.sigmoid(pre)
    yq, yk, _ = _heads(pre * s, splits, head_dim)
    dyq = _l2_norm_bwd(yq, dq.to(cdt), eps).reshape(B, T, splits[0])
    dyk = _l2_norm_bwd(yk, dk.to(cdt), eps).reshape(B, T, splits[1])
    dpre = torch.cat([dyq, dyk, dv.to(cdt).reshape(B, T, splits[2])], dim=-1) * (s * (1 + pre * (1 - s)))
    dx = dpre * w[:, W - 1]
    dw = [(dpre * x.to(cdt)).sum((0, 1))]
    dhalo = torch.zeros(B, W - 1, C, dtype=cdt, device=x.device)
    rows = torch.arange(W - 1, device=x.device)
    for lag in range(1, W):
        d = dpre if lags is None else torch.where((lags >= lag)[None, :, None], dpre, 0.0)
        dx = dx + _shift_out(d, lag) * w[:, W - 1 - lag]
        dw.append((d * _shift_in(x, halo, lag).to(cdt)).sum((0, 1)))
        # halo row i is the input at t - lag for t = i - (W-1) + lag, when that row exists
        t = rows - (W - 1) + lag
        ok = (t >= 0) & (t < T)
        dhalo = dhalo + torch.where(ok[None, :, None], d[:, t.clamp(0, T - 1)], 0.0) * w[:, W - 1 - lag]
    dw = torch.stack(dw[::-1], dim=1)  # dw[0] belongs to tap W-1
    return dx.to(x.dtype), dw.to(weight.dtype), dhalo.to(halo.dtype)


def _kernels_on(direction) -> bool:
    """Whether KDA_CP_GLUE_KERNELS lets the glue's ``direction`` ("fwd" / "bwd") run on the
    TileLang kernels ("all", the default: both directions; "bwd": the backward; "0": none)."""
    mode = os.environ.get("KDA_CP_GLUE_KERNELS", "all")
    if mode not in ("0", "bwd", "all"):
        raise ValueError(f"KDA_CP_GLUE_KERNELS must be 0, bwd or all, got {mode!r}")
    return mode == "all" or (mode == "bwd" and direction == "bwd")


@functools.lru_cache(maxsize=None)
def _kernel_module(name: str):
    """kda_cp.kernels.<name> (conv, norm), or None where it does not import (no tilelang, or no
    CUDA libraries): the compiled torch forms serve then."""
    import importlib

    try:
        return importlib.import_module(f"kda_cp.kernels.{name}")
    except Exception as exc:  # noqa: BLE001 - any import failure means: no kernels here
        import logging

        logging.getLogger(__name__).info("kda_cp.kernels.%s unavailable (%s): the glue runs through torch", name, exc)
        return None


def _norm_kernels(direction, x):
    """kda_cp.kernels.norm when the glue's ``direction`` may run on it for the CUDA tensor x."""
    return _kernel_module("norm") if x.is_cuda and _kernels_on(direction) else None


def _use_kernel(x, weight, splits, head_dim, direction) -> bool:
    """Whether conv_silu_norm's ``direction`` runs on the TileLang kernels (kda_cp.kernels.conv)
    rather than torch.compile: where KDA_CP_GLUE_KERNELS selects them and they cover the call."""
    if not _kernels_on(direction) or not x.is_cuda:
        return False
    conv = _kernel_module("conv")
    return conv is not None and conv.conv_supported(x, weight, splits, head_dim)[0]


class _ConvSiluNorm(torch.autograd.Function):
    """One kernel forward and one backward (TileLang on Hopper, else two torch.compile passes
    each); the backward recomputes the conv from x, the weight and the halo."""

    @staticmethod
    def forward(ctx, x, weight, halo, lags, splits, head_dim, eps, compiled):
        kernel = compiled and _use_kernel(x, weight, splits, head_dim, "bwd")
        ctx.save_for_backward(x, weight, halo, lags)
        ctx.args = (splits, head_dim, eps, compiled, kernel)
        if compiled and _use_kernel(x, weight, splits, head_dim, "fwd"):
            from kda_cp.kernels.conv import conv_silu_norm_fwd
            return conv_silu_norm_fwd(x, weight, halo, lags, head_dim, eps, splits=splits)
        return _run(_csn_fwd, compiled, x, weight, halo, lags, splits, head_dim, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk, dv):
        x, weight, halo, lags = ctx.saved_tensors
        splits, head_dim, eps, compiled, kernel = ctx.args
        if kernel:
            from kda_cp.kernels.conv import conv_silu_norm_bwd as bwd
            dx, dw, dhalo = bwd(x, weight, halo, lags, dq, dk, dv, head_dim, eps, splits=splits)
        else:
            # unused outputs arrive as zeros
            dx, dw, dhalo = _run(_csn_bwd, compiled, x, weight, halo, lags, dq, dk, dv, splits, head_dim, eps)
        return dx, dw, dhalo, None, None, None, None, None


def _silu_norm(x, splits, head_dim, eps):
    q, k, v = _heads(F.silu(x.to(_cdt(x.dtype))), splits, head_dim)
    return _l2_norm(q, eps).to(x.dtype), _l2_norm(k, eps).to(x.dtype), v.to(x.dtype).contiguous()


def _l2_norm_cast(x, eps):
    return _l2_norm(x.to(_cdt(x.dtype)), eps).to(x.dtype)


def _gate_inputs(z, A_log, dt_bias):
    """(u = z + dt_bias, a = exp(A_log) per head as [H, 1]) in the compute dtype."""
    cdt = _cdt(z.dtype)
    H, K = z.shape[-2:]
    u = z.to(cdt)
    if dt_bias is not None:
        u = u + dt_bias.to(cdt).reshape(H, K)
    return u, A_log.to(cdt).exp()[:, None]


def _kda_gate(z, A_log, dt_bias, g_min, b, beta_scale):
    zf, a = _gate_inputs(z, A_log, dt_bias)
    g = -a * F.softplus(zf) if g_min is None else g_min * torch.sigmoid(a * zf)
    beta = None if b is None else beta_scale * torch.sigmoid(b.to(zf.dtype))
    return g, beta


def _kda_gate_bwd(dg, z, A_log, dt_bias, g_min):
    """(dz, dA_log, ddt_bias or None) of _kda_gate's g, by hand (the kernel's math, in fp32 or fp64)."""
    u, a = _gate_inputs(z, A_log, dt_bias)
    dg = dg.to(u.dtype)
    if g_min is None:  # g = -a softplus(u)
        dz = -dg * a * torch.sigmoid(u)
        da = dg * (-a * F.softplus(u))
    else:  # g = g_min sigmoid(a u)
        s = torch.sigmoid(a * u)
        t = dg * g_min * s * (1 - s)
        dz = t * a
        da = t * a * u
    lead = tuple(range(z.dim() - 2))
    dA = da.sum(lead).sum(-1)
    ddt = None if dt_bias is None else dz.sum(lead).reshape(dt_bias.shape)
    return dz, dA, ddt


def _beta_bwd(dbeta, b, beta_scale):
    sb = torch.sigmoid(b.to(_cdt(b.dtype)))
    return dbeta.to(sb.dtype) * beta_scale * sb * (1 - sb)


class _KDAGate(torch.autograd.Function):
    """g and beta from their pre-activations; the backward by hand: the TileLang kernel on Hopper
    (kda_cp.kernels.norm.kda_gate_bwd: one pass, dz, dA_log and ddt_bias together), else the same
    math in torch (compiled on CUDA). First-order only, as the KDA op."""

    @staticmethod
    def forward(ctx, z, A_log, dt_bias, b, g_min, beta_scale, compiled):
        ctx.set_materialize_grads(False)  # an unused g or beta gets no backward pass at all
        ctx.save_for_backward(z, A_log, dt_bias, b)
        ctx.args = (g_min, beta_scale, compiled)
        return _run(_kda_gate, compiled, z, A_log, dt_bias, g_min, b, beta_scale)

    @staticmethod
    @first_order_only("kda_gate")
    @torch.autograd.function.once_differentiable
    def backward(ctx, dg, dbeta):
        z, A_log, dt_bias, b = ctx.saved_tensors
        g_min, beta_scale, compiled = ctx.args
        dz = dA = ddt = db = None
        if dg is not None and any(ctx.needs_input_grad[:3]):
            norm = _norm_kernels("bwd", z) if compiled else None
            if norm is not None and norm.gate_supported(z, A_log, dt_bias)[0]:
                dz, dA, ddt = norm.kda_gate_bwd(dg, z, A_log, dt_bias, g_min)
            else:
                dz, dA, ddt = _run(_kda_gate_bwd, compiled, dg, z, A_log, dt_bias, g_min)
            dz, dA = dz.to(z.dtype), dA.to(A_log.dtype)
            ddt = None if ddt is None else ddt.to(dt_bias.dtype)
        if b is not None and dbeta is not None and ctx.needs_input_grad[3]:
            db = _run(_beta_bwd, compiled, dbeta, b, beta_scale).to(b.dtype)
        return dz, dA, ddt, db, None, None, None


def _rms_norm_gated(x, weight, gate, eps, out_dtype):
    cdt = _cdt(x.dtype)
    xf = x.to(cdt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(cdt)
    y = y * torch.sigmoid(gate.to(cdt).reshape(x.shape))
    return y.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1]).to(out_dtype)


def _rms_norm_gated_bwd(x, weight, gate, dy, eps):
    """(dx, dweight, dgate) of _rms_norm_gated, by hand (the kernel's math)."""
    cdt = _cdt(x.dtype)
    xf = x.to(cdt)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xh = xf * r
    s = torch.sigmoid(gate.to(cdt).reshape(x.shape))
    w = weight.to(cdt)
    dy = dy.to(cdt).reshape(x.shape)
    dgate = dy * xh * w * s * (1 - s)
    dxh = dy * s * w
    dx = r * (dxh - xh * (dxh * xh).mean(-1, keepdim=True))
    dw = (dy * s * xh).sum(tuple(range(x.dim() - 1)))
    return dx.to(x.dtype), dw.to(weight.dtype), dgate.reshape(gate.shape).to(gate.dtype)


class _RMSNormGated(torch.autograd.Function):
    """Per-head RMSNorm times the sigmoid gate: one TileLang kernel each way on Hopper
    (kda_cp.kernels.norm), else torch (compiled on CUDA); the backward by hand in both.
    First-order only, as the KDA op."""

    @staticmethod
    def forward(ctx, x, weight, gate, eps, out_dtype, compiled):
        ctx.save_for_backward(x, weight, gate)
        ctx.args = (eps, compiled)
        norm = _norm_kernels("fwd", x) if compiled else None
        if norm is not None and norm.norm_supported(x, weight, gate, out_dtype)[0]:
            return norm.rms_norm_gated_fwd(x, weight, gate, eps, out_dtype)
        return _run(_rms_norm_gated, compiled, x, weight, gate, eps, out_dtype)

    @staticmethod
    @first_order_only("rms_norm_gated")
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, gate = ctx.saved_tensors
        eps, compiled = ctx.args
        norm = _norm_kernels("bwd", x) if compiled else None
        if norm is not None and norm.norm_supported(x, weight, gate, dy.dtype)[0]:
            dx, dw, dgate = norm.rms_norm_gated_bwd(x, weight, gate, dy, eps)
        else:
            dx, dw, dgate = _run(_rms_norm_gated_bwd, compiled, x, weight, gate, dy, eps)
        need = ctx.needs_input_grad
        return dx if need[0] else None, dw if need[1] else None, dgate if need[2] else None, None, None, None


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    """fn as one torch.compile graph. dynamic=None: the first shape compiles static, a second one a
    graph with symbolic sizes. Each head layout, dtype or packed/dense form is a graph of its own;
    a process with more of them than Dynamo's recompile limit (several layer shapes, a pytest
    run) compiles up to _RECOMPILE_LIMIT graphs of fn, and a call past that runs eagerly, with
    one warning (fullgraph=True would otherwise make the limit an error). Graphs already compiled
    keep serving their calls."""
    graph = torch.compile(fn, fullgraph=True, dynamic=None)
    warned = False

    def run(*args):
        nonlocal warned
        cfg = torch._dynamo.config
        try:  # the limit is only checked on a cache miss, before tracing: a miss past it is cheap
            return graph(*args)
        except _LIMIT_HIT:
            if getattr(cfg, "fail_on_recompile_limit_hit", False):  # the user asked for the error
                raise
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # torch < 2.7
        try:
            with cfg.patch(**{name: max(_RECOMPILE_LIMIT, getattr(cfg, name))}):
                return graph(*args)
        except _LIMIT_HIT:
            if not warned:
                warned = True
                warnings.warn(f"kda_cp.glue: {fn.__name__} reached torch.compile's recompile limit; calls "
                              "that need a new graph run eagerly", RuntimeWarning, stacklevel=2)
        return fn(*args)

    return functools.wraps(fn)(run)


_RECOMPILE_LIMIT = 64


def _limit_hit_errors():
    import torch._dynamo.exc as exc

    return tuple(getattr(exc, n) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit") if hasattr(exc, n))


_LIMIT_HIT = _limit_hit_errors()


def use_compiled(*xs) -> bool:
    """Whether the glue runs compiled: on CUDA tensors, unless KDA_CP_EAGER_GLUE=1."""
    return any(x is not None and x.is_cuda for x in xs) and os.environ.get("KDA_CP_EAGER_GLUE", "0") != "1"


def _run(fn, compiled, *args):
    if compiled is None:
        compiled = use_compiled(*(a for a in args if isinstance(a, torch.Tensor)))
    return (_compiled(fn) if compiled else fn)(*args)


class _LinearSplit(torch.autograd.Function):
    """y = x W^T split into column blocks. The backward takes the first (wide) block's gradient as
    it is and the narrow others concatenated: dx = dy_0 W_0 + dy_r W_r, dW = [dy_0^T x; dy_r^T x],
    so the gradient of the whole y is never assembled (a copy of it, for the wide block)."""

    @staticmethod
    def forward(ctx, x, w, widths):
        ctx.save_for_backward(x, w)
        ctx.widths = widths
        return _linear_2d(x, w).split(widths, dim=-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        x, w = ctx.saved_tensors
        widths = ctx.widths
        x2 = x.reshape(-1, x.shape[-1])
        gs = [x2.new_zeros(x2.shape[0], n) if g is None else g.reshape(-1, n) for g, n in zip(grads, widths)]
        n0, head = widths[0], gs[0]
        rest = torch.cat(gs[1:], dim=-1) if len(gs) > 1 else None
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = head @ w[:n0]
            if rest is not None:
                dx.addmm_(rest, w[n0:])
            dx = dx.view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = torch.empty_like(w)
            torch.mm(head.t(), x2, out=dw[:n0])
            if rest is not None:
                torch.mm(rest.t(), x2, out=dw[n0:])
        return dx, dw, None


def linear_split(x: torch.Tensor, weight: torch.Tensor, widths) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, weight).split(widths, -1)``, as one 2-D GEMM over x's rows, with a backward
    that never concatenates the blocks' gradients into one of y's size (:class:`_LinearSplit`).

    x [..., D], weight [sum(widths), D] (under autocast, cast to its dtype as F.linear casts:
    floating tensors other than fp64). Returns one tensor [..., n] per width n. Raises ValueError
    if the widths do not sum to weight's rows.
    """
    widths = tuple(int(n) for n in widths)
    if sum(widths) != weight.shape[0] or not widths or min(widths) <= 0:
        raise ValueError(f"widths {widths} must be positive and sum to weight's {weight.shape[0]} rows")
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x, weight = (t.to(dt) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (x, weight))
        with torch.autocast(dev, enabled=False):
            return _split_linear(x, weight, widths)
    return _split_linear(x, weight, widths)


def _linear_2d(x, w):
    """F.linear(x, w) as one 2-D GEMM over x's rows, viewed back to [..., N] (F.linear may take a
    batched GEMM for a strided x: the results then differ by GEMM rounding)."""
    return F.linear(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


def _split_linear(x, weight, widths):
    # the autograd Function only where a gradient is asked for: its per-call host cost is on the
    # path before the layer's first GEMM
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearSplit.apply(x, weight, widths)
    return _linear_2d(x, weight).split(widths, dim=-1)


def lags_in_sequence(cu_seqlens, start: int, T: int, max_lag: int, device) -> torch.Tensor:
    """int32 [T]: how many earlier tokens of its own packed sequence each of this shard's tokens
    has, capped at ``max_lag``. ``cu_seqlens`` holds global offsets, ``start`` is the shard's first
    global position."""
    cu = torch.as_tensor(cu_seqlens, device=device, dtype=torch.int64)
    pos = start + torch.arange(T, device=device)
    seq_start = cu[torch.searchsorted(cu, pos, right=True) - 1]
    return (pos - seq_start).clamp_max(max_lag).to(torch.int32)


def conv_silu_norm(x, weight, splits, head_dim, eps, *, halo=None, lags=None, compiled=None):
    """SiLU of the causal depthwise short convolution of x, split into (q, k, v), q and k L2-normed.

    Math: y[t, c] = SiLU(sum_{j<W} weight[c, j] * x[t - (W-1) + j, c]); x before the shard is
    ``halo`` (zeros when None); with ``lags``, the tap at lag l > lags[t] reads zero (packed
    sequences). q, k = y's first two ``splits`` per head of ``head_dim``, each / max(||.||, eps).

    Args:
        x: [B, T, C] with C = sum(splits), float. weight: [C, W] (None: no convolution, SiLU only).
        splits: (H*K, H*K, HV*V), HV a multiple of H (GVA). halo: [B, W-1, C] or None. lags: int [T]
            from :func:`lags_in_sequence`, or None. compiled: force the compiled (True) or eager form.

    Returns:
        q, k [B, T, H, K] and v [B, T, H, HV*V/H] (each q/k head's value heads side by side),
        contiguous, in x's dtype.

    Raises:
        ValueError: splits not (H*K, H*K, HV*V) of x's C channels with K = head_dim and HV*V a
            multiple of H.
    """
    splits = tuple(int(s) for s in splits)
    if (len(splits) != 3 or sum(splits) != x.shape[-1] or splits[0] != splits[1] or splits[0] < head_dim
            or splits[0] % head_dim or splits[2] % (splits[0] // head_dim)):
        raise ValueError(f"splits must be (H*K, H*K, HV*V) of x's {x.shape[-1]} channels with K = head_dim = "
                         f"{head_dim} and HV*V a multiple of H, got {splits}")
    if weight is None:
        return _run(_silu_norm, compiled, x, splits, int(head_dim), float(eps))
    if compiled is None:
        compiled = use_compiled(x)
    if halo is None:
        halo = x.new_zeros(x.shape[0], weight.shape[1] - 1, x.shape[2])
    return _ConvSiluNorm.apply(x, weight, halo, lags, splits, int(head_dim), float(eps), compiled)


def l2_norm(x, eps: float = 1e-6, *, compiled=None):
    """x / max(||x||_2, eps) over the last dim, computed in fp32 (fp64 for fp64), in x's dtype."""
    return _run(_l2_norm_cast, compiled, x, float(eps))


def kda_gate(z, A_log, dt_bias=None, g_min: float | None = -5.0, b=None, *, beta_scale: float = 1.0,
             compiled=None):
    """The KDA decay gate from its pre-activation, and beta = beta_scale * sigmoid(b).

    Math: g = g_min * sigmoid(exp(A_log[h]) * (z + dt_bias)) when g_min is set (Kimi K3's bounded
    gate, g in (g_min, 0)); g = -exp(A_log[h]) * softplus(z + dt_bias) when g_min is None (Kimi
    Linear's gate, any g < 0).

    Args:
        z: [B, T, H, K] float. A_log: [H]. dt_bias: [H * K] or [H, K], or None.
        b: [B, T, H] pre-sigmoid beta, or None. beta_scale: 1, or 2 for beta in [0, 2] (negative
            eigenvalues, flash-linear-attention's allow_neg_eigval).

    Returns:
        (g [B, T, H, K], beta [B, T, H] or None), fp32 (fp64 for fp64 z).

    Raises:
        NotImplementedError: on a second-order backward (create_graph=True), as the KDA op.
    """
    if compiled is None:
        compiled = use_compiled(z)
    g_min = None if g_min is None else float(g_min)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (z, A_log, dt_bias, b)):
        return _run(_kda_gate, compiled, z, A_log, dt_bias, g_min, b, float(beta_scale))
    return _KDAGate.apply(z, A_log, dt_bias, b, g_min, float(beta_scale), compiled)


def rms_norm_gated(x, weight, gate, eps: float, out_dtype=None, *, compiled=None):
    """Per-head RMSNorm times a sigmoid gate: x / sqrt(mean(x^2) + eps) * weight * sigmoid(gate).

    Args:
        x: [B, T, H, V]. weight: [V]. gate: [B, T, H * V] or [B, T, H, V].
        out_dtype: output dtype (x's by default).

    Returns:
        [B, T, H * V] in ``out_dtype``.

    Raises:
        NotImplementedError: on a second-order backward (create_graph=True), as the KDA op.
    """
    if compiled is None:
        compiled = use_compiled(x, gate)
    return _RMSNormGated.apply(x, weight, gate, float(eps), out_dtype or x.dtype, compiled)
