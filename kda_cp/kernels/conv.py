"""The layer's short conv + SiLU + L2Norm of q and k, forward and backward, as TileLang kernels.

For stacked channels c of q | k | v (C = 2*H*K + HV*V; v taken as HV*V/K column groups of K) and tokens t of a
sequence:

    pre[t, c] = sum_{l < W} w[c, W-1-l] * x[t - l, c]      tap l reads zero when l > lags[t]
    y[t, c]   = SiLU(pre[t, c])
    q, k      = y / max(||y||_2, eps) per head over K channels;  v = y

x before the shard (t < 0) is the halo (the CP neighbour's last W-1 rows, or zeros). A thread
block owns the channels of one head, so the L2 norm is a row reduction in registers, and walks a
share of the token tiles; one launch per part (q, k, v). The forward writes q, k, v contiguous;
the backward recomputes pre from x (nothing else is kept), applies the norm's and SiLU's backward,
and writes dx, the halo gradient and per-block partial weight gradients (summed on the host side,
so the weight gradient is deterministic). docs/design.md §9 has the math, docs/kernels.md the
launch and its state.
"""
import functools

import torch
import tilelang.language as T

from ._common import compile_kernel, tl_dtype

__all__ = ["conv_silu_norm_fwd", "conv_silu_norm_bwd", "conv_supported", "build_conv_kernel"]

#: Rows of one register tile (the recompute tile of the backward, the output tile of the forward).
TILE = 64


def _taps(W, valid, term):
    """sum over l < W of term(l) where valid(l) (True: always), as one expression (built in
    Python, unrolled)."""
    def one(l):
        v = valid(l)
        return term(l) if v is True else T.if_then_else(v, term(l), T.float32(0))

    acc = one(0)
    for l in range(1, W):
        acc = acc + one(l)
    return acc


def _and(a, b):
    return a if b is True else a & b


def _conv_func(C, CS, H, K, W, part, dtype, hdtype, eps, threads, min_blocks, backward, packed, base):
    """One launch covers the H heads of K channels of one part (0: q, 1: k, 2: v; q and k are
    L2-normed), the x columns base .. base + H*K.

    packed: taps are masked by Lags (packed sequences); else every tap reads the same sequence
    (the halo before the shard) and Lags is not read. Each block's tiles alternate between two
    buffers: the next tile's x (and dY) arrive by TMA while this one computes."""
    f32 = "float32"
    R = TILE  # rows loaded and recomputed per tile
    BO = TILE if not backward else TILE - (W - 1)  # rows written per tile (dx row i needs dpre at i .. i+W-1)
    P = W - 1
    G = 4  # row groups of the weight-gradient partial sums
    RG = R // G
    LO = P if backward else 0  # lg index of tile row 0 (the backward pads P rows each side)
    NL = R + 2 * P if backward else R
    TT = T.dynamic("TT")
    Tn = T.dynamic("Tn")
    B = T.dynamic("B")
    S = T.dynamic("S")  # blocks along the tokens; each walks a contiguous share of the tiles
    norm = part < 2
    cbase = base

    def tap_ok(lg, r, lag):
        """Tap ``lag`` of tile row r reads the same sequence (dense: always, the halo before the
        shard; the backward's rows past the end carry dpre = 0)."""
        return (lg[LO + r] >= lag) if packed else True

    def xval(xs, r, j):  # x at tile row r >= -(W-1)
        return T.cast(xs[r + W - 1, j], f32)

    @T.macro
    def issue(X, b, t0, c0, xs, bar):
        # TMA of x rows t0 - (W-1) .. t0 + R - 1 of batch row b (before t0 = 0 they belong to the
        # previous batch row or lie below row 0: the halo replaces them on arrival; rows past the
        # tensor arrive as zeros)
        T.tma_copy(X[b * Tn + t0 - P : b * Tn + t0 + R, c0 : c0 + K], xs, barrier=bar)

    @T.macro
    def issue_dy(DY, b, h, t0, dns, bar):
        T.tma_copy(DY[b * Tn + t0 : b * Tn + t0 + R, h, :], dns, barrier=bar)

    @T.macro
    def arrive(Halo, b, t0, c0, xs, bar, parity):
        T.mbarrier_wait_parity(bar, parity)
        if t0 == 0:
            for i, j in T.Parallel(W - 1, K):
                xs[i, j] = Halo[b, i, c0 + j]
            T.fence_proxy_async()  # generic writes before a later TMA write of the same tile

    @T.macro
    def lags_next(Lags, t0, lnx):
        # the next tile's lags into a register now, into shared after this tile's compute
        tx = T.get_thread_binding()
        if tx < R:
            lnx[0] = T.if_then_else(t0 + tx < Tn, Lags[t0 + tx], -1)

    @T.macro
    def lags_store(lg, lnx):
        tx = T.get_thread_binding()
        if tx < R:
            lg[LO + tx] = lnx[0]

    @T.macro
    def lags_first(Lags, t0, lg):
        for i in T.Parallel(R):
            lg[LO + i] = T.if_then_else(t0 + i < Tn, Lags[t0 + i], -1)

    if not backward:
        @T.macro
        def fwd_tile(Y, b, h, t0, xs, lg, ws, y, sq, rs):
            for i, j in T.Parallel(R, K):
                pre = _taps(W, lambda lag: tap_ok(lg, i, lag),
                            lambda lag: ws[W - 1 - lag, j] * xval(xs, i - lag, j))
                y[i, j] = pre / (T.float32(1) + T.exp(-pre))
                sq[i, j] = y[i, j] * y[i, j]
            if norm:
                T.reduce_sum(sq, rs, dim=1)
                for i in T.Parallel(R):
                    rs[i] = T.float32(1) / T.max(T.sqrt(rs[i]), T.float32(eps))
                for i, j in T.Parallel(R, K):
                    y[i, j] = y[i, j] * rs[i]
            for i, j in T.Parallel(R, K):
                if t0 + i < Tn:
                    Y[b * Tn + t0 + i, h, j] = T.cast(y[i, j], dtype)

        @T.macro
        def fwd_step(X, Halo, Lags, Y, b, h, c0, t0, more, xs, lg, bar, xn, ln, barn, parity, lnx,
                     ws, y, sq, rs):
            # tile t0 from (xs, lg); when more, the next tile on its way into (xn, ln)
            if more:
                issue(X, b, t0 + R, c0, xn, barn)
                if T.get_thread_binding() == 0:
                    T.mbarrier_arrive(barn)
                if packed:
                    lags_next(Lags, t0 + R, lnx)
            arrive(Halo, b, t0, c0, xs, bar, parity)
            fwd_tile(Y, b, h, t0, xs, lg, ws, y, sq, rs)
            if packed:
                if more:
                    lags_store(ln, lnx)
            T.sync_threads()  # xs free for the TMA load two tiles on

        @T.prim_func
        def kda_conv_fwd(
            X: T.Tensor([TT, CS], dtype),
            Wt: T.Tensor([W, C], f32),
            Halo: T.Tensor([B, W - 1, C], dtype),
            Lags: T.Tensor([Tn], "int32"),
            Y: T.Tensor([TT, H, K], dtype),
            Split: T.Tensor([S], "int32"),
        ):
            with T.Kernel(S, H, B, threads=threads) as (sp, h, b):
                c0 = cbase + h * K
                xa = T.alloc_shared([R + W - 1, K], dtype)
                la = T.alloc_shared([NL], "int32")
                ws = T.alloc_shared([W, K], f32)
                y = T.alloc_fragment([R, K], f32)
                sq = T.alloc_fragment([R, K], f32)
                rs = T.alloc_fragment([R], f32)
                for u, j in T.Parallel(W, K):
                    ws[u, j] = Wt[u, c0 + j]
                ntile = T.ceildiv(Tn, R)
                nper = T.ceildiv(ntile, S)
                cnt = T.max(T.min(nper, ntile - sp * nper), 0)
                xb = T.alloc_shared([R + W - 1, K], dtype)
                lb = T.alloc_shared([NL], "int32")
                bar_a = T.alloc_barrier(1)
                bar_b = T.alloc_barrier(1)
                lnx = T.alloc_local([1], "int32")
                if cnt > 0:
                    issue(X, b, sp * nper * R, c0, xa, bar_a)
                    if T.get_thread_binding() == 0:
                        T.mbarrier_arrive(bar_a)
                    if packed:
                        lags_first(Lags, sp * nper * R, la)
                for p in T.serial(T.ceildiv(cnt, 2)):  # two tiles a trip: buffer a, then b
                    t0 = (sp * nper + 2 * p) * R
                    fwd_step(X, Halo, Lags, Y, b, h, c0, t0, 2 * p + 1 < cnt, xa, la, bar_a, xb, lb,
                             bar_b, p % 2, lnx, ws, y, sq, rs)
                    if 2 * p + 1 < cnt:
                        fwd_step(X, Halo, Lags, Y, b, h, c0, t0 + R, 2 * p + 2 < cnt, xb, lb, bar_b,
                                 xa, la, bar_a, p % 2, lnx, ws, y, sq, rs)

        return kda_conv_fwd

    @T.macro
    def bwd_tile(DX, DHalo, b, h, c0, t0, xs, dns, lg, ws, dps, pre, tmp, nrm, prj, dwa):
        for i, j in T.Parallel(R, K):
            pre[i, j] = _taps(W, lambda lag: tap_ok(lg, i, lag),
                              lambda lag: ws[W - 1 - lag, j] * xval(xs, i - lag, j))
        if norm:  # L2Norm backward of n = y / max(||y||, eps), y = SiLU(pre)
            for i, j in T.Parallel(R, K):
                tmp[i, j] = pre[i, j] / (T.float32(1) + T.exp(-pre[i, j]))
                tmp[i, j] = tmp[i, j] * tmp[i, j]
            T.reduce_sum(tmp, nrm, dim=1)
            for i, j in T.Parallel(R, K):
                tmp[i, j] = pre[i, j] / (T.float32(1) + T.exp(-pre[i, j])) * T.cast(dns[i, j], f32)
            T.reduce_sum(tmp, prj, dim=1)  # y . dn
            for i in T.Parallel(R):
                # n . dn / ||y|| where ||y|| > eps (else the norm is y / eps, linear); 1 / max(||y||, eps)
                nrm[i] = T.sqrt(nrm[i])
                prj[i] = T.if_then_else(nrm[i] > eps, prj[i] / (nrm[i] * nrm[i]), T.float32(0))
                nrm[i] = T.float32(1) / T.max(nrm[i], T.float32(eps))
        for i, j in T.Parallel(R, K):
            sg = T.float32(1) / (T.float32(1) + T.exp(-pre[i, j]))
            if norm:
                dy = (T.cast(dns[i, j], f32) - pre[i, j] * sg * prj[i]) * nrm[i]
            else:
                dy = T.cast(dns[i, j], f32)
            # dL/dpre; zero on rows outside the sequence (packed) or past the end (dense)
            live = (lg[P + i] >= 0) if packed else (t0 + i < Tn)
            dps[P + i, j] = T.if_then_else(live, dy * sg * (T.float32(1) + pre[i, j] * (T.float32(1) - sg)),
                                           T.float32(0))
        for i, j in T.Parallel(R, K):
            if (i < BO) & (t0 + i < Tn):
                DX[b * Tn + t0 + i, c0 + j] = T.cast(
                    _taps(W, lambda lag: tap_ok(lg, i + lag, lag),
                          lambda lag: dps[P + i + lag, j] * ws[W - 1 - lag, j]),
                    dtype)
        if t0 == 0:  # the halo rows t = i - (W-1) < 0
            for i, j in T.Parallel(W - 1, K):
                DHalo[b, i, c0 + j] = T.cast(
                    _taps(W, lambda lag: tap_ok(lg, i + lag - P, lag), lambda lag: dps[i + lag, j] * ws[W - 1 - lag, j]),
                    hdtype)
        # weight gradient of tap W-1-u: sum over rows r < BO of dpre[r] x[r - u], in G row groups
        for ug, j in T.Parallel(G * W, K):
            dwa[ug, j] = dwa[ug, j] + _taps(
                RG, lambda r: _and((ug % G) * RG + r < BO, tap_ok(lg, (ug % G) * RG + r, ug // G)),
                lambda r: dps[P + (ug % G) * RG + r, j] * xval(xs, (ug % G) * RG + r - ug // G, j))

    @T.macro
    def bwd_step(X, DY, Halo, Lags, DX, DHalo, b, h, c0, t0, more, xs, dns, lg, bar, xn, dnn, ln, barn,
                 parity, lnx, ws, dps, pre, tmp, nrm, prj, dwa):
        # tile t0 from (xs, dns, lg); when more, the next tile on its way into (xn, dnn, ln)
        if more:
            issue(X, b, t0 + BO, c0, xn, barn)
            issue_dy(DY, b, h, t0 + BO, dnn, barn)
            if T.get_thread_binding() == 0:
                T.mbarrier_arrive(barn)
            if packed:
                lags_next(Lags, t0 + BO, lnx)
        arrive(Halo, b, t0, c0, xs, bar, parity)
        bwd_tile(DX, DHalo, b, h, c0, t0, xs, dns, lg, ws, dps, pre, tmp, nrm, prj, dwa)
        if packed:
            if more:
                lags_store(ln, lnx)
        T.sync_threads()  # xs, dns and dps free for the next tiles

    @T.prim_func
    def kda_conv_bwd(
        X: T.Tensor([TT, CS], dtype),
        Wt: T.Tensor([W, C], f32),
        Halo: T.Tensor([B, W - 1, C], dtype),
        Lags: T.Tensor([Tn], "int32"),
        DY: T.Tensor([TT, H, K], dtype),
        DX: T.Tensor([TT, C], dtype),
        DHalo: T.Tensor([B, W - 1, C], hdtype),
        DWp: T.Tensor([S, B, G * W, C], f32),
    ):
        with T.Kernel(S, H, B, threads=threads) as (sp, h, b):
            if min_blocks > 1:  # ptxas caps the registers so that many blocks fit an SM
                T.annotate_min_blocks_per_sm(min_blocks)
            c0 = cbase + h * K
            xa = T.alloc_shared([R + W - 1, K], dtype)
            da = T.alloc_shared([R, K], dtype)
            ws = T.alloc_shared([W, K], f32)
            # lags and dL/dpre of tile row r at r + P, rows outside the tile -1 and 0 (every index >= 0)
            la = T.alloc_shared([NL], "int32")
            dps = T.alloc_shared([R + 2 * P, K], f32)
            pre = T.alloc_fragment([R, K], f32)
            tmp = T.alloc_fragment([R, K], f32)
            nrm = T.alloc_fragment([R], f32)
            prj = T.alloc_fragment([R], f32)
            dwa = T.alloc_fragment([G * W, K], f32)  # row (u, g): tap W-1-u, rows g*RG .. of each tile
            for u, j in T.Parallel(W, K):
                ws[u, j] = Wt[u, c0 + j]
            T.clear(dwa)
            for i, j in T.Parallel(R + 2 * P, K):
                dps[i, j] = T.float32(0)
            for i in T.Parallel(NL):
                la[i] = -1
            ntile = T.ceildiv(Tn, BO)
            nper = T.ceildiv(ntile, S)
            cnt = T.max(T.min(nper, ntile - sp * nper), 0)
            xb = T.alloc_shared([R + W - 1, K], dtype)
            db = T.alloc_shared([R, K], dtype)
            lb = T.alloc_shared([NL], "int32")
            bar_a = T.alloc_barrier(1)
            bar_b = T.alloc_barrier(1)
            lnx = T.alloc_local([1], "int32")
            for i in T.Parallel(NL):
                lb[i] = -1
            if cnt > 0:
                issue(X, b, sp * nper * BO, c0, xa, bar_a)
                issue_dy(DY, b, h, sp * nper * BO, da, bar_a)
                if T.get_thread_binding() == 0:
                    T.mbarrier_arrive(bar_a)
                if packed:
                    lags_first(Lags, sp * nper * BO, la)
            for p in T.serial(T.ceildiv(cnt, 2)):  # two tiles a trip: buffers a, then b
                t0 = (sp * nper + 2 * p) * BO
                bwd_step(X, DY, Halo, Lags, DX, DHalo, b, h, c0, t0, 2 * p + 1 < cnt, xa, da, la, bar_a,
                         xb, db, lb, bar_b, p % 2, lnx, ws, dps, pre, tmp, nrm, prj, dwa)
                if 2 * p + 1 < cnt:
                    bwd_step(X, DY, Halo, Lags, DX, DHalo, b, h, c0, t0 + BO, 2 * p + 2 < cnt, xb, db, lb,
                             bar_b, xa, da, la, bar_a, p % 2, lnx, ws, dps, pre, tmp, nrm, prj, dwa)
            for ug, j in T.Parallel(G * W, K):
                DWp[sp, b, ug, c0 + j] = dwa[ug, j]

    return kda_conv_bwd


def build_conv_kernel(C, CS, H, K, W, part, dtype, halo_dtype, eps, *, backward, packed=True, launch=None,
                      fast_math=True, base=None):
    """Compile the forward or the backward of one part (0: q, 1: k, 2: v) of H heads of K
    channels, x's columns base .. base + H*K (default base = part * H * K; under GVA the v part
    has other heads than q and k); T, B and the token split S dynamic. CS >= C is X's row stride
    (X may be the first C columns of a wider buffer).

    Forward: kernel(X[B*T, CS], Wt[W, C] f32 (tap-major: Wt[j] = weight[:, j]), Halo[B, W-1, C],
    Lags[T] i32, Y[B*T, H, K], Split[S] (only its length is read)).
    Backward: kernel(X, Wt, Halo, Lags, dY[B*T, H, K], dX[B*T, C] (this part's columns written),
    dHalo[B, W-1, C] (halo_dtype; written by the blocks of the first tile), dWp[S, B, W*4, C] f32:
    partial weight gradients, row u*4+g holding tap W-1-u of row group g, summed by the caller).
    launch: (threads per block, resident blocks per SM), default FWD_LAUNCH or BWD_LAUNCH; the
    backward's launch bounds ask ptxas for that many blocks (the forward as compiled fits two
    blocks of 256 threads or four of 128 by registers).
    Raises ValueError when CS rows are not 16-byte multiples (TMA) or the part's columns lie
    outside x's C.
    """
    if (CS * (4 if dtype == "float32" else 2)) % 16:
        raise ValueError(f"row stride CS={CS} of {dtype} is not a multiple of 16 bytes, which the TMA loads need")
    launch = tuple(launch or (BWD_LAUNCH if backward else FWD_LAUNCH))
    base = part * H * K if base is None else int(base)
    if not 0 <= base <= C - H * K:
        raise ValueError(f"part columns {base} .. {base + H * K} lie outside x's C={C} channels")
    return _build_conv_kernel(C, CS, H, K, W, part, dtype, halo_dtype, float(eps), backward, packed, launch,
                              fast_math, base)


@functools.lru_cache(maxsize=None)
def _build_conv_kernel(C, CS, H, K, W, part, dtype, halo_dtype, eps, backward, packed, launch, fast_math, base):
    threads, per_sm = launch
    return compile_kernel(_conv_func(C, CS, H, K, W, part, dtype, halo_dtype, eps, threads, per_sm, backward,
                                     packed, base),
                          name="conv_bwd" if backward else "conv_fwd", fast_math=fast_math)


def conv_supported(x, weight, splits, head_dim) -> tuple[bool, str]:
    """Whether the kernels cover this call: CUDA Hopper, x bf16/fp16 [B, T, C] with unit channel
    stride, splits (q, k, v channels) with q and k of equal width, every part a whole number of
    ``head_dim`` (64 or 128) columns (v of GVA's more heads too), tilelang importable."""
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9):
        return False, "not a Hopper (sm_90) CUDA tensor"
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 3 or x.stride(-1) != 1:
        return False, f"x must be bf16/fp16 [B, T, C] with unit channel stride, got {x.dtype} {tuple(x.shape)}"
    if (len(splits) != 3 or splits[0] != splits[1] or head_dim not in (64, 128) or weight is None
            or any(s < 1 or s % head_dim for s in splits)):
        return False, f"splits {splits} with head_dim {head_dim}: need q = k widths, every part a multiple of " \
                      f"head_dim in (64, 128), a conv weight"
    if not 2 <= weight.shape[1] < TILE:
        return False, f"conv width {weight.shape[1]}: the kernels need 2 <= W < {TILE}"
    return True, ""


def _rows(x):
    """x [B, T, C] as the [B*T, CS] rows the kernels read (CS = row stride; no copy when the rows
    are the first C columns of a wider contiguous buffer, as the fused projection's split views,
    and TMA can read them: a 16-byte aligned start and row stride)."""
    B, T, C = x.shape
    CS = x.stride(1)
    tma = x.data_ptr() % 16 == 0 and (CS * x.element_size()) % 16 == 0
    if tma and CS >= C and (B == 1 or x.stride(0) == T * CS):
        try:
            return x.as_strided((B * T, CS), (CS, 1)), CS
        except RuntimeError:  # the last row's tail lies outside the storage
            pass
    return x.reshape(B * T, C).contiguous(), C


def _tma_ready(t):
    """t contiguous with a 16-byte aligned start (what a TMA load reads), copied if not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _lags(lags, T, W, device):
    if lags is None:
        return _full_lags(T, W, str(device))
    return lags.to(device=device, dtype=torch.int32).contiguous()


@functools.lru_cache(maxsize=64)
def _full_lags(T, W, device):
    return torch.full((T,), W - 1, dtype=torch.int32, device=device)


def _blocks(ntile, heads, B, x, per_sm):
    """Blocks along the tokens: at most per_sm resident blocks on every SM (one wave; a second,
    partial wave would double the time), at most one per tile."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return max(1, min(ntile, per_sm * sms // (heads * B)))


#: The launches: (threads per block, resident blocks per SM) of the forward and the backward.
FWD_LAUNCH = (256, 2)
BWD_LAUNCH = (256, 2)


def _parts(C, K, splits):
    """(heads of K channels, first column) of the q, k and v parts of x's C channels."""
    splits = (C // 3,) * 3 if splits is None else tuple(int(s) for s in splits)
    if sum(splits) != C or any(s % K for s in splits):
        raise ValueError(f"splits {splits} must sum to x's C={C} channels, each a multiple of head_dim={K}")
    return [(s // K, sum(splits[:i])) for i, s in enumerate(splits)], splits


def conv_silu_norm_fwd(x, weight, halo, lags, head_dim, eps, *, splits=None, launch=FWD_LAUNCH):
    """q, k, v = the layer's conv + SiLU + L2Norm (module docstring) on the kernels.

    Args: x [B, T, C] bf16/fp16, unit channel stride; weight [C, W]; halo [B, W-1, C] in x's
    dtype; lags int [T] or None (every tap valid; the halo feeds t < W-1); splits: the q, k, v
    channel counts (H*K, H*K, HV*V), default three equal parts; launch: (threads, blocks per SM),
    for scripts/tune_conv.py.
    Returns q, k [B, T, H, K] and v [B, T, H, HV*V/H], contiguous (glue.conv_silu_norm's shapes).
    Raises ValueError when splits do not sum to C, a part is not a multiple of head_dim, or v's
    channels do not split into q's H heads.
    """
    B, T, C = x.shape
    K = head_dim
    parts, splits = _parts(C, K, splits)
    H = parts[0][0]
    if splits[2] % H:
        raise ValueError(f"v's {splits[2]} channels do not split into the {H} heads of q and k")
    W = weight.shape[1]
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, splits[2] // H)]  # v: glue's [B, T, H, HV V / H]
    outs = [torch.empty(*sh, dtype=x.dtype, device=x.device) for sh in shapes]
    if T > 0:
        rows, CS = _rows(x)
        wt = weight.float().t().contiguous()
        halo = halo.to(x.dtype).contiguous()
        lg = _lags(lags, T, W, x.device)
        token_splits = {nh: torch.empty(_blocks(-(-T // TILE), nh, B, x, per_sm=launch[1]), dtype=torch.int32,
                                     device=x.device) for nh, _ in parts}  # one wave of blocks per part
        for part, (y, (nh, base)) in enumerate(zip(outs, parts)):
            kern = build_conv_kernel(C, CS, nh, K, W, part, tl_dtype(x.dtype), tl_dtype(x.dtype), float(eps),
                                     backward=False, packed=lags is not None, launch=launch, base=base)
            kern(rows, wt, halo, lg, y.view(B * T, nh, K), token_splits[nh])
    return tuple(outs)


def conv_silu_norm_bwd(x, weight, halo, lags, dq, dk, dv, head_dim, eps, *, splits=None, launch=BWD_LAUNCH):
    """Gradients (dx [B, T, C], dweight [C, W], dhalo [B, W-1, C]) of :func:`conv_silu_norm_fwd`,
    from dq, dk [B, T, H, K] and dv [B, T, H, HV*V/H] (its outputs' shapes; splits as there).
    Raises ValueError as :func:`conv_silu_norm_fwd` for splits that do not fit x."""
    B, T, C = x.shape
    K = head_dim
    parts, _ = _parts(C, K, splits)
    H = parts[0][0]
    W = weight.shape[1]
    dhalo = torch.zeros(B, W - 1, C, dtype=halo.dtype, device=x.device)
    if T == 0:
        return torch.zeros_like(x), torch.zeros_like(weight), dhalo
    rows, CS = _rows(x)
    wt = weight.float().t().contiguous()
    hx = halo.to(x.dtype).contiguous()
    lg = _lags(lags, T, W, x.device)
    # one token split for the three parts: each writes its own columns of every row of dwp
    S = _blocks(-(-T // (TILE - (W - 1))), H, B, x, per_sm=launch[1])
    dx = torch.empty(B * T, C, dtype=x.dtype, device=x.device)
    dwp = torch.empty(S, B, W, 4, C, dtype=torch.float32, device=x.device)  # row u*4+g: tap W-1-u
    for part, (d, (nh, base)) in enumerate(zip((dq, dk, dv), parts)):
        kern = build_conv_kernel(C, CS, nh, K, W, part, tl_dtype(x.dtype), tl_dtype(halo.dtype), float(eps),
                                 backward=True, packed=lags is not None, launch=launch, base=base)
        kern(rows, wt, hx, lg, _tma_ready(d.to(x.dtype).reshape(B * T, nh, K)), dx, dhalo, dwp.view(S, B, 4 * W, C))
    dw = dwp.sum((0, 1, 3)).flip(0).t().to(weight.dtype)
    return dx.view(B, T, C), dw, dhalo
