"""State pass, fused with the output (forward).

One thread block per (sequence, head, block of block_v value columns) walks the chunks of its
sequence in order, carrying the state S (K x block_v, fp32, in registers). Per chunk, with the
chunk-local tensors from intra.py:

    V'  = U - W S                     pseudo-values              (C x block_v)
    O   = Qg S + Aqk V'               output rows of the chunk   (scale already folded in)
    S  <- Diag(eC) S + Kd^T V'        state entering the next chunk

The output stage of docs/design.md §2 is fused here: O needs the same S and V' that the state pass
already holds, so fusing saves writing and re-reading the per-chunk states and V'. Two forms: 64
columns on one warpgroup carry S^T and compute the transposed products, so that S^T and V'^T are
register A operands of the MMAs; narrower blocks keep S and V' in shared memory as B operands
(_state_output_func). _common.state_launch picks one.

Summary mode (docs/design.md §3): the same pass from the augmented state [0 | I] (K x (V + K)) with
pseudo-values [U | 0] ends in [S~ | M], the segment's affine map S_out = M S_in + S~. Columns are
independent, so each block owns 64 columns of either the S~ part or the M part and carries them
transposed. Every product there carries fp32-level accuracy on tensor cores, never one plain 16-bit
or TF32 product of an fp32 value: on the forward's bf16 W and Kd (chunk_kda_summary_prepared, what
context parallelism uses), bf16 MMAs with the fp32 side (the state, V') split into two bf16 pieces
(16 significant bits; W and Kd exact), the pieces in registers as A operands; on fp16 W and Kd (not
exact in bf16) 2xTF32 with only the fp32 side split; on the fp32 inputs of
intra.build_intra_summary_kernel (chunk_kda_summary) 3xTF32.

Numerics: S is kept in fp32 across chunks; the GEMMs read a copy of S rounded to the input dtype
(as the peers do) and accumulate in fp32. Rows past the sequence end are not written.
"""
import functools

import tilelang
import tilelang.language as T

from ._common import check_state_launch, compile_kernel, tf32_hi, tl_dtype


def _state_output_func(H, K, V, C, dtype, f32, block_v, threads, num_stages, with_h0, store_ht):
    """The state + output pass in one of two forms. (block_v, threads) = (64, 128), the register-
    operand form: one warpgroup carries S^T (64 x K, fp32) and computes V'^T = U^T - S^T W^T,
    O^T = S^T Qg^T + V'^T Aqk^T and S^T <- S^T Diag(eC) + V'^T Kd, so S^T and V'^T (rounded to the
    input dtype) are the A operands of register-sourced wgmma and never go through shared memory.
    Any other launch, the shared-operand form: S and V' rounded into shared memory as B operands of
    V' = U - W S, O = Qg S + Aqk V', S <- Diag(eC) S + Kd^T V'. The same products and roundings in
    both (outputs bitwise equal on an H200)."""
    Hn = T.dynamic("H") if H is None else H  # heads: runtime unless specialised
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")
    N = T.dynamic("N")
    BV = block_v
    regs = (block_v, threads) == (64, 128)

    @T.macro
    def load_chunk(W, U, Qg, Kd, Aqk, Ec, ci, ih, iv, w_s, u_s, qg_s, kd_s, aqk_s, ec_s):
        T.copy(W[ci, ih, :, :], w_s)
        T.copy(U[ci, ih, :, iv * BV : (iv + 1) * BV], u_s)
        T.copy(Qg[ci, ih, :, :], qg_s)
        T.copy(Kd[ci, ih, :, :], kd_s)
        T.copy(Aqk[ci, ih, :, :], aqk_s)
        T.copy(Ec[ci, ih, :], ec_s)

    @T.prim_func
    def kda_state_output_fwd(
        W: T.Tensor([NC, Hn, C, K], dtype),
        U: T.Tensor([NC, Hn, C, V], dtype),
        Qg: T.Tensor([NC, Hn, C, K], dtype),
        Kd: T.Tensor([NC, Hn, C, K], dtype),
        Aqk: T.Tensor([NC, Hn, C, C], dtype),
        Ec: T.Tensor([NC, Hn, K], f32),
        Seq: T.Tensor([N, 4], "int32"),
        H0: T.Tensor([N, Hn, K, V], f32),
        O: T.Tensor([TT, Hn, V], dtype),
        HT: T.Tensor([N, Hn, K, V], f32),
    ):
        # a grid axis per index: no division by the runtime head count in per-element addresses
        with T.Kernel(V // BV, Hn, N, threads=threads) as (iv, ih, n):
            c0 = Seq[n, 0]
            nc = Seq[n, 1]
            bos = Seq[n, 2]
            eos = Seq[n, 3]

            w_s = T.alloc_shared([C, K], dtype)
            qg_s = T.alloc_shared([C, K], dtype)
            kd_s = T.alloc_shared([C, K], dtype)
            aqk_s = T.alloc_shared([C, C], dtype)
            u_s = T.alloc_shared([C, BV], dtype)
            ec_s = T.alloc_shared([K], f32)
            if regs:
                o_s = T.alloc_shared([C, BV], dtype)  # O^T transposed back, for 16-byte row stores
                S_f = T.alloc_fragment([BV, K], f32)  # S^T
                s_f = T.alloc_fragment([BV, K], dtype)
                vn_f = T.alloc_fragment([BV, C], f32)  # V'^T
                v_f = T.alloc_fragment([BV, C], dtype)
                o_f = T.alloc_fragment([BV, C], f32)  # O^T
                # U and O are read / written transposed: a thread's pairs sit in rows 2 apart, which
                # the swizzle spreads over the banks
                T.annotate_layout({u_s: tilelang.layout.make_swizzled_layout(u_s),
                                   o_s: tilelang.layout.make_swizzled_layout(o_s)})

                for j, d in T.Parallel(BV, K):
                    if with_h0:
                        S_f[j, d] = H0[n, ih, d, iv * BV + j]
                    else:
                        S_f[j, d] = T.float32(0)

                for c in T.Pipelined(nc, num_stages=num_stages):
                    load_chunk(W, U, Qg, Kd, Aqk, Ec, c0 + c, ih, iv, w_s, u_s, qg_s, kd_s, aqk_s, ec_s)
                    for j, d in T.Parallel(BV, K):
                        s_f[j, d] = T.cast(S_f[j, d], dtype)
                    # V'^T = U^T - S^T W^T, and O^T = S^T Qg^T issued behind it: the tensor cores
                    # run S^T Qg^T while this warpgroup waits for S^T W^T only and forms V'^T
                    T.wgmma_gemm(s_f, w_s, vn_f, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(s_f, qg_s, o_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(vn_f, num_regs=C * BV // 128)  # V'^T read after the wait
                    if eos < bos:  # never true: W's last read after the wait (see below)
                        O[bos, ih, iv * BV] = w_s[0, 0]
                    for j, i in T.Parallel(BV, C):
                        v_f[j, i] = T.cast(T.cast(u_s[i, j], f32) - vn_f[j, i], dtype)
                    # the next chunk's S^T and O^T += V'^T Aqk^T: issued back to back, one wait
                    for j, d in T.Parallel(BV, K):
                        S_f[j, d] = S_f[j, d] * ec_s[d]
                    T.wgmma_gemm(v_f, kd_s, S_f)
                    T.wgmma_gemm(v_f, aqk_s, o_f, transpose_B=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(S_f, num_regs=K * BV // 128)  # reads of the accumulators
                    T.warpgroup_fence_operand(o_f, num_regs=C * BV // 128)  # stay after the wait
                    if eos < bos:  # never true: the pipelined tiles' last reads stay after the wait, so
                        # that TileLang hands them back to the TMA producer only once the MMAs read them
                        O[bos, ih, iv * BV] = kd_s[0, 0] + qg_s[0, 0] + aqk_s[0, 0]
                    for j, i in T.Parallel(BV, C):
                        o_s[i, j] = T.cast(o_f[j, i], dtype)
                    for i, j in T.Parallel(C, BV):
                        if bos + c * C + i < eos:
                            O[bos + c * C + i, ih, iv * BV + j] = o_s[i, j]

                if store_ht:
                    for j, d in T.Parallel(BV, K):
                        HT[n, ih, d, iv * BV + j] = S_f[j, d]
            else:
                S_s = T.alloc_shared([K, BV], dtype)
                vn_s = T.alloc_shared([C, BV], dtype)
                # O on its way out: rows of 16-byte stores instead of the fragment's 4-byte pieces
                # (those took a fifth of the pass at S1), swizzled against the fragment's bank conflicts
                o_s = T.alloc_shared([C, BV], dtype)
                T.annotate_layout({o_s: tilelang.layout.make_swizzled_layout(o_s)})
                S_f = T.alloc_fragment([K, BV], f32)
                vn_f = T.alloc_fragment([C, BV], f32)
                o_f = T.alloc_fragment([C, BV], f32)

                if with_h0:
                    T.copy(H0[n, ih, :, iv * BV : (iv + 1) * BV], S_f)
                else:
                    T.clear(S_f)

                for c in T.Pipelined(nc, num_stages=num_stages):
                    load_chunk(W, U, Qg, Kd, Aqk, Ec, c0 + c, ih, iv, w_s, u_s, qg_s, kd_s, aqk_s, ec_s)
                    T.copy(S_f, S_s)
                    # V' = U - W S, and O = Qg S issued behind it: the tensor cores run Qg S while
                    # this warpgroup waits for W S only (groups complete in order) and forms V'
                    T.wgmma_gemm(w_s, S_s, vn_f, clear_accum=True)
                    T.wgmma_gemm(qg_s, S_s, o_f, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(vn_f, num_regs=C * BV // threads)  # V' read after the wait
                    if eos < bos:  # never true: W's last read after the wait (see below)
                        O[bos, ih, iv * BV] = w_s[0, 0]
                    for i, j in T.Parallel(C, BV):
                        vn_f[i, j] = T.cast(u_s[i, j], f32) - vn_f[i, j]
                    T.copy(vn_f, vn_s)
                    # S <- Diag(eC) S + Kd^T V' (the next chunk's chain) and O += Aqk V': issued
                    # back to back, one wait for all
                    for d, j in T.Parallel(K, BV):
                        S_f[d, j] = S_f[d, j] * ec_s[d]
                    T.wgmma_gemm(kd_s, vn_s, S_f, transpose_A=True)
                    T.wgmma_gemm(aqk_s, vn_s, o_f)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(S_f, num_regs=K * BV // threads)  # reads of the accumulators
                    T.warpgroup_fence_operand(o_f, num_regs=C * BV // threads)  # stay after the wait
                    if eos < bos:  # never true: the pipelined tiles' last reads stay after the wait, so
                        # that TileLang hands them back to the TMA producer only once the MMAs read them
                        O[bos, ih, iv * BV] = kd_s[0, 0] + qg_s[0, 0] + aqk_s[0, 0]
                    T.copy(o_f, o_s)
                    for i, j in T.Parallel(C, BV):
                        if bos + c * C + i < eos:
                            O[bos + c * C + i, ih, iv * BV + j] = o_s[i, j]

                if store_ht:
                    T.copy(S_f, HT[n, ih, :, iv * BV : (iv + 1) * BV])

    return kda_state_output_fwd


@functools.lru_cache(maxsize=None)
def build_state_output_kernel(H, K, V, chunk_size, dtype, accum_dtype="float32", *, with_h0,
                              store_ht, block_k=None, block_v=32, threads=128, num_stages=None):
    """Compile the fused state + output kernel for one static configuration (T, N dynamic).

    Args:
        H: heads; None makes it a runtime value like T and N, an int specialises.
        K, V, chunk_size: static sizes; V % block_v == 0.
        dtype: the q/k/v dtype name; accum_dtype must be "float32".
        with_h0: read the initial state H0 [N, H, K, V] fp32 (else start from zero).
        store_ht: write the final state HT [N, H, K, V] fp32.
        block_v: value columns per thread block; threads, num_stages: launch knobs (chunk_kda_fwd
            picks block_v and threads with :func:`._common.state_launch`, among STATE_LAUNCHES).
            (64, 128), 64 columns on one warpgroup, builds the transposed, register-operand form;
            every other launch the form with S and V' in shared memory (step times:
            _common.STATE_STEP_US). num_stages: chunks of W, U, Qg, Kd, Aqk, eC in flight (TMA);
            None takes 3 for the shared-operand form and 2 for the register-operand form, where a
            third stage gains nothing. Both forms issue the output's Qg S with W S and wait for
            W S alone, forming V' while the tensor cores run Qg S (docs/kernels.md).
    Returns:
        kernel(W, U, Qg, Kd, Aqk, Ec, Seq[N,4] i32, H0, O[TT,H,V], HT); O and HT are written. Seq
        rows are (first chunk, chunks, bos, eos) with bos <= eos, as _common.build_chunk_tables
        makes them (the kernel relies on it).
    Raises:
        ValueError: V not a multiple of block_v, accum_dtype not float32, or a launch that
            tilelang 0.1.15 miscompiles (:func:`._common.check_state_launch`).
    """
    if V % block_v or accum_dtype != "float32":
        raise ValueError(f"V={V} must be a multiple of block_v={block_v}; accum_dtype float32")
    check_state_launch(block_v, threads)
    if num_stages is None:
        num_stages = 2 if (block_v, threads) == (64, 128) else 3
    func = _state_output_func(H, K, V, chunk_size, tl_dtype(dtype), accum_dtype, block_v, threads,
                              num_stages, bool(with_h0), bool(store_ht))
    return compile_kernel(func, name="kda_state_output_fwd")


def _summary_func(H, K, V, C, f32, block_v, threads, in_dtype):
    NC = T.dynamic("NC")
    N = T.dynamic("N")
    Hn = T.dynamic("H") if H is None else H
    BV = block_v
    VA = V + K
    NB = VA // BV  # column blocks per (sequence, head)
    # fp32 inputs (the summary intra kernel): W and Kd^T are split too (3xTF32). 16-bit inputs (the
    # forward's chunk-local tensors): W and Kd are exact in TF32, so only the fp32 side (the state,
    # V') is split and each product takes two TF32 GEMMs instead of three.
    split_in = in_dtype == f32
    kd_shape = [NC, Hn, K, C] if split_in else [NC, Hn, C, K]
    KPT = K * C // threads  # 16-bit Kd: key channels per thread
    op = "custom[tfloat32]"

    def tf32(x):
        """An fp32 value as a TF32 operand: a bit-cast, no rounding conversion (the summaries
        are bitwise equal to those of the rounding conversion)."""
        return T.reinterpret(x, op)

    def head(x):  # the operand piece that carries x's leading bits
        return tf32(tf32_hi(x))

    def tail(x):  # x - head(x), as an operand
        return tf32(x - tf32_hi(x))

    def exact(x):  # a 16-bit input value as an operand (exact in TF32)
        return tf32(T.cast(x, f32))

    @T.macro
    def load_w(W, w_r, ci, ih):
        for i, d in T.Parallel(C, K):
            w_r[i, d] = W[ci, ih, i, d]

    @T.macro
    def load_kd(Kd, k_x, ci, ih, tx):
        if split_in:
            for d, i in T.Parallel(K, C):
                k_x[d, i] = Kd[ci, ih, d, i]
        else:
            for v8 in T.serial(KPT // 8):
                for r in T.vectorized(8):
                    k_x[v8 * 8 + r] = Kd[ci, ih, tx % C, (tx // C) * KPT + v8 * 8 + r]

    @T.macro
    def stage_w(w_r, wh_s, wl_s):
        if split_in:
            for i, d in T.Parallel(C, K):
                wh_s[i, d] = head(w_r[i, d])
                wl_s[i, d] = tail(w_r[i, d])
        else:
            for i, d in T.Parallel(C, K):
                wh_s[i, d] = exact(w_r[i, d])

    @T.macro
    def stage_kd(k_x, kh_s, kl_s, tx):
        if split_in:
            for d, i in T.Parallel(K, C):
                kh_s[d, i] = head(k_x[d, i])
                kl_s[d, i] = tail(k_x[d, i])
        else:
            for r in T.unroll(KPT):
                kh_s[(tx // C) * KPT + r, tx % C] = exact(k_x[r])

    @T.prim_func
    def kda_state_summary(
        W: T.Tensor([NC, Hn, C, K], in_dtype),
        U: T.Tensor([NC, Hn, C, V], in_dtype),
        Kd: T.Tensor(kd_shape, in_dtype),
        Ec: T.Tensor([NC, Hn, K], f32),
        Seq: T.Tensor([N, 4], "int32"),
        SM: T.Tensor([N, Hn, K, VA], f32),
    ):
        with T.Kernel(NB * N, Hn, threads=threads) as (bx, ih):
            n = bx // NB
            col0 = (bx % NB) * BV  # first augmented column of this block
            c0 = Seq[n, 0]
            nc = Seq[n, 1]
            is_m = col0 >= V  # this block carries columns of M (else of S~)
            ucol = T.min(col0, V - BV)  # U columns read (an M block reads valid ones and zeroes them)
            tx = T.get_thread_binding()

            wh_s = T.alloc_shared([C, K], op)  # W (K-major)
            kh_s = T.alloc_shared([K, C], op)  # Kd^T (C-major)
            if split_in:
                wl_s = T.alloc_shared([C, K], op)
                kl_s = T.alloc_shared([K, C], op)
            else:  # no tails: the 16-bit W and Kd are exact in TF32
                wl_s = wh_s
                kl_s = kh_s
            sh_s = T.alloc_shared([BV, K], op)  # S^T head and tail
            sl_s = T.alloc_shared([BV, K], op)
            vh_s = T.alloc_shared([BV, C], op)  # V'^T head and tail
            vl_s = T.alloc_shared([BV, C], op)
            ec_s = T.alloc_shared([K], f32)
            S_f = T.alloc_fragment([BV, K], f32)  # S^T
            vn_f = T.alloc_fragment([BV, C], f32)  # V'^T
            w_r = T.alloc_fragment([C, K], in_dtype)
            if split_in:
                k_x = T.alloc_fragment([K, C], in_dtype)
            else:
                # Kd [C, K] goes to shared memory transposed: thread tx holds row i = tx % C,
                # channels KPT * (tx // C) + [0, KPT) (16-byte loads); a warp then stores 32
                # consecutive i of one channel row: conflict-free.
                k_x = T.alloc_local([KPT], in_dtype)
            u_r = T.alloc_fragment([BV, C], f32)
            e_r = T.alloc_local([1], f32)

            for j, d in T.Parallel(BV, K):
                S_f[j, d] = T.if_then_else(is_m and (d == col0 + j - V), T.float32(1), T.float32(0))

            # prologue: chunk 0 (an empty sequence, nc = 0, reads a valid chunk and keeps [0 | I])
            cf = T.min(c0, NC - 1)
            load_w(W, w_r, cf, ih)
            load_kd(Kd, k_x, cf, ih, tx)
            for j, i in T.Parallel(BV, C):
                u_r[j, i] = T.if_then_else(is_m, T.float32(0), T.cast(U[cf, ih, i, ucol + j], f32))
            if tx < K:
                e_r[0] = Ec[cf, ih, tx]
            stage_w(w_r, wh_s, wl_s)

            for c in T.serial(nc):
                cn = c0 + T.min(c + 1, nc - 1)  # next chunk (the last one reloads itself)
                for j, d in T.Parallel(BV, K):
                    sh_s[j, d] = head(S_f[j, d])
                    sl_s[j, d] = tail(S_f[j, d])
                # V'^T = U^T - S^T W^T, asynchronous; meanwhile this chunk's Kd^T and eC go to
                # shared memory (these MMAs read W and S only) and the next chunk's loads issue
                T.wgmma_gemm(sh_s, wh_s, vn_f, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(sl_s, wh_s, vn_f, transpose_B=True)
                if split_in:
                    T.wgmma_gemm(sh_s, wl_s, vn_f, transpose_B=True)
                stage_kd(k_x, kh_s, kl_s, tx)
                if tx < K:
                    ec_s[tx] = e_r[0]
                load_w(W, w_r, cn, ih)
                load_kd(Kd, k_x, cn, ih, tx)
                if tx < K:
                    e_r[0] = Ec[cn, ih, tx]
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(vn_f, num_regs=C * BV // threads)  # reads of V' stay after the wait
                for j, i in T.Parallel(BV, C):
                    vn_f[j, i] = u_r[j, i] - vn_f[j, i]
                for j, i in T.Parallel(BV, C):
                    u_r[j, i] = T.if_then_else(is_m, T.float32(0), T.cast(U[cn, ih, i, ucol + j], f32))
                for j, i in T.Parallel(BV, C):
                    vh_s[j, i] = head(vn_f[j, i])
                    vl_s[j, i] = tail(vn_f[j, i])
                # S^T <- S^T Diag(eC) + V'^T Kd, asynchronous; meanwhile the next chunk's W goes to
                # shared memory (these MMAs read Kd and V' only)
                for j, d in T.Parallel(BV, K):
                    S_f[j, d] = S_f[j, d] * ec_s[d]
                T.wgmma_gemm(vh_s, kh_s, S_f, transpose_B=True)
                T.wgmma_gemm(vl_s, kh_s, S_f, transpose_B=True)
                if split_in:
                    T.wgmma_gemm(vh_s, kl_s, S_f, transpose_B=True)
                stage_w(w_r, wh_s, wl_s)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(S_f, num_regs=K * BV // threads)

            for j, d in T.Parallel(BV, K):
                SM[n, ih, d, col0 + j] = S_f[j, d]

    return kda_state_summary


def _summary_bf16_func(H, K, V, C, f32, block_v, num_stages):
    """The summary pass on bf16 W, U, Kd: one warpgroup per block carries S^T in registers as the A
    operand of both GEMMs (register-sourced wgmma); a TMA producer warpgroup streams each chunk's
    W, Kd, U and eC into shared memory, num_stages chunks ahead."""
    NC = T.dynamic("NC")
    N = T.dynamic("N")
    Hn = T.dynamic("H") if H is None else H
    BV = block_v
    VA = V + K
    NB = VA // BV
    bf16 = "bfloat16"

    def head(x):  # x = head + tail to 16 significant bits: two bf16 pieces of an fp32 value
        return T.cast(x, bf16)

    def tail(x):
        return T.cast(x - T.cast(T.cast(x, bf16), f32), bf16)

    @T.prim_func
    def kda_state_summary(
        W: T.Tensor([NC, Hn, C, K], bf16),
        U: T.Tensor([NC, Hn, C, V], bf16),
        Kd: T.Tensor([NC, Hn, C, K], bf16),
        Ec: T.Tensor([NC, Hn, K], f32),
        Seq: T.Tensor([N, 4], "int32"),
        SM: T.Tensor([N, Hn, K, VA], f32),
    ):
        with T.Kernel(NB * N, Hn, threads=128) as (bx, ih):
            n = bx // NB
            col0 = (bx % NB) * BV  # first augmented column of this block
            c0 = Seq[n, 0]
            nc = Seq[n, 1]
            is_m = col0 >= V  # this block carries columns of M (else of S~)
            ucol = T.min(col0, V - BV)  # U columns read (an M block reads valid ones and zeroes them)

            w_s = T.alloc_shared([C, K], bf16)  # W: K-major B of V'^T = S^T W^T
            kd_s = T.alloc_shared([C, K], bf16)  # Kd: N-major B of S^T += V'^T Kd
            u_s = T.alloc_shared([C, BV], bf16)
            ec_s = T.alloc_shared([K], f32)
            S_f = T.alloc_fragment([BV, K], f32)  # S^T
            sh_f = T.alloc_fragment([BV, K], bf16)  # S^T head and tail: A operands in registers
            sl_f = T.alloc_fragment([BV, K], bf16)
            vn_f = T.alloc_fragment([BV, C], f32)  # V'^T
            vh_f = T.alloc_fragment([BV, C], bf16)
            vl_f = T.alloc_fragment([BV, C], bf16)
            # U is read transposed (a thread's pairs sit in rows 2 apart, all on one bank unswizzled)
            T.annotate_layout({u_s: tilelang.layout.make_swizzled_layout(u_s)})

            for j, d in T.Parallel(BV, K):
                S_f[j, d] = T.if_then_else(is_m and (d == col0 + j - V), T.float32(1), T.float32(0))

            for c in T.Pipelined(nc, num_stages=num_stages):
                ci = c0 + c
                T.copy(W[ci, ih, :, :], w_s)
                T.copy(Kd[ci, ih, :, :], kd_s)
                T.copy(U[ci, ih, :, ucol:ucol + BV], u_s)
                T.copy(Ec[ci, ih, :], ec_s)
                for j, d in T.Parallel(BV, K):
                    sh_f[j, d] = head(S_f[j, d])
                    sl_f[j, d] = tail(S_f[j, d])
                # V'^T = U^T - S^T W^T: the head's MMAs asynchronous, the tail's synchronous (one
                # wait for both; W's last read is then complete when TileLang releases it)
                T.wgmma_gemm(sh_f, w_s, vn_f, transpose_B=True, clear_accum=True)
                T.gemm(sl_f, w_s, vn_f, transpose_B=True)
                for j, i in T.Parallel(BV, C):
                    vn_f[j, i] = T.if_then_else(is_m, T.float32(0), T.cast(u_s[i, j], f32)) - vn_f[j, i]
                for j, i in T.Parallel(BV, C):
                    vh_f[j, i] = head(vn_f[j, i])
                    vl_f[j, i] = tail(vn_f[j, i])
                # S^T <- S^T Diag(eC) + V'^T Kd
                for j, d in T.Parallel(BV, K):
                    S_f[j, d] = S_f[j, d] * ec_s[d]
                T.wgmma_gemm(vh_f, kd_s, S_f)
                T.gemm(vl_f, kd_s, S_f)

            for j, d in T.Parallel(BV, K):
                SM[n, ih, d, col0 + j] = S_f[j, d]

    return kda_state_summary


@functools.lru_cache(maxsize=None)
def build_summary_kernel(H, K, V, chunk_size, dtype="float32", accum_dtype="float32", *, threads=256,
                         operands="bf16x2", num_stages=2):
    """Compile the summary-mode state pass (N, number of chunks and H dynamic).

    One block per (sequence, head, 64 augmented columns): the V + K = 256 columns of a head take 4
    blocks, so B*H = 32 heads fill the H200's 132 SMs in one wave (fewer heads: cut the sequences
    into pieces, launch.summary_run). The block carries S^T (64 x K, fp32, in registers) and
    computes V'^T = U^T - S^T W^T and S^T <- S^T Diag(eC) + V'^T Kd per chunk.

    bf16 inputs with operands="bf16x2" (what CP runs): W and Kd are exact bf16 operands; S^T and
    V'^T, each split into two bf16 pieces (head + tail, 16 significant bits), are the A operands of
    register-sourced wgmma, so they never go through shared memory; one warpgroup computes and a
    TMA producer warpgroup streams W, Kd, U, eC num_stages chunks ahead. Keeping the pieces in
    registers spares the shared-memory traffic that would otherwise bound the pass. Other
    inputs take TF32 MMAs with every operand in shared memory (two warpgroups, asynchronous MMAs
    overlapping the next chunk's loads; about 3.5x slower for bf16 inputs): fp16 W and Kd are exact in
    TF32 and only the state and V' are split (2xTF32); fp32 inputs (the summary intra kernel's)
    split every operand (3xTF32).

    Args:
        H: None (runtime) or an int; K, V, chunk_size static; K and V multiples of 64.
        dtype: the inputs' dtype. "float32": W, U, Kd^T from the fp32 summary intra kernel.
            "bfloat16"/"float16": the forward's chunk-local tensors (chunk_kda_fwd_prepare).
        operands: for bf16 inputs, "bf16x2" (above) or "tf32x2" (TF32 MMAs on two TF32 pieces, 21
            bits; the TF32 kernel, kept for comparison). fp16 and fp32 inputs always take TF32
            (fp16 values are not exact in bf16).
        accum_dtype: "float32". threads: the TF32 kernel's (256: two warpgroups); the bf16 kernel
            always runs one computing warpgroup plus its producer. num_stages: the bf16 kernel's
            TMA pipeline depth.
    Returns:
        kernel(W[NC,H,C,K], U[NC,H,C,V], Kd, Ec[NC,H,K] fp32, Seq[N,4] i32, SM[N,H,K,V+K] fp32)
        writing SM = [S~ | M] for each row (first chunk, number of chunks, -, -) of Seq; Kd is
        Kd^T [NC,H,K,C] for fp32 inputs, Kd [NC,H,C,K] for 16-bit ones. A row with no chunks gets
        [0 | I].
    Raises:
        ValueError for K or V not a multiple of 64, or (TF32 kernel) a thread count that does not
        split Kd evenly (16-bit inputs: K * chunk_size / threads key channels per thread, a
        multiple of 8).
    """
    block_v = 64  # one warpgroup M-tile of S^T rows
    if V % block_v or K % block_v or accum_dtype != "float32":
        raise ValueError(f"V={V} and K={K} must be multiples of {block_v}; accum_dtype float32")
    if tl_dtype(dtype) == "bfloat16" and operands == "bf16x2":
        func = _summary_bf16_func(H, K, V, chunk_size, accum_dtype, block_v, num_stages)
        return compile_kernel(func, name="kda_state_summary")
    if threads < K or threads % 128:
        raise ValueError(f"threads={threads} must be whole warpgroups and >= K={K} (one thread per key channel of eC)")
    if tl_dtype(dtype) != "float32" and ((K * chunk_size) % threads or (K * chunk_size // threads) % 8
                                        or threads % chunk_size):
        raise ValueError(f"16-bit inputs: threads={threads} must divide K * chunk_size = {K * chunk_size} into a "
                         f"multiple of 8 key channels per thread, and be a multiple of chunk_size={chunk_size}")
    func = _summary_func(H, K, V, chunk_size, accum_dtype, block_v, threads, tl_dtype(dtype))
    return compile_kernel(func, name="kda_state_summary")
