"""Chunk-local stage: gate cumsum, decayed K K^T and Q K^T, the UT transform (W, U).

This one kernel fuses what docs/design.md §2 lists as two stages (gate cumsum, intra-chunk UT) so the
gates are read once. One thread block per (chunk, head); no state is involved, so all chunks run
in parallel.

Math (docs/design.md §2, per chunk of C tokens, rows i, columns j, key channel d):

    gamma_i   = sum_{s <= i} g_s                          chunk-local cumsum, natural log, fp32
    Akk[i,j]  = sum_d k_i[d] k_j[d] exp(gamma_i[d] - gamma_j[d])            (j < i)
    Aqk[i,j]  = scale * sum_d q_i[d] k_j[d] exp(gamma_i[d] - gamma_j[d])    (j <= i)
    Tinv      = (I + Diag(beta) StrictTril(Akk))^-1                         fp32, blocked solve
    W         = Tinv Diag(beta) (k * exp(gamma)),   U = Tinv Diag(beta) v
    Qg        = scale * q * exp(gamma),   Kd = k * exp(gamma_last - gamma),   eC = exp(gamma_last)

The exponent exp(gamma_i - gamma_j) is split over a reference r_I = gamma at the last position
before sub-chunk I (16 tokens; r_0 = 0), where I is the sub-chunk of row i:

    exp(gamma_i - gamma_j) = exp(gamma_i - r_I) * exp(r_I - gamma_j)

The reference is never in the future of row i or of column j <= i. The first factor is <= 1; the
second is <= 1 for j before sub-chunk I and <= exp(80) inside it (16 steps of g >= -5), so both fit
bf16/fp32 and the split costs one GEMM per sub-chunk row block. Rows past the end of a sequence are
loaded as zeros (g = 0, beta = 0) and never contribute.

Numerics: cumsum, exponentials and the triangular solve in fp32. The Akk/Aqk GEMMs take bf16
operands (the e^80 factor does not fit fp16) with fp32 accumulation; the W/U GEMMs take the input
dtype. Outputs W, U, Qg, Kd, Aqk are stored in the input dtype, eC in fp32.
"""

import functools

import tilelang
import tilelang.language as T

from ._common import (GENERAL_FLOOR, SUB, block_rows_macro, compile_kernel, pairwise_macro, row_scan_macro,
                      sub_chunk_ref, tf32_hi, tl_dtype)


def _load_cumsum_macro(C, K, threads, general=False):
    """load_cumsum(G, bos, eos, ih, gam_s): gam_s[i, :] = sum_{s <= i} g_{bos+s}, every thread
    scanning parts of 16 rows of a key channel in registers (_common.row_scan_macro); rows past eos
    count as g = 0. The scan stays a loop in the generated code (see _solve_macro)."""
    row_scan = row_scan_macro(C, K, threads, floor=GENERAL_FLOOR if general else None)

    @T.macro
    def load_cumsum(G, bos, eos, ih, gam_s):
        T.copy(G[bos : bos + C, ih, :], gam_s)  # rows past eos are masked in the scan below
        row_scan(gam_s, bos, eos)

    return load_cumsum


def _solve_macro(C, f32, threads):
    """solve(L_s, Ti_s, Td_s, tmp_s): Ti_s = (I + L)^-1 for a strictly lower-triangular L_s (C x C),
    fp32 on CUDA cores, shared by both chunk-local kernels. Diagonal 16 x 16 blocks by forward
    substitution, one thread per column, the column held in registers; then block rows I >= 1:
    Ti[I, :I] = Tinv_II (-L[I, :I] Ti[:I, :I]) (_common.block_rows_macro).

    The scan over rows and the block-row sums stay loops in the generated code: fully unrolled,
    the kernel stalls on instruction fetch.
    """
    BS = SUB
    NSUB = C // BS
    R16 = tuple(range(BS))
    block_rows = block_rows_macro(C, threads)

    @T.macro
    def solve(L_s, Ti_s, Td_s, tmp_s):
        for i, j in T.Parallel(C, C):  # the blocks above the diagonal; the solve writes the others
            if j >= BS * (i // BS + 1):
                Ti_s[i, j] = T.float32(0)
        for I, c in T.Parallel(NSUB, BS):
            x = T.alloc_local([BS], f32)
            for r in R16:
                acc = T.if_then_else(r == c, T.float32(1), T.float32(0))
                for j in R16[:r]:
                    acc = acc - L_s[BS * I + r, BS * I + j] * x[j]
                x[r] = acc
            for r in R16:
                Ti_s[BS * I + r, BS * I + c] = x[r]
                Td_s[I, r, c] = x[r]
        block_rows(L_s, Ti_s, Td_s, tmp_s)  # L_s is already Diag(beta) StrictTril(Akk)

    return solve


def _row_block_macro(C, K, ncols, dtype, f32, scale, general=False):
    """row_block(I, gam_s, k_s, q_s, beta_s, kqp_s, km_s, L_s, Qg_out, Kd_out, Aqk_out, ic, ih): row
    block I (rows 16 I .. 16 I + 15) of the chunk-local kernel: its rows of Qg and Kd, of beta k e^gamma
    (written over q_s's rows, which nothing reads after this block), its rows of
    L = Diag(beta) StrictTril(Akk) (into L_s) and of Aqk (to global), through the reference r_I (see
    the module docstring), from one MMA of [k_i exp(gamma_i - r_I); scale q_i exp(gamma_i - r_I)]
    (kqp_s) with the column table km_j = k_j exp(r_I - gamma_j) over the first ``ncols`` columns
    (km_s; its rows past sub-chunk I are not written here and reach only masked columns).
    ``ncols`` must cover the row block's sub-chunks, 16 (I + 1) <= ncols; Aqk's columns past ncols
    are written as zeros, L_s's are left unwritten (the solve reads only j < 16 (I + 1)).

    general (any g <= 0): the own sub-chunk's 16 x 16 block is summed pairwise first
    (_common.pairwise_macro, into pw_s [32, 16] fp32, before q_s's rows are overwritten) and
    replaces the MMA's columns there; the column factors are exp(min(r_I - gamma_j, 0)), <= 1."""
    BS = SUB
    op = "bfloat16"  # operand dtype of the Akk/Aqk GEMMs
    LOG2E = 1.4426950408889634
    pairwise = pairwise_macro(K, with_q=True) if general else None

    def capped(x):  # the column factor's exponent: capped at 0 (a factor <= 1) for the general gate
        return T.min(x, T.float32(0)) if general else x

    @T.macro
    def row_block(I, gam_s, k_s, q_s, beta_s, kqp_s, km_s, L_s, Qg_out, Kd_out, Aqk_out, ic, ih, pw_s=None):
        if general:
            pairwise(I, gam_s, k_s, q_s, pw_s)
        # the row block's factors, and its rows of Qg and Kd (same q and gamma)
        for r, d in T.Parallel(BS, K):
            i = BS * I + r
            ref = sub_chunk_ref(gam_s, I, d)
            gi = gam_s[i, d]
            e = T.exp2((gi - ref) * LOG2E)
            kv = T.cast(k_s[i, d], f32)
            qv = T.cast(q_s[i, d], f32)
            kqp_s[r, d] = T.cast(kv * e, op)
            kqp_s[BS + r, d] = T.cast(qv * (e * scale), op)
            eg = T.exp2(gi * LOG2E)
            Qg_out[ic, ih, i, d] = T.cast(qv * scale * eg, dtype)
            # q's row i is read only here, by this thread: it becomes beta_i k_i e^gamma_i, the W
            # GEMM's operand (no second pass over k and gamma, no second exponential)
            q_s[i, d] = T.cast(beta_s[i] * kv * eg, dtype)
            Kd_out[ic, ih, i, d] = T.cast(kv * T.exp2((gam_s[C - 1, d] - gi) * LOG2E), dtype)
        # sub-chunks J <= I only (a loop of I + 1 steps): the rows past them are neither computed
        # nor loaded (with a masked loop over all C rows, TileLang loaded k and gamma for the
        # masked rows as well)
        for J in T.serial(I + 1):
            for r, d in T.Parallel(BS, K):
                km_s[BS * J + r, d] = T.cast(
                    T.cast(k_s[BS * J + r, d], f32)
                    * T.exp2(capped(sub_chunk_ref(gam_s, I, d) - gam_s[BS * J + r, d]) * LOG2E), op)
        a_f = T.alloc_fragment([2 * BS, ncols], f32)  # [Akk; Aqk] rows of block I
        T.gemm(kqp_s, km_s[0:ncols, :], a_f, transpose_B=True, clear_accum=True)
        if general:  # the own block from pw_s (its index clamped: both branches of a select are read)
            for r, j in T.Parallel(2 * BS, ncols):
                jo = T.min(T.max(j - BS * I, 0), BS - 1)
                a = T.if_then_else(j >= BS * I, pw_s[r, jo] * T.if_then_else(r < BS, T.float32(1), T.float32(scale)),
                                   a_f[r, j])
                if r < BS:
                    L_s[BS * I + r, j] = T.if_then_else(j < BS * I + r, beta_s[BS * I + r] * a, T.float32(0))
                else:
                    Aqk_out[ic, ih, BS * I + r - BS, j] = T.cast(
                        T.if_then_else(j <= BS * I + r - BS, a, T.float32(0)), dtype)
        else:
            for r, j in T.Parallel(2 * BS, ncols):
                if r < BS:
                    L_s[BS * I + r, j] = T.if_then_else(
                        j < BS * I + r, beta_s[BS * I + r] * a_f[r, j], T.float32(0))
                else:
                    Aqk_out[ic, ih, BS * I + r - BS, j] = T.cast(
                        T.if_then_else(j <= BS * I + r - BS, a_f[r, j], T.float32(0)), dtype)
        if ncols < C:
            for r, j in T.Parallel(BS, C - ncols):
                Aqk_out[ic, ih, BS * I + r, ncols + j] = T.cast(0, dtype)

    return row_block


def _intra_func(H, K, V, chunk_size, dtype, accum_dtype, scale, threads, gate_min=None, beta_scale=None,
                general=False):
    C = chunk_size
    BS = SUB
    NSUB = C // BS
    op = "bfloat16"  # operand dtype of the Akk/Aqk GEMMs
    f32 = accum_dtype
    LOG2E = 1.4426950408889634
    solve = _solve_macro(C, f32, threads)
    row_scan = row_scan_macro(C, K, threads, gate_min, GENERAL_FLOOR if general else None)
    gated = gate_min is not None
    # row blocks I < NSUB / 2 need the columns j < 16 (I + 1) <= NCH only: their MMA and masks
    # run over NCH columns (same bits, a quarter fewer MMA tiles), where that MMA still has an
    # m16n8 tile for each warp (TileLang finds no warp partition otherwise: chunk_size 32 or 16)
    NCH = BS * (NSUB // 2)
    head = NCH > 0 and (2 * BS // 16) * (NCH // 8) >= threads // 32
    row_block_head = _row_block_macro(C, K, NCH, dtype, f32, scale, general) if head else None
    row_block = _row_block_macro(C, K, C, dtype, f32, scale, general)

    Hn = T.dynamic("H") if H is None else H  # heads: runtime unless specialised
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")

    @T.macro
    def body(Q, Kx, Vx, G, Beta, Alog, Bias, Table, W_out, U_out, Qg_out, Kd_out, Aqk_out, Ec_out):
        with T.Kernel(NC, Hn, threads=threads) as (ic, ih):
            gam_s = T.alloc_shared([C, K], f32)
            k_s = T.alloc_shared([C, K], dtype)
            q_s = T.alloc_shared([C, K], dtype)
            beta_s = T.alloc_shared([C], f32)
            # rows of block I: k_i exp(gamma_i - r_I), then scale q_i exp(gamma_i - r_I): one MMA
            # for Akk and Aqk, its warps split over both rows and columns (with two A operands of
            # 16 rows each of the 8 warps loaded the whole A)
            kqp_s = T.alloc_shared([2 * BS, K], op)
            km_s = T.alloc_shared([C, K], op)  # k_j exp(r_I - gamma_j), j < BS*(I+1) (rest unread)
            pw_s = T.alloc_shared([2 * BS, BS], f32) if general else None  # own-block sums (general gate)
            # row pitch C + 8: the stores of Akk from the MMA fragment (8 rows x 4 column pairs per
            # warp) and the solve's reads of two rows at once spread over the banks (a pitch of C puts
            # the 8 rows on one bank: 8-way conflicts)
            L_s = T.alloc_shared([C, C + 8], f32)
            Ti_s = T.alloc_shared([C, C], f32)
            Td_s = T.alloc_shared([NSUB, BS, BS], f32)
            tmp_s = T.alloc_shared([BS, C], f32)
            Ti_c = T.alloc_shared([C, C], dtype)
            vb_s = T.alloc_shared([C, V], dtype)
            # W and U on their way out (16-byte rows instead of the fragment's 4-byte pieces);
            # TileLang places them over tiles dead by then
            wo_s = T.alloc_shared([C, K], dtype)
            uo_s = T.alloc_shared([C, V], dtype)
            T.annotate_layout({wo_s: tilelang.layout.make_swizzled_layout(wo_s),
                               uo_s: tilelang.layout.make_swizzled_layout(uo_s)})

            bos = Table[ic, 0]
            eos = Table[ic, 1]

            # ---- load (rows past the sequence end read as zero) and chunk-local cumsum ----
            # g, k and q by TMA, issued at once by one thread: the scan waits for g alone and runs
            # while k and q arrive. Rows past the tensor's end arrive as zeros; rows past eos but
            # inside the tensor (the next sequence's) are masked in the scan (g) and zeroed below
            # (k, q; a branch only the chunks that end a sequence early take). This spares the
            # per-row predicates and address arithmetic of per-thread loads, and the scan need
            # not wait for k and q. TMA needs 16-byte aligned tensors (chunk_kda_fwd checks).
            # Gated (gate_min set): G is the gate's pre-activation z in q's dtype and the scan
            # computes g = gate_min * sigmoid(exp(A_log) (z + dt_bias)) as it loads, so the fp32
            # g never exists in memory; Beta is then beta's pre-activation (beta_scale * sigmoid).
            bar_g = T.alloc_barrier(1)
            bar_kq = T.alloc_barrier(1)
            if gated:  # z (bf16) lands in km_s, dead until the row blocks (a tile of its own costs the second block per SM)
                T.tma_copy(G[bos : bos + C, ih, :], km_s, barrier=bar_g)
            else:
                T.tma_copy(G[bos : bos + C, ih, :], gam_s, barrier=bar_g)
            T.tma_copy(Kx[bos : bos + C, ih, :], k_s, barrier=bar_kq)
            T.tma_copy(Q[bos : bos + C, ih, :], q_s, barrier=bar_kq)
            if T.get_thread_binding() == 0:
                T.mbarrier_arrive(bar_g)
                T.mbarrier_arrive(bar_kq)
            for i in T.Parallel(C):
                if beta_scale is None:
                    beta_s[i] = T.if_then_else(bos + i < eos, Beta[bos + i, ih], T.float32(0))
                else:
                    beta_s[i] = T.if_then_else(
                        bos + i < eos,
                        T.float32(beta_scale) / (T.float32(1) + T.exp2(-Beta[bos + i, ih] * LOG2E)), T.float32(0))
            T.mbarrier_wait_parity(bar_g, 0)
            if gated:
                a_l = T.alloc_local([1], f32)
                a_l[0] = T.exp2(Alog[ih] * LOG2E)
                row_scan(gam_s, bos, eos, km_s, a_l[0], Bias, ih)
            else:
                row_scan(gam_s, bos, eos)
            T.mbarrier_wait_parity(bar_kq, 0)
            if eos - bos < C:
                for i, d in T.Parallel(C, K):
                    if bos + i >= eos:
                        k_s[i, d] = T.cast(0, dtype)
                        q_s[i, d] = T.cast(0, dtype)

            # ---- Akk, Aqk by row block I, through the reference r_I = gamma[BS*I - 1] ----
            # two loops in the generated code (not unrolled: smaller code), the first half of the
            # row blocks over the first NCH columns of km, the others over all C. Row block I writes
            # km's rows j < BS*(I+1); the rows past them are not initialised: they only reach the
            # MMA's columns j >= BS*(I+1), past every row of the block, which the masks drop (a
            # select, so even a NaN there stays out of L and Aqk)
            if head:
                for I in T.serial(NSUB // 2):  # the first half: their columns j < NCH only
                    row_block_head(I, gam_s, k_s, q_s, beta_s, kqp_s, km_s, L_s, Qg_out, Kd_out, Aqk_out, ic, ih,
                                   pw_s)
                for I in T.serial(NSUB - NSUB // 2):
                    row_block(I + NSUB // 2, gam_s, k_s, q_s, beta_s, kqp_s, km_s, L_s, Qg_out, Kd_out,
                              Aqk_out, ic, ih, pw_s)
            else:
                for I in T.serial(NSUB):
                    row_block(I, gam_s, k_s, q_s, beta_s, kqp_s, km_s, L_s, Qg_out, Kd_out, Aqk_out, ic, ih, pw_s)

            # ---- eC now (k and gamma die here); v by TMA, in flight during the solve (issued
            # only now: its tile lies over the row blocks' dead ones, which keeps two blocks per
            # SM; loaded from the start it would not fit) ----
            for d in T.Parallel(K):
                Ec_out[ic, ih, d] = T.exp2(gam_s[C - 1, d] * LOG2E)
            bar_v = T.alloc_barrier(1)
            T.tma_copy(Vx[bos : bos + C, ih, :], vb_s, barrier=bar_v)
            if T.get_thread_binding() == 0:
                T.mbarrier_arrive(bar_v)

            # ---- Tinv = (I + L)^-1 in fp32 ----
            solve(L_s, Ti_s, Td_s, tmp_s)

            # ---- W = Tinv (beta k e^gamma), U = Tinv (beta v) ----
            T.copy(Ti_s, Ti_c)
            T.mbarrier_wait_parity(bar_v, 0)
            for i, d in T.Parallel(C, V):  # beta v in place; rows past eos (another sequence's) zero
                vb_s[i, d] = T.cast(
                    T.if_then_else(bos + i < eos, beta_s[i] * T.cast(vb_s[i, d], f32), T.float32(0)), dtype)
            w_f = T.alloc_fragment([C, K], f32)
            u_f = T.alloc_fragment([C, V], f32)
            T.gemm(Ti_c, q_s, w_f, clear_accum=True)  # q_s holds beta k e^gamma by now
            T.copy(w_f, wo_s)
            T.copy(wo_s, W_out[ic, ih, :, :])
            T.gemm(Ti_c, vb_s, u_f, clear_accum=True)
            T.copy(u_f, uo_s)
            T.copy(uo_s, U_out[ic, ih, :, :])

    if gated:
        @T.prim_func
        def kda_intra_fwd_gated(
            Q: T.Tensor([TT, Hn, K], dtype),
            Kx: T.Tensor([TT, Hn, K], dtype),
            Vx: T.Tensor([TT, Hn, V], dtype),
            Z: T.Tensor([TT, Hn, K], dtype),
            Beta: T.Tensor([TT, Hn], f32),
            Alog: T.Tensor([Hn], f32),
            Bias: T.Tensor([Hn, K], f32),
            Table: T.Tensor([NC, 2], "int32"),
            W_out: T.Tensor([NC, Hn, C, K], dtype),
            U_out: T.Tensor([NC, Hn, C, V], dtype),
            Qg_out: T.Tensor([NC, Hn, C, K], dtype),
            Kd_out: T.Tensor([NC, Hn, C, K], dtype),
            Aqk_out: T.Tensor([NC, Hn, C, C], dtype),
            Ec_out: T.Tensor([NC, Hn, K], f32),
        ):
            body(Q, Kx, Vx, Z, Beta, Alog, Bias, Table, W_out, U_out, Qg_out, Kd_out, Aqk_out, Ec_out)

        return kda_intra_fwd_gated

    @T.prim_func
    def kda_intra_fwd(
        Q: T.Tensor([TT, Hn, K], dtype),
        Kx: T.Tensor([TT, Hn, K], dtype),
        Vx: T.Tensor([TT, Hn, V], dtype),
        G: T.Tensor([TT, Hn, K], f32),
        Beta: T.Tensor([TT, Hn], f32),
        Table: T.Tensor([NC, 2], "int32"),
        W_out: T.Tensor([NC, Hn, C, K], dtype),
        U_out: T.Tensor([NC, Hn, C, V], dtype),
        Qg_out: T.Tensor([NC, Hn, C, K], dtype),
        Kd_out: T.Tensor([NC, Hn, C, K], dtype),
        Aqk_out: T.Tensor([NC, Hn, C, C], dtype),
        Ec_out: T.Tensor([NC, Hn, K], f32),
    ):
        body(Q, Kx, Vx, G, Beta, None, None, Table, W_out, U_out, Qg_out, Kd_out, Aqk_out, Ec_out)

    return kda_intra_fwd


def _intra_summary_func(H, K, V, chunk_size, dtype, accum_dtype, threads, general=False):
    """fp32-accurate variant for the summary pass: W, U, Kd^T in fp32, GEMMs as 3xTF32. general: the
    own sub-chunk blocks of Akk summed pairwise in fp32, the anchored columns j < 16 I only."""
    C = chunk_size
    BS = SUB
    NSUB = C // BS
    KMR = C
    f32 = accum_dtype
    LOG2E = 1.4426950408889634
    load_cumsum = _load_cumsum_macro(C, K, threads, general)
    solve = _solve_macro(C, f32, threads)
    pairwise = pairwise_macro(K, with_q=False) if general else None
    OWN = 0 if general else 1  # the anchored GEMM's columns: j < 16 (I + OWN)

    Hn = T.dynamic("H") if H is None else H
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")

    @T.prim_func
    def kda_intra_summary(
        Kx: T.Tensor([TT, Hn, K], dtype),
        Vx: T.Tensor([TT, Hn, V], dtype),
        G: T.Tensor([TT, Hn, K], f32),
        Beta: T.Tensor([TT, Hn], f32),
        Table: T.Tensor([NC, 2], "int32"),
        W_out: T.Tensor([NC, Hn, C, K], f32),
        U_out: T.Tensor([NC, Hn, C, V], f32),
        KdT_out: T.Tensor([NC, Hn, K, C], f32),
        Ec_out: T.Tensor([NC, Hn, K], f32),
    ):
        with T.Kernel(NC, Hn, threads=threads) as (ic, ih):
            gam_s = T.alloc_shared([C, K], f32)
            k_s = T.alloc_shared([C, K], dtype)
            beta_s = T.alloc_shared([C], f32)
            kph_s = T.alloc_shared([BS, K], f32)
            kpl_s = T.alloc_shared([BS, K], f32)
            kmh_s = T.alloc_shared([KMR, K], f32)
            kml_s = T.alloc_shared([KMR, K], f32)
            L_s = T.alloc_shared([C, C], f32)
            Ti_s = T.alloc_shared([C, C], f32)
            Td_s = T.alloc_shared([NSUB, BS, BS], f32)
            tmp_s = T.alloc_shared([BS, C], f32)
            tih_s = T.alloc_shared([C, C], f32)
            til_s = T.alloc_shared([C, C], f32)
            rh_s = T.alloc_shared([K, C], f32)  # right-hand side, transposed (K-major for TF32)
            rl_s = T.alloc_shared([K, C], f32)
            pw_s = T.alloc_shared([BS, BS], f32) if general else None

            bos = Table[ic, 0]
            eos = Table[ic, 1]
            load_cumsum(G, bos, eos, ih, gam_s)
            for i, d in T.Parallel(C, K):
                k_s[i, d] = T.if_then_else(bos + i < eos, Kx[bos + i, ih, d], T.cast(0, dtype))
            for i in T.Parallel(C):
                beta_s[i] = T.if_then_else(bos + i < eos, Beta[bos + i, ih], T.float32(0))

            # ---- L = Diag(beta) StrictTril(Akk), one 3xTF32 GEMM triple per row block ----
            for I in T.serial(NSUB):  # a loop, not unrolled (see _solve_macro)
                for r, d in T.Parallel(BS, K):
                    ref = sub_chunk_ref(gam_s, I, d)
                    x = T.cast(k_s[BS * I + r, d], f32) * T.exp2((gam_s[BS * I + r, d] - ref) * LOG2E)
                    kph_s[r, d] = tf32_hi(x)
                    kpl_s[r, d] = x - tf32_hi(x)
                for j, d in T.Parallel(C, K):
                    ref = sub_chunk_ref(gam_s, I, d)
                    x = T.if_then_else(
                        j < BS * (I + OWN),
                        T.cast(k_s[j, d], f32) * T.exp2(
                            (T.min(ref - gam_s[j, d], T.float32(0)) if general else ref - gam_s[j, d]) * LOG2E),
                        T.float32(0))
                    kmh_s[j, d] = tf32_hi(x)
                    kml_s[j, d] = x - tf32_hi(x)
                akk_f = T.alloc_fragment([BS, C], f32)
                T.gemm(kph_s, kmh_s, akk_f, transpose_B=True, clear_accum=True)
                T.gemm(kph_s, kml_s, akk_f, transpose_B=True)
                T.gemm(kpl_s, kmh_s, akk_f, transpose_B=True)
                if general:
                    pairwise(I, gam_s, k_s, k_s, pw_s)
                    for r, j in T.Parallel(BS, C):
                        a = T.if_then_else(j >= BS * I, pw_s[r, T.min(T.max(j - BS * I, 0), BS - 1)], akk_f[r, j])
                        L_s[BS * I + r, j] = T.if_then_else(j < BS * I + r, beta_s[BS * I + r] * a, T.float32(0))
                else:
                    for r, j in T.Parallel(BS, C):
                        L_s[BS * I + r, j] = T.if_then_else(
                            j < BS * I + r, beta_s[BS * I + r] * akk_f[r, j], T.float32(0))

            # ---- Tinv = (I + L)^-1 in fp32 (same blocked solve as the forward) ----
            solve(L_s, Ti_s, Td_s, tmp_s)
            for i, j in T.Parallel(C, C):
                tih_s[i, j] = tf32_hi(Ti_s[i, j])
                til_s[i, j] = Ti_s[i, j] - tf32_hi(Ti_s[i, j])

            # ---- W = Tinv (beta k e^gamma) ----
            for d, i in T.Parallel(K, C):
                x = beta_s[i] * T.cast(k_s[i, d], f32) * T.exp2(gam_s[i, d] * LOG2E)
                rh_s[d, i] = tf32_hi(x)
                rl_s[d, i] = x - tf32_hi(x)
            w_f = T.alloc_fragment([C, K], f32)
            T.gemm(tih_s, rh_s, w_f, transpose_B=True, clear_accum=True)
            T.gemm(tih_s, rl_s, w_f, transpose_B=True)
            T.gemm(til_s, rh_s, w_f, transpose_B=True)
            T.copy(w_f, W_out[ic, ih, :, :])
            # ---- U = Tinv (beta v) ----
            for d, i in T.Parallel(V, C):
                vv = T.if_then_else(bos + i < eos, Vx[bos + i, ih, d], T.cast(0, dtype))
                x = beta_s[i] * T.cast(vv, f32)
                rh_s[d, i] = tf32_hi(x)
                rl_s[d, i] = x - tf32_hi(x)
            u_f = T.alloc_fragment([C, V], f32)
            T.gemm(tih_s, rh_s, u_f, transpose_B=True, clear_accum=True)
            T.gemm(tih_s, rl_s, u_f, transpose_B=True)
            T.gemm(til_s, rh_s, u_f, transpose_B=True)
            T.copy(u_f, U_out[ic, ih, :, :])
            # ---- Kd^T, eC ----
            for d, i in T.Parallel(K, C):
                KdT_out[ic, ih, d, i] = (
                    T.cast(k_s[i, d], f32) * T.exp2((gam_s[C - 1, d] - gam_s[i, d]) * LOG2E))
            for d in T.Parallel(K):
                Ec_out[ic, ih, d] = T.exp2(gam_s[C - 1, d] * LOG2E)

    return kda_intra_summary


@functools.lru_cache(maxsize=None)
def build_intra_summary_kernel(H, K, V, chunk_size, dtype, accum_dtype="float32", *,
                               block_k=None, block_v=None, threads=128, num_stages=1, general=False):
    """Compile the fp32-accurate chunk-local kernel used by the summary pass (T dynamic).

    Same math as :func:`build_intra_kernel` without the Q terms; every GEMM is 3xTF32 and the
    outputs are fp32: kernel(k[TT,H,K], v[TT,H,V], g[TT,H,K] f32, beta[TT,H] f32, table[NC,2] i32,
    W[NC,H,C,K] f32, U[NC,H,C,V] f32, KdT[NC,H,K,C] f32, eC[NC,H,K] f32). threads: a multiple of
    K and 16 times a divisor of 16 (ValueError otherwise). general: any g <= 0, as
    :func:`build_intra_kernel`'s.
    """
    if chunk_size % SUB or accum_dtype != "float32":
        raise ValueError(f"chunk_size must be a multiple of {SUB} and accum_dtype float32, got "
                         f"{chunk_size}, {accum_dtype}")
    func = _intra_summary_func(H, K, V, chunk_size, tl_dtype(dtype), accum_dtype, threads, bool(general))
    return compile_kernel(func, name="kda_intra_summary")


def _decay_func(H, K, C, dtype, f32, scale, general=False):
    load_cumsum = _load_cumsum_macro(C, K, K, general)  # the kernel's K threads
    LOG2E = 1.4426950408889634
    Hn = T.dynamic("H") if H is None else H
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")

    @T.prim_func
    def kda_decay_fwd(
        Q: T.Tensor([TT, Hn, K], dtype),
        Kx: T.Tensor([TT, Hn, K], dtype),
        G: T.Tensor([TT, Hn, K], f32),
        Table: T.Tensor([NC, 2], "int32"),
        Qg_out: T.Tensor([NC, Hn, C, K], dtype),
        Kd_out: T.Tensor([NC, Hn, C, K], dtype),
    ):
        with T.Kernel(NC, Hn, threads=K) as (ic, ih):
            bos = Table[ic, 0]
            eos = Table[ic, 1]
            gam_s = T.alloc_shared([C, K], f32)
            load_cumsum(G, bos, eos, ih, gam_s)  # kda_intra_fwd's gate scan
            # the same expressions as kda_intra_fwd's, so the values are bitwise the same
            for i, d in T.Parallel(C, K):
                qv = T.if_then_else(bos + i < eos, Q[bos + i, ih, d], T.cast(0, dtype))
                kv = T.if_then_else(bos + i < eos, Kx[bos + i, ih, d], T.cast(0, dtype))
                Qg_out[ic, ih, i, d] = T.cast(T.cast(qv, f32) * scale * T.exp2(gam_s[i, d] * LOG2E), dtype)
                Kd_out[ic, ih, i, d] = T.cast(
                    T.cast(kv, f32) * T.exp2((gam_s[C - 1, d] - gam_s[i, d]) * LOG2E), dtype)

    return kda_decay_fwd


@functools.lru_cache(maxsize=None)
def build_decay_kernel(H, K, chunk_size, dtype, accum_dtype="float32", *, scale, general=False):
    """Compile the decayed-q/k kernel: Qg and Kd of :func:`build_intra_kernel` alone (T dynamic).

    The backward's state walks need Qg = scale * q * exp(gamma) and Kd = k * exp(gamma_last -
    gamma) per chunk; the forward keeps W, U, Aqk, eC for the backward but not these two, which
    this kernel remakes from q, k, g (a gate cumsum and elementwise work, no GEMM), bitwise equal
    to the chunk-local kernel's.

    Args: as :func:`build_intra_kernel` (H None: runtime heads; general: its gate floor). Returns kernel(q[TT,H,K],
    k[TT,H,K], g[TT,H,K] f32, table[NC,2] i32, Qg[NC,H,C,K], Kd[NC,H,C,K]); the last two are
    written (rows past a sequence end as zeros).
    """
    if chunk_size % SUB or accum_dtype != "float32":
        raise ValueError(f"chunk_size must be a multiple of {SUB} and accum_dtype float32, got "
                         f"{chunk_size}, {accum_dtype}")
    func = _decay_func(H, K, chunk_size, tl_dtype(dtype), accum_dtype, float(scale), bool(general))
    return compile_kernel(func, name="kda_decay_fwd", fast_math=True)


@functools.lru_cache(maxsize=None)
def build_intra_kernel(H, K, V, chunk_size, dtype, accum_dtype="float32", *, scale,
                       block_k=None, block_v=None, threads=256, num_stages=1, gate_min=None, beta_scale=None,
                       general=False):
    """Compile the chunk-local kernel for one static configuration (T is dynamic).

    Args:
        H: heads; None (the default use) makes it a runtime value like T, an int specialises.
        K, V: key dim, value dim (static).
        chunk_size: C, a multiple of 16 (64 is the tuned value).
        dtype: q/k/v dtype ("bfloat16" or "float16"); accum_dtype must be "float32".
        scale: the output scale folded into Qg and Aqk (static; part of the cache key).
        threads: per block, a multiple of K and 16 times a divisor of 16 (ValueError
            otherwise); 256, the tuned value: two warpgroups need fewer registers per thread,
            so two blocks share an SM (docs/kernels.md).
        block_k, block_v, num_stages: unused here (whole K and V per block); kept for the
            common factory signature.
        gate_min: None, or the gate's bound in [-5, 0) (bf16 only): the kernel then takes the gate's
            pre-activation z [TT,H,K] in bf16 in g's place and two more inputs after beta,
            A_log [H] f32 and dt_bias [H,K] f32, and applies g = gate_min * sigmoid(exp(A_log)
            (z + dt_bias)) as it loads (fp32 g is never written).
        beta_scale: None (beta is beta), or with gate_min: beta holds the pre-activation and the
            kernel uses beta_scale * sigmoid(beta) (1, or 2 for negative eigenvalues).
        general: the general gate, any g <= 0 (no declared bound; not with gate_min): each step
            floored at GENERAL_FLOOR, the own sub-chunk blocks summed pairwise.
    Returns:
        a compiled kernel taking (q[TT,H,K], k[TT,H,K], v[TT,H,V], g[TT,H,K] f32, beta[TT,H] f32,
        [A_log[H], dt_bias[H,K] when gated,] table[NC,2] i32, W[NC,H,C,K], U[NC,H,C,V],
        Qg[NC,H,C,K], Kd[NC,H,C,K], Aqk[NC,H,C,C], eC[NC,H,K] f32); the last six are written. q,
        k, v and g are read by TMA: their data pointers must be 16-byte aligned (chunk_kda_fwd
        checks; TMA descriptors cannot be made otherwise).
    """
    if chunk_size % SUB or accum_dtype != "float32":
        raise ValueError(f"chunk_size must be a multiple of {SUB} and accum_dtype float32, got "
                         f"{chunk_size}, {accum_dtype}")
    if gate_min is None and beta_scale is not None:
        raise ValueError("beta_scale (beta's sigmoid in the kernel) is only built with the gate (gate_min)")
    if gate_min is not None and not -5.0 <= gate_min < 0.0:
        raise ValueError(f"gate_min must lie in [-5, 0), got {gate_min}")
    if gate_min is not None and tl_dtype(dtype) != "bfloat16":
        raise ValueError(f"the gate inside the kernel is built for bf16 inputs, got {dtype}")
    if general and gate_min is not None:
        raise ValueError("general (any g <= 0) and gate_min (the bounded gate inside the kernel) exclude each other")
    func = _intra_func(H, K, V, chunk_size, tl_dtype(dtype), accum_dtype, float(scale), threads,
                       None if gate_min is None else float(gate_min),
                       None if beta_scale is None else float(beta_scale), bool(general))
    return compile_kernel(func, name="kda_intra_fwd", fast_math=True)
