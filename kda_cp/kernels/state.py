"""State pass, fused with the output (forward).

One thread block per (sequence, head, block of block_v value columns) walks the chunks of its
sequence in order, carrying the state S (K x block_v, fp32, in registers). Per chunk, with the
chunk-local tensors from intra.py:

    V'  = U - W S                     pseudo-values              (C x block_v)
    O   = Qg S + Aqk V'               output rows of the chunk   (scale already folded in)
    S  <- Diag(eC) S + Kd^T V'        state entering the next chunk

The output stage of DESIGN.md §2 is fused here: O needs the same S and V' that the state pass
already holds, so fusing saves writing and re-reading the per-chunk states and V'.

Summary mode (DESIGN.md §3): the same pass from the augmented state [0 | I] (K x (V + K)) with
pseudo-values [U | 0] ends in [S~ | M], the segment's affine map S_out = M S_in + S~. Columns are
independent, so each block owns block_v columns of either the S~ part or the M part. Every product
there carries fp32 accuracy on TF32 tensor cores: a 3xTF32 GEMM on the fp32 inputs of
intra.build_intra_summary_kernel (chunk_kda_summary), or, on the forward's bf16/fp16 W and Kd (exact in
TF32; chunk_kda_summary_prepared, what context parallelism uses), 2xTF32 with only the fp32 side split.

Numerics: S is kept in fp32 across chunks; the GEMMs read a copy of S rounded to the input dtype
(as the peers do) and accumulate in fp32. Rows past the sequence end are not written.
"""
import functools

import tilelang.language as T

from ._common import compile_kernel, tf32_hi, tl_dtype


def _state_output_func(H, K, V, C, dtype, f32, block_v, threads, num_stages, with_h0, store_ht):
    Hn = T.dynamic("H") if H is None else H  # heads: runtime unless specialised
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")
    N = T.dynamic("N")
    BV = block_v

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
        with T.Kernel(V // BV, N * Hn, threads=threads) as (iv, inh):
            n = inh // Hn
            ih = inh % Hn
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
            S_s = T.alloc_shared([K, BV], dtype)
            vn_s = T.alloc_shared([C, BV], dtype)
            S_f = T.alloc_fragment([K, BV], f32)
            vn_f = T.alloc_fragment([C, BV], f32)
            o_f = T.alloc_fragment([C, BV], f32)

            if with_h0:
                T.copy(H0[n, ih, :, iv * BV : (iv + 1) * BV], S_f)
            else:
                T.clear(S_f)

            for c in T.Pipelined(nc, num_stages=num_stages):
                ci = c0 + c
                T.copy(W[ci, ih, :, :], w_s)
                T.copy(U[ci, ih, :, iv * BV : (iv + 1) * BV], u_s)
                T.copy(Qg[ci, ih, :, :], qg_s)
                T.copy(Kd[ci, ih, :, :], kd_s)
                T.copy(Aqk[ci, ih, :, :], aqk_s)
                T.copy(Ec[ci, ih, :], ec_s)
                T.copy(S_f, S_s)
                # V' = U - W S
                T.gemm(w_s, S_s, vn_f, clear_accum=True)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = T.cast(u_s[i, j], f32) - vn_f[i, j]
                T.copy(vn_f, vn_s)
                # O = Qg S + Aqk V'
                T.gemm(qg_s, S_s, o_f, clear_accum=True)
                T.gemm(aqk_s, vn_s, o_f)
                for i, j in T.Parallel(C, BV):
                    if bos + c * C + i < eos:
                        O[bos + c * C + i, ih, iv * BV + j] = T.cast(o_f[i, j], dtype)
                # S <- Diag(eC) S + Kd^T V'
                for d, j in T.Parallel(K, BV):
                    S_f[d, j] = S_f[d, j] * ec_s[d]
                T.gemm(kd_s, vn_s, S_f, transpose_A=True)

            if store_ht:
                T.copy(S_f, HT[n, ih, :, iv * BV : (iv + 1) * BV])

    return kda_state_output_fwd


@functools.lru_cache(maxsize=None)
def build_state_output_kernel(H, K, V, chunk_size, dtype, accum_dtype="float32", *, with_h0,
                              store_ht, block_k=None, block_v=32, threads=128, num_stages=2):
    """Compile the fused state + output kernel for one static configuration (T, N dynamic).

    Args:
        H: heads; None makes it a runtime value like T and N, an int specialises.
        K, V, chunk_size: static sizes; V % block_v == 0.
        dtype: the q/k/v dtype name; accum_dtype must be "float32".
        with_h0: read the initial state H0 [N, H, K, V] fp32 (else start from zero).
        store_ht: write the final state HT [N, H, K, V] fp32.
        block_v: value columns per thread block; threads, num_stages: launch knobs.
    Returns:
        kernel(W, U, Qg, Kd, Aqk, Ec, Seq[N,4] i32, H0, O[TT,H,V], HT); O and HT are written.
    """
    if V % block_v or accum_dtype != "float32":
        raise ValueError(f"V={V} must be a multiple of block_v={block_v}; accum_dtype float32")
    func = _state_output_func(H, K, V, chunk_size, tl_dtype(dtype), accum_dtype, block_v, threads,
                              num_stages, bool(with_h0), bool(store_ht))
    return compile_kernel(func, name="kda_state_output_fwd")


def _summary_func(H, K, V, C, f32, block_v, threads, op, in_dtype):
    NC = T.dynamic("NC")
    N = T.dynamic("N")
    Hn = T.dynamic("H") if H is None else H
    BV = block_v
    VA = V + K
    # fp32 inputs (the summary intra kernel): W and Kd^T are split too (3xTF32). 16-bit inputs (the
    # forward's chunk-local tensors): W and Kd are exact in TF32, so only the fp32 side (the state,
    # V') is split and each product takes two TF32 GEMMs instead of three.
    split_in = in_dtype == f32
    kd_shape = [NC, Hn, K, C] if split_in else [NC, Hn, C, K]
    KPT = K * C // threads  # 16-bit Kd: key channels per thread

    @T.macro
    def load_w_kd(W, Kd, w_r, k_x, ci, ih, tx):
        """W and Kd of chunk ci into registers (the next chunk's, while this one computes)."""
        for i, d in T.Parallel(C, K):
            w_r[i, d] = W[ci, ih, i, d]
        if split_in:
            for d, i in T.Parallel(K, C):
                k_x[d, i] = Kd[ci, ih, d, i]
        else:
            for v8 in T.serial(KPT // 8):
                for r in T.vectorized(8):
                    k_x[v8 * 8 + r] = Kd[ci, ih, tx % C, (tx // C) * KPT + v8 * 8 + r]

    @T.macro
    def stage_w_kd(w_r, k_x, wh_s, wl_s, kh_s, kl_s, tx):
        """Registers -> the TF32 operands in shared memory (split into head and tail for fp32 inputs)."""
        if split_in:
            for i, d in T.Parallel(C, K):
                wh_s[i, d] = T.cast(tf32_hi(w_r[i, d]), op)
                wl_s[i, d] = T.cast(w_r[i, d] - tf32_hi(w_r[i, d]), op)
            for d, i in T.Parallel(K, C):
                kh_s[d, i] = T.cast(tf32_hi(k_x[d, i]), op)
                kl_s[d, i] = T.cast(k_x[d, i] - tf32_hi(k_x[d, i]), op)
        else:
            for i, d in T.Parallel(C, K):
                wh_s[i, d] = T.cast(T.cast(w_r[i, d], f32), op)
            for r in T.unroll(KPT):
                kh_s[(tx // C) * KPT + r, tx % C] = T.cast(T.cast(k_x[r], f32), op)

    @T.prim_func
    def kda_state_summary(
        W: T.Tensor([NC, Hn, C, K], in_dtype),
        U: T.Tensor([NC, Hn, C, V], in_dtype),
        Kd: T.Tensor(kd_shape, in_dtype),
        Ec: T.Tensor([NC, Hn, K], f32),
        Seq: T.Tensor([N, 4], "int32"),
        SM: T.Tensor([N, Hn, K, VA], f32),
    ):
        with T.Kernel(VA // BV, N * Hn, threads=threads) as (iv, inh):
            n = inh // Hn
            ih = inh % Hn
            c0 = Seq[n, 0]
            nc = Seq[n, 1]
            col0 = iv * BV  # first augmented column of this block
            is_m = col0 >= V  # this block carries columns of M (else of S~)
            tx = T.get_thread_binding()

            # TF32 heads/tails of the operands (K-major, as the tensor cores read them)
            wh_s = T.alloc_shared([C, K], op)
            kh_s = T.alloc_shared([K, C], op)
            if split_in:
                wl_s = T.alloc_shared([C, K], op)
                kl_s = T.alloc_shared([K, C], op)
            sh_s = T.alloc_shared([BV, K], op)  # S^T split
            sl_s = T.alloc_shared([BV, K], op)
            vh_s = T.alloc_shared([BV, C], op)  # V'^T split
            vl_s = T.alloc_shared([BV, C], op)
            ec_s = T.alloc_shared([K], f32)
            S_f = T.alloc_fragment([K, BV], f32)
            vn_f = T.alloc_fragment([C, BV], f32)
            # registers holding the next chunk's inputs while this chunk computes (prefetch)
            w_r = T.alloc_fragment([C, K], in_dtype)
            if split_in:
                k_r = T.alloc_fragment([K, C], in_dtype)
            else:
                # Kd [C, K] goes to shared memory transposed (kh_s [K, C], K-major as the TF32 MMA
                # reads it). Thread tx holds row i = tx % C, channels KPT * (tx // C) + [0, KPT): it
                # loads them in 16-byte vectors, and the 32 lanes of a warp then store 32 consecutive
                # i of one channel row: conflict-free (a fragment layout stored 16 rows per bank).
                k_l = T.alloc_local([KPT], in_dtype)
            u_r = T.alloc_fragment([C, BV], f32)
            e_r = T.alloc_local([1], f32)

            for d, j in T.Parallel(K, BV):
                S_f[d, j] = T.if_then_else(is_m and (d == col0 + j - V), T.float32(1), T.float32(0))

            # prologue: chunk 0 (an empty sequence, nc = 0, reads a valid chunk and keeps [0 | I])
            cf = T.min(c0, NC - 1)
            if split_in:
                load_w_kd(W, Kd, w_r, k_r, cf, ih, tx)
            else:
                load_w_kd(W, Kd, w_r, k_l, cf, ih, tx)
            for i, j in T.Parallel(C, BV):
                u_r[i, j] = T.if_then_else(is_m, T.float32(0), T.cast(U[cf, ih, i, T.min(col0 + j, V - 1)], f32))
            if tx < K:
                e_r[0] = Ec[cf, ih, tx]
            if split_in:
                stage_w_kd(w_r, k_r, wh_s, wl_s, kh_s, kl_s, tx)
            else:  # no tails: the 16-bit W and Kd are exact in TF32
                stage_w_kd(w_r, k_l, wh_s, wh_s, kh_s, kh_s, tx)
            if tx < K:
                ec_s[tx] = e_r[0]

            for c in T.serial(nc):
                cn = c0 + T.min(c + 1, nc - 1)  # next chunk (the last one reloads itself)
                # issue the next chunk's W, Kd, eC loads; they land during this chunk's GEMMs
                if split_in:
                    load_w_kd(W, Kd, w_r, k_r, cn, ih, tx)
                else:
                    load_w_kd(W, Kd, w_r, k_l, cn, ih, tx)
                if tx < K:
                    e_r[0] = Ec[cn, ih, tx]
                for d, j in T.Parallel(K, BV):
                    sh_s[j, d] = T.cast(tf32_hi(S_f[d, j]), op)
                    sl_s[j, d] = T.cast(S_f[d, j] - tf32_hi(S_f[d, j]), op)
                # V' = U - W S
                T.gemm(wh_s, sh_s, vn_f, transpose_B=True, clear_accum=True)
                T.gemm(wh_s, sl_s, vn_f, transpose_B=True)
                if split_in:
                    T.gemm(wl_s, sh_s, vn_f, transpose_B=True)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = u_r[i, j] - vn_f[i, j]
                for i, j in T.Parallel(C, BV):
                    u_r[i, j] = T.if_then_else(is_m, T.float32(0),
                                               T.cast(U[cn, ih, i, T.min(col0 + j, V - 1)], f32))
                for i, j in T.Parallel(C, BV):
                    vh_s[j, i] = T.cast(tf32_hi(vn_f[i, j]), op)
                    vl_s[j, i] = T.cast(vn_f[i, j] - tf32_hi(vn_f[i, j]), op)
                # S <- Diag(eC) S + Kd^T V'
                for d, j in T.Parallel(K, BV):
                    S_f[d, j] = S_f[d, j] * ec_s[d]
                T.gemm(kh_s, vh_s, S_f, transpose_B=True)
                T.gemm(kh_s, vl_s, S_f, transpose_B=True)
                if split_in:
                    T.gemm(kl_s, vh_s, S_f, transpose_B=True)
                # the next chunk's operands, split, into shared memory
                if split_in:
                    stage_w_kd(w_r, k_r, wh_s, wl_s, kh_s, kl_s, tx)
                else:  # no tails: the 16-bit W and Kd are exact in TF32
                    stage_w_kd(w_r, k_l, wh_s, wh_s, kh_s, kh_s, tx)
                if tx < K:
                    ec_s[tx] = e_r[0]

            T.copy(S_f, SM[n, ih, :, col0 : col0 + BV])

    return kda_state_summary


@functools.lru_cache(maxsize=None)
def build_summary_kernel(H, K, V, chunk_size, dtype="float32", accum_dtype="float32", *,
                         block_k=None, block_v=64, threads=256, num_stages=1,
                         operand="custom[tfloat32]"):
    """Compile the summary-mode state pass (N, number of chunks and H dynamic).

    One block per (sequence, head, block_v augmented columns): with block_v = 64 the V + K = 256
    columns of a head take 4 blocks, so B*H = 32 heads fill the H200's 132 SMs in one wave. The
    next chunk's W, Kd^T, U, eC are loaded into registers while the current chunk's GEMMs run and
    split into TF32 head/tail in shared memory after them (a register prefetch: shared memory has
    no room for a second stage of the four K x C operands).

    Args:
        H: None (runtime) or an int; K, V, chunk_size static; V and K multiples of block_v.
        dtype: the inputs' dtype. "float32": W, U, Kd^T from the fp32 summary intra kernel, every
            product a 3xTF32 split. "bfloat16"/"float16": the forward's chunk-local tensors
            (chunk_kda_fwd_prepare), exact in TF32, so only the state and V' are split (2xTF32).
        accum_dtype: "float32".
        operand: element type of the split operands in shared memory, "float32" (mma.sync TF32)
            or "tfloat32" (lets TileLang pick wgmma); the values are exact either way.
    Returns:
        kernel(W[NC,H,C,K], U[NC,H,C,V], Kd, Ec[NC,H,K] fp32, Seq[N,4] i32, SM[N,H,K,V+K] fp32)
        writing SM = [S~ | M]; Kd is Kd^T [NC,H,K,C] for fp32 inputs, Kd [NC,H,C,K] for 16-bit ones.
        A sequence with no chunks gets [0 | I].
    """
    if V % block_v or K % block_v or accum_dtype != "float32":
        raise ValueError(f"V={V} and K={K} must be multiples of block_v={block_v}; accum_dtype float32")
    if threads < K:
        raise ValueError(f"threads={threads} must be >= K={K} (one thread per key channel of eC)")
    if tl_dtype(dtype) != "float32" and ((K * chunk_size) % threads or (K * chunk_size // threads) % 8
                                        or threads % chunk_size):
        raise ValueError(f"16-bit inputs: threads={threads} must divide K * chunk_size = {K * chunk_size} into a "
                         f"multiple of 8 key channels per thread, and be a multiple of chunk_size={chunk_size}")
    func = _summary_func(H, K, V, chunk_size, accum_dtype, block_v, threads, operand, tl_dtype(dtype))
    return compile_kernel(func, name="kda_state_summary")
