"""Backward chunk-local stage: dq, dk, dv, dg, dbeta from the chunk-start states and their gradients.

Three chunk-parallel kernels, one thread block per (chunk, head) ("dk": per (chunk, head, 64 key
channels), since it is independent per channel), each sized to fit two blocks per SM (<= ~101 KiB
of shared memory; each capped at 128 registers per thread: "dv" and "ut" at 256 threads, "dk");
the math and the order are those
of tests/_bwd_mirror.py (its docstring is the full derivation). Per chunk, with
q~ = scale * q, gamma = chunk-local cumsum of g, Gamma = exp(gamma), S = state entering the chunk
and dS' = gradient of the state leaving it (both from bwd_state.py):

kernel "dv"   (build_bwd_dv_kernel; reads W, U, Kd, Aqk of the forward's intra kernel)
    V' = U - W S,  dV' = Aqk^T dO + Kd dS',  dU = dV',  dW = -dV' S^T
    dAqk = Tril(dO V'^T),  dQg = dO S^T,  dKd = V' dS'^T,  deC_d = sum_v S_dv dS'_dv

kernel "ut"   (build_bwd_ut_kernel: the UT transform's backward)
    B = StrictTril decayed K K^T,  X = (I + Diag(beta) B)^-1          (recomputed, fp32 solve)
    dKb = X^T dW,  dVb = X^T dU,  dA = -StrictTril(dKb W^T + dVb U^T)
    dv = beta * dVb,  dbeta_i = <dKb_i, Gamma_i k_i> + <dVb_i, v_i> + sum_j dA_ij B_ij
    dB = Diag(beta) dA,  dGk = beta * dKb                              (gradient of Gamma * k)

kernel "dk"   (build_bwd_dk_kernel: the decayed products' backward and the assembly)
    row side    dx_i += exp(gamma_i - s_J) * sum_{j in J} dM_ij k_j exp(s_J - gamma_j)   per column sub-chunk J
    column side dk_j += exp(r_I - gamma_j) * sum_{i in I} dM_ij x_i exp(gamma_i - r_I)   per row sub-chunk I
        for (x, dM) = (q~, dAqk) and (k, dB); r_I = gamma[16 I - 1] (0 for I = 0), s_J = gamma[16 J + 15];
        each sum is one [C, 16] x [16, 64 channels] wgmma (M = the chunk's 64 tokens), the factor
        outside it an fp32 multiply on the accumulator
    dq = scale (Gamma dQg + dx(Aqk))
    dk = Gamma dGk + exp(gamma_C - gamma) dKd + dx(B) + dk(B) + dk(Aqk)
    dgamma = q~ dq~ + k (Gamma dGk + dx(B) - dk(B) - dk(Aqk)) - Kd dKd,
    dgamma_C += sum_i Kd_i dKd_i + eC deC;   dg = reverse cumsum of dgamma over the chunk

Numerics: cumsums, exponentials, the triangular solve and every elementwise combination in fp32;
GEMM operands in the input dtype with fp32 accumulation, except in two places. The forward
recompute of B in "ut" takes bf16 operands (its factors reach exp(75), beyond fp16), as the forward
does. The decayed products' backward in "dk" needs its factor tables to about 16 bits: dM (bf16)
times each table split into two bf16 pieces, hi + lo, both through bf16 MMAs, then the fp32 factor
outside the sum applied to the fp32 accumulator. dg is a reverse cumsum
of dgamma, in which the row-side and column-side terms of every pair (i, j) cancel except for the
pairs that straddle the position; with one bf16 piece the uncancelled rounding alone gives dg a
relative RMS error of ~6e-2 (the fp64 mirror reproduces it), with two ~1.6e-3, the level of
dM's own bf16 rounding (tests/_bwd_mirror.py ``dk_pieces``; as accurate as 2xTF32 there). Rows past a sequence end are read as zero and never written. Between
kernels dAqk, dB, dQg, dKd, dGk are stored in bf16 (fp32 range, also for fp16 input), and "ut"
keeps Gamma * k for dbeta in the input dtype: the fp64 mirror with these roundings moves dq, dk,
dg by <= 4e-4 and dbeta by <= 2e-5 relative.

Every loop over the four 16-row sub-chunks is a loop in the generated code, not unrolled: fully
unrolled, the kernels stall on instruction fetch. "dk" is bound by shared-memory bandwidth
(Nsight Compute: L1 at ~80% of peak), so its [token, channel] tiles have a row pitch that keeps
the accumulator-layout reads free of bank conflicts, and its gate cumsum and closing reverse
cumsum run on every thread in parts of 16 rows (_common.row_scan_macro), so that no warp waits at
a barrier for a per-channel scan.
"""
import functools

import tilelang.language as T

from ._common import (GENERAL_FLOOR, SUB, block_rows_macro, compile_kernel, pairwise_macro, row_scan_macro,
                      sub_chunk_ref, tl_dtype)

LOG2E = 1.4426950408889634
MID = "bfloat16"  # dtype of the fp32-accumulated intermediates dAqk, dB, dQg, dKd, dGk between kernels


def _bwd_dv_func(H, K, V, C, dtype, f32, threads):
    PT = threads // K  # threads per row of deC's sum
    VP = V // PT  # columns each of them adds
    if threads % K or V % PT:
        raise ValueError(f"threads must be a multiple of K dividing K * V, got threads={threads}, K={K}, V={V}")
    Hn = T.dynamic("H") if H is None else H
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")

    @T.prim_func
    def kda_bwd_dv(
        W: T.Tensor([NC, Hn, C, K], dtype),
        U: T.Tensor([NC, Hn, C, V], dtype),
        Kd: T.Tensor([NC, Hn, C, K], dtype),
        Aqk: T.Tensor([NC, Hn, C, C], dtype),
        Hs: T.Tensor([NC, Hn, K, V], dtype),
        DHs: T.Tensor([NC, Hn, K, V], dtype),
        DO: T.Tensor([TT, Hn, V], dtype),
        Table: T.Tensor([NC, 2], "int32"),
        DAqk: T.Tensor([NC, Hn, C, C], MID),
        DQg: T.Tensor([NC, Hn, C, K], MID),
        DKd: T.Tensor([NC, Hn, C, K], MID),
        DEc: T.Tensor([NC, Hn, K], f32),
        DW: T.Tensor([NC, Hn, C, K], dtype),
        DU: T.Tensor([NC, Hn, C, V], dtype),
    ):
        with T.Kernel(NC, Hn, threads=threads) as (ic, ih):
            if threads == 256:  # two blocks per SM: at most 128 registers per thread
                T.annotate_min_blocks_per_sm(2)
            bos = Table[ic, 0]
            eos = Table[ic, 1]
            tx = T.get_thread_binding()
            dec_s = T.alloc_shared([PT, K], f32)
            S_s = T.alloc_shared([K, V], dtype)
            dS_s = T.alloc_shared([K, V], dtype)
            do_s = T.alloc_shared([C, V], dtype)
            w_s = T.alloc_shared([C, K], dtype)
            kd_s = T.alloc_shared([C, K], dtype)
            u_s = T.alloc_shared([C, V], dtype)
            aqk_s = T.alloc_shared([C, C], dtype)
            vn_s = T.alloc_shared([C, V], dtype)
            dvn_s = T.alloc_shared([C, V], dtype)
            cv_f = T.alloc_fragment([C, V], f32)
            ck_f = T.alloc_fragment([C, K], f32)
            cc_f = T.alloc_fragment([C, C], f32)

            # Operands are loaded just before their first use and the products ordered so that
            # few tiles are live at once (~96 KB of shared memory: two blocks per SM).
            # V' = U - W S
            T.copy(Hs[ic, ih, :, :], S_s)
            T.copy(W[ic, ih, :, :], w_s)
            T.copy(U[ic, ih, :, :], u_s)
            T.gemm(w_s, S_s, cv_f, clear_accum=True)
            for i, j in T.Parallel(C, V):
                cv_f[i, j] = T.cast(u_s[i, j], f32) - cv_f[i, j]
            T.copy(cv_f, vn_s)
            # dAqk = Tril(dO V'^T)
            for i, j in T.Parallel(C, V):
                do_s[i, j] = T.if_then_else(bos + i < eos, DO[bos + i, ih, j], T.cast(0, dtype))
            T.gemm(do_s, vn_s, cc_f, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                cc_f[i, j] = T.if_then_else(j <= i, cc_f[i, j], T.float32(0))
            T.copy(cc_f, DAqk[ic, ih, :, :])
            # dQg = dO S^T
            T.gemm(do_s, S_s, ck_f, transpose_B=True, clear_accum=True)
            T.copy(ck_f, DQg[ic, ih, :, :])
            # dKd = V' dS'^T
            T.copy(DHs[ic, ih, :, :], dS_s)
            T.gemm(vn_s, dS_s, ck_f, transpose_B=True, clear_accum=True)
            T.copy(ck_f, DKd[ic, ih, :, :])
            # deC = rowsum(S * dS'): thread t sums row t % K over the t // K-th of PT column parts
            # (independent loads, unrolled), then the parts are added in order (one thread per row
            # over all V columns left the other threads waiting)
            d = tx % K
            p = tx // K
            acc = T.alloc_local([1], f32)
            acc[0] = T.float32(0)
            for j in T.unroll(VP):
                acc[0] += T.cast(S_s[d, p * VP + j], f32) * T.cast(dS_s[d, p * VP + j], f32)
            dec_s[p, d] = acc[0]
            T.sync_threads()
            if tx < K:
                tot = dec_s[0, tx]
                for pp in tuple(range(1, PT)):
                    tot = tot + dec_s[pp, tx]
                DEc[ic, ih, tx] = tot
            # dV' = Kd dS' + Aqk^T dO  (= dU)
            T.copy(Kd[ic, ih, :, :], kd_s)
            T.gemm(kd_s, dS_s, cv_f, clear_accum=True)
            T.copy(Aqk[ic, ih, :, :], aqk_s)
            T.gemm(aqk_s, do_s, cv_f, transpose_A=True)
            T.copy(cv_f, dvn_s)
            T.copy(cv_f, DU[ic, ih, :, :])
            # dW = -dV' S^T
            T.gemm(dvn_s, S_s, ck_f, transpose_B=True, clear_accum=True)
            for i, d in T.Parallel(C, K):
                ck_f[i, d] = -ck_f[i, d]
            T.copy(ck_f, DW[ic, ih, :, :])

    return kda_bwd_dv


def _bwd_ut_func(H, K, V, C, dtype, f32, threads, general=False):
    row_scan = row_scan_macro(C, K, threads, floor=GENERAL_FLOOR if general else None)
    pairwise = pairwise_macro(K, with_q=False) if general else None
    OWN = 0 if general else 1  # the anchored GEMM's columns: j < 16 (I + OWN)
    BS = SUB
    NSUB = C // BS
    R16 = tuple(range(BS))
    op = "bfloat16"  # decayed-product operands: factors up to exp(75) do not fit fp16
    block_rows = block_rows_macro(C, threads, beta_scaled=True)
    Hn = T.dynamic("H") if H is None else H
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")

    @T.prim_func
    def kda_bwd_ut(
        Kx: T.Tensor([TT, Hn, K], dtype),
        Vx: T.Tensor([TT, Hn, V], dtype),
        G: T.Tensor([TT, Hn, K], f32),
        Beta: T.Tensor([TT, Hn], f32),
        Table: T.Tensor([NC, 2], "int32"),
        W: T.Tensor([NC, Hn, C, K], dtype),
        U: T.Tensor([NC, Hn, C, V], dtype),
        DW: T.Tensor([NC, Hn, C, K], dtype),
        DU: T.Tensor([NC, Hn, C, V], dtype),
        DV: T.Tensor([TT, Hn, V], dtype),
        DBeta: T.Tensor([TT, Hn], f32),
        DB: T.Tensor([NC, Hn, C, C], MID),
        DGk: T.Tensor([NC, Hn, C, K], MID),
    ):
        with T.Kernel(NC, Hn, threads=threads) as (ic, ih):
            if threads == 256:  # two blocks per SM: at most 128 registers per thread
                T.annotate_min_blocks_per_sm(2)
            bos = Table[ic, 0]
            eos = Table[ic, 1]
            gam_s = T.alloc_shared([C, K], f32)
            k_s = T.alloc_shared([C, K], dtype)
            gk_s = T.alloc_shared([C, K], dtype)
            beta_s = T.alloc_shared([C], f32)
            kp_s = T.alloc_shared([BS, K], op)
            km_s = T.alloc_shared([C, K], op)
            B_s = T.alloc_shared([C, C], f32)  # unpadded: a row pitch of C + 8 measures slower here
            X_s = T.alloc_shared([C, C], f32)
            Xc_s = T.alloc_shared([C, C], dtype)
            Td_s = T.alloc_shared([NSUB, BS, BS], f32)
            tmp_s = T.alloc_shared([BS, C], f32)
            dw_s = T.alloc_shared([C, K], dtype)
            du_s = T.alloc_shared([C, V], dtype)
            w_s = T.alloc_shared([C, K], dtype)
            u_s = T.alloc_shared([C, V], dtype)
            dkb_s = T.alloc_shared([C, K], dtype)
            dvb_s = T.alloc_shared([C, V], dtype)
            db_s = T.alloc_shared([C], f32)
            bk_f = T.alloc_fragment([BS, C], f32)
            dkb_f = T.alloc_fragment([C, K], f32)
            dvb_f = T.alloc_fragment([C, V], f32)
            da_f = T.alloc_fragment([C, C], f32)
            r1_f = T.alloc_fragment([C], f32)
            r2_f = T.alloc_fragment([C], f32)
            r3_f = T.alloc_fragment([C], f32)
            pw_s = T.alloc_shared([BS, BS], f32) if general else None  # own-block sums (general gate)

            # g and k by TMA (as in the forward's chunk-local kernel): the scan waits for g alone;
            # rows past the tensor's end arrive as zeros, rows past eos inside it (the next packed
            # sequence's) are masked in the scan (g) and zeroed here (k). Each later group of tiles
            # comes by TMA too, at its first use ("dv" keeps per-thread loads: by TMA they measure
            # no faster there)
            bg = T.alloc_barrier(1)
            T.tma_copy(G[bos : bos + C, ih, :], gam_s, barrier=bg)
            bk = T.alloc_barrier(1)
            T.tma_copy(Kx[bos : bos + C, ih, :], k_s, barrier=bk)
            if T.get_thread_binding() == 0:
                T.mbarrier_arrive(bg)
                T.mbarrier_arrive(bk)
            for i in T.Parallel(C):
                beta_s[i] = T.if_then_else(bos + i < eos, Beta[bos + i, ih], T.float32(0))
            T.mbarrier_wait_parity(bg, 0)
            row_scan(gam_s, bos, eos)  # chunk-local cumsum (rows past eos taken as 0)
            T.mbarrier_wait_parity(bk, 0)
            if eos - bos < C:
                for i, d in T.Parallel(C, K):
                    if bos + i >= eos:
                        k_s[i, d] = T.cast(0, dtype)

            # ---- B (strict decayed K K^T), one [16, C] GEMM per row block ----
            for I in T.serial(NSUB):  # a loop, not unrolled: smaller code
                for r, d in T.Parallel(BS, K):
                    ref = sub_chunk_ref(gam_s, I, d)
                    kp_s[r, d] = T.cast(
                        T.cast(k_s[BS * I + r, d], f32) * T.exp2((gam_s[BS * I + r, d] - ref) * LOG2E), op)
                for j, d in T.Parallel(C, K):
                    if j < BS * (I + OWN):  # a branch, not a select: no exponentials for the zero rows
                        x = sub_chunk_ref(gam_s, I, d) - gam_s[j, d]
                        km_s[j, d] = T.cast(T.cast(k_s[j, d], f32)
                                            * T.exp2((T.min(x, T.float32(0)) if general else x) * LOG2E), op)
                    else:
                        km_s[j, d] = T.cast(0, op)
                T.gemm(kp_s, km_s, bk_f, transpose_B=True, clear_accum=True)
                if general:  # the own block summed pairwise (_common.pairwise_macro), index clamped
                    pairwise(I, gam_s, k_s, k_s, pw_s)
                    for r, j in T.Parallel(BS, C):
                        b = T.if_then_else(j >= BS * I, pw_s[r, T.min(T.max(j - BS * I, 0), BS - 1)], bk_f[r, j])
                        B_s[BS * I + r, j] = T.if_then_else(j < BS * I + r, b, T.float32(0))
                else:
                    for r, j in T.Parallel(BS, C):
                        B_s[BS * I + r, j] = T.if_then_else(j < BS * I + r, bk_f[r, j], T.float32(0))
            # Gamma * k for dbeta, in the input dtype: gamma and k are not needed after this
            for i, d in T.Parallel(C, K):
                gk_s[i, d] = T.cast(T.cast(k_s[i, d], f32) * T.exp2(gam_s[i, d] * LOG2E), dtype)

            # ---- X = (I + Diag(beta) B)^-1, blocked: 16 x 16 diagonal blocks by substitution in
            # registers (one thread per column), then block rows X[I, :I] = X_II (-L[I, :I] X[:I, :I])
            for i, j in T.Parallel(C, C):
                X_s[i, j] = T.float32(0)
            for I, c in T.Parallel(NSUB, BS):
                x = T.alloc_local([BS], f32)
                for r in R16:
                    acc = T.float32(0)
                    for j in R16[:r]:
                        acc = acc + B_s[BS * I + r, BS * I + j] * x[j]
                    x[r] = T.if_then_else(r == c, T.float32(1), T.float32(0)) - beta_s[BS * I + r] * acc
                for r in R16:
                    X_s[BS * I + r, BS * I + c] = x[r]
                    Td_s[I, r, c] = x[r]
            block_rows(B_s, X_s, Td_s, tmp_s, beta_s)  # A = Diag(beta) B
            T.copy(X_s, Xc_s)

            # ---- dKb = X^T dW, dVb = X^T dU (operands loaded only now: short live ranges let the
            # shared-memory planner overlap them with the phases above) ----
            b1 = T.alloc_barrier(1)
            T.tma_copy(DW[ic, ih, :, :], dw_s, barrier=b1)
            T.tma_copy(DU[ic, ih, :, :], du_s, barrier=b1)
            if T.get_thread_binding() == 0:
                T.mbarrier_arrive(b1)
            T.mbarrier_wait_parity(b1, 0)
            T.gemm(Xc_s, dw_s, dkb_f, transpose_A=True, clear_accum=True)
            T.gemm(Xc_s, du_s, dvb_f, transpose_A=True, clear_accum=True)
            T.copy(dkb_f, dkb_s)
            T.copy(dvb_f, dvb_s)
            # ---- dA = -StrictTril(dKb W^T + dVb U^T) ----
            b2 = T.alloc_barrier(1)
            T.tma_copy(W[ic, ih, :, :], w_s, barrier=b2)
            T.tma_copy(U[ic, ih, :, :], u_s, barrier=b2)
            if T.get_thread_binding() == 0:
                T.mbarrier_arrive(b2)
            T.mbarrier_wait_parity(b2, 0)
            T.gemm(dkb_s, w_s, da_f, transpose_B=True, clear_accum=True)
            T.gemm(dvb_s, u_s, da_f, transpose_B=True)
            for i, j in T.Parallel(C, C):
                da_f[i, j] = T.if_then_else(j < i, -da_f[i, j], T.float32(0))

            # ---- dv = beta dVb; dGk = beta dKb ----
            for i, j in T.Parallel(C, V):
                if bos + i < eos:
                    DV[bos + i, ih, j] = T.cast(beta_s[i] * dvb_f[i, j], dtype)
            for i, d in T.Parallel(C, K):
                DGk[ic, ih, i, d] = T.cast(beta_s[i] * dkb_f[i, d], MID)
            # ---- dbeta = <dKb, Gamma k> + <dVb, v> + <dA, B> per row ----
            for i, d in T.Parallel(C, K):
                dkb_f[i, d] = dkb_f[i, d] * T.cast(gk_s[i, d], f32)
            T.reduce_sum(dkb_f, r1_f, dim=1)
            for i, j in T.Parallel(C, V):
                dvb_f[i, j] = dvb_f[i, j] * T.if_then_else(
                    bos + i < eos, T.cast(Vx[bos + i, ih, j], f32), T.float32(0))
            T.reduce_sum(dvb_f, r2_f, dim=1)
            for i, j in T.Parallel(C, C):
                DB[ic, ih, i, j] = T.cast(beta_s[i] * da_f[i, j], MID)
            for i, j in T.Parallel(C, C):
                da_f[i, j] = da_f[i, j] * B_s[i, j]
            T.reduce_sum(da_f, r3_f, dim=1)
            for i in T.Parallel(C):
                db_s[i] = r1_f[i] + r2_f[i] + r3_f[i]
            for i in T.Parallel(C):
                if bos + i < eos:
                    DBeta[bos + i, ih] = db_s[i]

    return kda_bwd_ut


def _bwd_dk_func(H, K, C, dtype, f32, scale, threads, block_k, general=False):
    BS = SUB
    # general (any g <= 0): the anchored sums leave out the own sub-chunk (rows i >= 16 (J + 1) on
    # the row side, columns j < 16 I on the column side: every factor <= 1), whose 16 x 16 blocks
    # are then summed pair by pair with exp(min(gamma_i - gamma_j, 0)) in fp32 (tests/_bwd_mirror.py)
    OWN = 1 if general else 0
    NSUB = C // BS
    BK = block_k  # key channels per block: every step below is independent per channel
    # Row pitch of the [token, channel] tiles, fp32 and 16-bit alike: BK + 8 makes the reads of
    # channel pairs in the MMA accumulator layout (8 rows x 4 pairs per warp) bank-conflict free
    # (a pitch of BK puts all 8 rows on one bank, 8-way; an odd one bars the pairwise reads). The
    # factor-table builds, which read 16 rows x 2 channels, pay for it (gam_s up to 4-way, k and q
    # 2-way conflicts), but there are fewer of those reads.
    P = BK + 8
    row_scan = row_scan_macro(C, BK, threads, floor=GENERAL_FLOOR if general else None)
    NP = C // BS  # the closing reverse scan: parts of 16 rows (as row_scan)
    PT = threads // BK  # threads per channel
    MI = -(-NP // PT)  # parts per thread
    Hn = T.dynamic("H") if H is None else H
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")

    @T.prim_func
    def kda_bwd_dk(
        Q: T.Tensor([TT, Hn, K], dtype),
        Kx: T.Tensor([TT, Hn, K], dtype),
        G: T.Tensor([TT, Hn, K], f32),
        Table: T.Tensor([NC, 2], "int32"),
        DAqk: T.Tensor([NC, Hn, C, C], MID),
        DB: T.Tensor([NC, Hn, C, C], MID),
        DQg: T.Tensor([NC, Hn, C, K], MID),
        DKd: T.Tensor([NC, Hn, C, K], MID),
        DGk: T.Tensor([NC, Hn, C, K], MID),
        DEc: T.Tensor([NC, Hn, K], f32),
        DQ: T.Tensor([TT, Hn, K], dtype),
        DK: T.Tensor([TT, Hn, K], dtype),
        DG: T.Tensor([TT, Hn, K], f32),
    ):
        with T.Kernel(NC, Hn, K // BK, threads=threads) as (ic, ih, ik):
            # two blocks per SM (~86 KB of shared memory each): registers capped at 128 per thread
            # (uncapped, nvcc takes more and the SM runs one block, which exposes every serial phase)
            T.annotate_min_blocks_per_sm(2)
            bos = Table[ic, 0]
            eos = Table[ic, 1]
            k0 = ik * BK
            tx = T.get_thread_binding()
            gam_s = T.alloc_shared([C, P], f32)
            dgam_s = T.alloc_shared([C, P], f32)
            k_s = T.alloc_shared([C, P], dtype)
            q_s = T.alloc_shared([C, P], dtype)
            # the chunk's dAqk and dB (bf16), read once: the GEMMs' A operands, sliced per sub-chunk
            # (row side: its columns, K-major; column side: its rows, transposed)
            daq_s = T.alloc_shared([C, C], MID)
            dab_s = T.alloc_shared([C, C], MID)
            # the assembly's inputs, read once with the others
            dqg_s = T.alloc_shared([C, P], MID)
            dkd_s = T.alloc_shared([C, P], MID)
            dgk_s = T.alloc_shared([C, P], MID)
            # one sub-chunk's factor tables [channel, token], each split into two bf16 pieces
            th_s = T.alloc_shared([BK, BS], MID)
            tl_s = T.alloc_shared([BK, BS], MID)
            xqh_s = T.alloc_shared([BK, BS], MID)
            xql_s = T.alloc_shared([BK, BS], MID)
            xkh_s = T.alloc_shared([BK, BS], MID)
            xkl_s = T.alloc_shared([BK, BS], MID)
            p1_f = T.alloc_fragment([C, BK], f32)  # GEMM accumulators, [token, channel]
            p2_f = T.alloc_fragment([C, BK], f32)  # row side of B's GEMM; then dgamma's row-side terms
            dxq_f = T.alloc_fragment([C, BK], f32)  # row side of Aqk; then the column sides' sum
            dxk_f = T.alloc_fragment([C, BK], f32)  # row side of B; then dk without the column sides
            part_s = T.alloc_shared([NP, BK], f32)  # the reverse scan's part totals
            pk_s = T.alloc_shared([NP, BK], f32)  # and its parts' sums of Kd dKd
            rev = T.alloc_local([MI * BS], f32)
            pk = T.alloc_local([MI], f32)

            T.copy(DAqk[ic, ih, :, :], daq_s)
            T.copy(DB[ic, ih, :, :], dab_s)
            for i, d in T.Parallel(C, BK):
                dqg_s[i, d] = DQg[ic, ih, i, k0 + d]
                dkd_s[i, d] = DKd[ic, ih, i, k0 + d]
                dgk_s[i, d] = DGk[ic, ih, i, k0 + d]
                k_s[i, d] = T.if_then_else(bos + i < eos, Kx[bos + i, ih, k0 + d], T.cast(0, dtype))
                q_s[i, d] = T.if_then_else(bos + i < eos, Q[bos + i, ih, k0 + d], T.cast(0, dtype))
                gam_s[i, d] = T.if_then_else(bos + i < eos, G[bos + i, ih, k0 + d], T.float32(0))
            row_scan(gam_s, bos, eos)  # chunk-local cumsum

            # ---- row side, by column sub-chunk J (reference s_J = gamma[16 J + 15], its last row):
            # dx_i += exp(gamma_i - s_J) sum_{j in J} dM_ij (k_j exp(s_J - gamma_j)),  rows i >= 16 J
            T.clear(dxq_f)
            T.clear(dxk_f)
            for J in T.serial(NSUB):  # a loop, not unrolled: smaller code
                for d, j in T.Parallel(BK, BS):
                    x = T.cast(k_s[BS * J + j, d], f32) * T.exp2(
                        (gam_s[BS * J + BS - 1, d] - gam_s[BS * J + j, d]) * LOG2E)
                    xh = T.cast(x, MID)  # x = xh + xl in two bf16 pieces (16 significant bits)
                    th_s[d, j] = xh
                    tl_s[d, j] = T.cast(x - T.cast(xh, f32), MID)
                T.wgmma_gemm(daq_s[:, BS * J:BS * J + BS], th_s, p1_f, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(daq_s[:, BS * J:BS * J + BS], tl_s, p1_f, transpose_B=True)
                T.wgmma_gemm(dab_s[:, BS * J:BS * J + BS], th_s, p2_f, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(dab_s[:, BS * J:BS * J + BS], tl_s, p2_f, transpose_B=True)
                T.wait_wgmma(0)  # the four MMAs issued back to back, one wait
                T.warpgroup_fence_operand(p1_f, num_regs=C * BK // threads)  # reads of the accumulators
                T.warpgroup_fence_operand(p2_f, num_regs=C * BK // threads)  # stay after the wait
                for i, d in T.Parallel(C, BK):
                    if i >= BS * (J + OWN):  # rows before the sub-chunk: dM is zero there (and the factor unbounded)
                        s = T.exp2((gam_s[i, d] - gam_s[BS * J + BS - 1, d]) * LOG2E)
                        dxq_f[i, d] = dxq_f[i, d] + s * p1_f[i, d]
                        dxk_f[i, d] = dxk_f[i, d] + s * p2_f[i, d]
            if general:  # row side of the own blocks: dx_i += sum_{j in I} dM_ij k_j exp(gamma_i - gamma_j)
                for i, d in T.Parallel(C, BK):
                    gi = gam_s[i, d]
                    for j in range(BS):
                        jj = BS * (i // BS) + j
                        kj = T.cast(k_s[jj, d], f32) * T.exp2(T.min(gi - gam_s[jj, d], T.float32(0)) * LOG2E)
                        dxq_f[i, d] = dxq_f[i, d] + T.cast(daq_s[i, jj], f32) * kj
                        dxk_f[i, d] = dxk_f[i, d] + T.cast(dab_s[i, jj], f32) * kj

            # ---- assembly of dq and of the row-side terms of dk, dgamma (dgamma in p2_f) ----
            for i, d in T.Parallel(C, BK):
                gi = gam_s[i, d]
                Gi = T.exp2(gi * LOG2E)
                dec = T.exp2((gam_s[C - 1, d] - gi) * LOG2E)
                kv = T.cast(k_s[i, d], f32)
                qs = T.cast(q_s[i, d], f32) * scale
                dgk = Gi * T.cast(dgk_s[i, d], f32)
                dkd = T.cast(dkd_s[i, d], f32)
                dqs = Gi * T.cast(dqg_s[i, d], f32) + dxq_f[i, d]
                p2_f[i, d] = qs * dqs + kv * (dgk + dxk_f[i, d]) - kv * dec * dkd
                dxk_f[i, d] = dgk + dec * dkd + dxk_f[i, d]
                if bos + i < eos:
                    DQ[bos + i, ih, k0 + d] = T.cast(dqs * scale, dtype)

            # ---- column side, by row sub-chunk I (reference r_I = gamma[16 I - 1], 0 for I = 0):
            # dk_j += exp(r_I - gamma_j) sum_{i in I} dM_ij (x_i exp(gamma_i - r_I)),  columns j < 16 (I + 1),
            # for (x, dM) = (q~, dAqk) and (k, dB), which share the factor: one accumulator
            T.clear(dxq_f)
            for I in T.serial(NSUB):
                for d, i in T.Parallel(BK, BS):
                    e = T.exp2((gam_s[BS * I + i, d] - sub_chunk_ref(gam_s, I, d)) * LOG2E)
                    xq = T.cast(q_s[BS * I + i, d], f32) * (e * scale)
                    xk = T.cast(k_s[BS * I + i, d], f32) * e
                    xqh = T.cast(xq, MID)
                    xkh = T.cast(xk, MID)
                    xqh_s[d, i] = xqh
                    xql_s[d, i] = T.cast(xq - T.cast(xqh, f32), MID)
                    xkh_s[d, i] = xkh
                    xkl_s[d, i] = T.cast(xk - T.cast(xkh, f32), MID)
                T.wgmma_gemm(daq_s[BS * I:BS * I + BS, :], xqh_s, p1_f, transpose_A=True, transpose_B=True,
                       clear_accum=True)
                T.wgmma_gemm(daq_s[BS * I:BS * I + BS, :], xql_s, p1_f, transpose_A=True, transpose_B=True)
                T.wgmma_gemm(dab_s[BS * I:BS * I + BS, :], xkh_s, p1_f, transpose_A=True, transpose_B=True)
                T.wgmma_gemm(dab_s[BS * I:BS * I + BS, :], xkl_s, p1_f, transpose_A=True, transpose_B=True)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(p1_f, num_regs=C * BK // threads)
                for j, d in T.Parallel(C, BK):
                    if j < BS * (I + 1 - OWN):  # columns after the sub-chunk: dM is zero there
                        dxq_f[j, d] = dxq_f[j, d] + T.exp2(
                            (sub_chunk_ref(gam_s, I, d) - gam_s[j, d]) * LOG2E) * p1_f[j, d]
            if general:  # column side of the own blocks: dk_j += sum_{i in I} dM_ij x_i exp(gamma_i - gamma_j)
                for j, d in T.Parallel(C, BK):
                    gj = gam_s[j, d]
                    for i in range(BS):
                        ii = BS * (j // BS) + i
                        x = (T.cast(daq_s[ii, j], f32) * T.cast(q_s[ii, d], f32) * scale
                             + T.cast(dab_s[ii, j], f32) * T.cast(k_s[ii, d], f32))
                        dxq_f[j, d] = dxq_f[j, d] + x * T.exp2(T.min(gam_s[ii, d] - gj, T.float32(0)) * LOG2E)

            # ---- dk; dgamma = row-side terms - k (dk(B) + dk(Aqk)) ----
            for i, d in T.Parallel(C, BK):
                dgam_s[i, d] = p2_f[i, d] - T.cast(k_s[i, d], f32) * dxq_f[i, d]
                if bos + i < eos:
                    DK[bos + i, ih, k0 + d] = T.cast(dxk_f[i, d] + dxq_f[i, d], dtype)

            # ---- dg: the reverse cumsum of dgamma over the chunk, plus the terms of gamma_C
            # (sum_i Kd_i dKd_i + eC deC); as the forward scan, thread t takes channel t % BK and
            # the parts of 16 rows t // BK, t // BK + threads / BK, ...
            d = tx % BK
            for m in T.unroll(MI):
                p = tx // BK + m * PT
                if p < NP:
                    pk[m] = T.float32(0)
                    for r in T.unroll(BS):
                        i = p * BS + r
                        rev[m * BS + r] = dgam_s[i, d]
                        pk[m] = pk[m] + T.cast(k_s[i, d], f32) * T.exp2(
                            (gam_s[C - 1, d] - gam_s[i, d]) * LOG2E) * T.cast(dkd_s[i, d], f32)
                    for r in T.unroll(1, BS):
                        rev[m * BS + BS - 1 - r] = rev[m * BS + BS - r] + rev[m * BS + BS - 1 - r]
                    part_s[p, d] = rev[m * BS]
                    pk_s[p, d] = pk[m]
            T.sync_threads()
            for m in T.unroll(MI):
                p = tx // BK + m * PT
                if p < NP:
                    off = DEc[ic, ih, k0 + d] * T.exp2(gam_s[C - 1, d] * LOG2E)
                    for pp in tuple(range(NP)):
                        off = off + pk_s[pp, d]
                    for pp in tuple(range(1, NP)):  # the parts below this one, in part order
                        off = off + T.if_then_else(pp > p, part_s[pp, d], T.float32(0))
                    for r in T.unroll(BS):
                        if bos + p * BS + r < eos:
                            DG[bos + p * BS + r, ih, k0 + d] = rev[m * BS + r] + off

    return kda_bwd_dk


@functools.lru_cache(maxsize=None)
def build_bwd_dv_kernel(H, K, V, chunk_size, dtype, accum_dtype="float32", *, block_k=None,
                        block_v=None, threads=256, num_stages=1):
    """Compile kernel "dv" (T, chunks, H dynamic).

    Returns kernel(W[NC,H,C,K], U[NC,H,C,V], Kd[NC,H,C,K], Aqk[NC,H,C,C], Hs[NC,H,K,V],
    dHs[NC,H,K,V], dO[TT,H,V], table[NC,2] i32, dAqk[NC,H,C,C] bf16, dQg[NC,H,C,K] bf16,
    dKd[NC,H,C,K] bf16, deC[NC,H,K] f32, dW[NC,H,C,K], dU[NC,H,C,V]); the last six are written.
    Tensors without a dtype are in ``dtype``. block_k, block_v, num_stages: unused (whole K, V).
    threads: 256 (two blocks per SM) or 128; a multiple of K dividing K * V (ValueError otherwise).
    """
    if accum_dtype != "float32":
        raise ValueError(f"accum_dtype must be float32, got {accum_dtype}")
    return compile_kernel(_bwd_dv_func(H, K, V, chunk_size, tl_dtype(dtype), accum_dtype, threads),
                          name="kda_bwd_dv")


@functools.lru_cache(maxsize=None)
def build_bwd_ut_kernel(H, K, V, chunk_size, dtype, accum_dtype="float32", *, block_k=None,
                        block_v=None, threads=256, num_stages=1, general=False):
    """Compile kernel "ut", the UT transform's backward (T, chunks, H dynamic).

    Returns kernel(k[TT,H,K], v[TT,H,V], g[TT,H,K] f32, beta[TT,H] f32, table[NC,2] i32,
    W[NC,H,C,K], U[NC,H,C,V], dW[NC,H,C,K], dU[NC,H,C,V], dv[TT,H,V], dbeta[TT,H] f32,
    dB[NC,H,C,C] bf16, dGk[NC,H,C,K] bf16); dv, dbeta (valid rows), dB and dGk are written.
    k, g, W, U, dW and dU are read by TMA: 16-byte aligned data pointers (chunk_kda_bwd checks k
    and g; W, U, dW, dU are the package's own allocations).
    threads: 256 (two blocks per SM) or 128; a multiple of K (the gate cumsum) and 16 times a
    divisor of 16 (the solve), ValueError otherwise. general: any g <= 0 (the forward's
    :func:`kda_cp.kernels.intra.build_intra_kernel` general recompute of B).
    """
    if chunk_size % SUB or accum_dtype != "float32":
        raise ValueError(f"chunk_size must be a multiple of {SUB} and accum_dtype float32, got "
                         f"{chunk_size}, {accum_dtype}")
    return compile_kernel(_bwd_ut_func(H, K, V, chunk_size, tl_dtype(dtype), accum_dtype, threads, bool(general)),
                          name="kda_bwd_ut", fast_math=True)


@functools.lru_cache(maxsize=None)
def build_bwd_dk_kernel(H, K, chunk_size, dtype, accum_dtype="float32", *, scale, block_k=64,
                        block_v=None, threads=256, num_stages=1, general=False):
    """Compile kernel "dk": decayed products' backward and the assembly of dq, dk, dg.

    ``scale`` is static (part of the cache key, as in the forward). Returns kernel(q[TT,H,K],
    k[TT,H,K], g[TT,H,K] f32, table[NC,2] i32, dAqk[NC,H,C,C] bf16, dB[NC,H,C,C] bf16, dQg[NC,H,C,K] bf16,
    dKd[NC,H,C,K] bf16, dGk[NC,H,C,K] bf16, deC[NC,H,K] f32, dq[TT,H,K], dk[TT,H,K], dg[TT,H,K] f32);
    dq, dk, dg are written on valid rows. block_k: key channels per thread block (K % block_k == 0).
    threads: 256 (two warpgroups, each taking 32 of the 64 channels of every wgmma), at most 128
    registers per thread so that two blocks share an SM (docs/kernels.md). ValueError unless chunk_size is 64 and K and threads are
    multiples of block_k. general: any g <= 0, the own sub-chunk blocks summed pairwise.
    """
    block_k = min(block_k, K)
    if chunk_size != 64 or accum_dtype != "float32" or K % block_k or threads % block_k:
        # chunk_size: the chunk's tokens are the M of every wgmma, 64 per warpgroup
        raise ValueError(f"chunk_size must be 64, accum_dtype float32, K and threads multiples of block_k, got "
                         f"{chunk_size}, {accum_dtype}, K={K}, threads={threads}, block_k={block_k}")
    return compile_kernel(_bwd_dk_func(H, K, chunk_size, tl_dtype(dtype), accum_dtype, float(scale), threads,
                                       block_k, bool(general)),
                          name="kda_bwd_dk", fast_math=True)
