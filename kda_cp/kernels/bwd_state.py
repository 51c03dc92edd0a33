"""Backward state stage: the chunk-start states, then the reverse state-gradient pass.

One thread block per (block of block_v value columns, sequence, head) walks the chunks of its
sequence. Columns of V are independent, so blocks never communicate. Inputs are the chunk-local
tensors of the forward's intra kernel (intra.py: W, U, Qg, Kd, Aqk, eC; scale folded into Qg and
Aqk). Three walks, each its own launch (``walk``):

"forward": S from the sequence's initial state (fp32, registers), for each chunk c in order

    Hs[c] = S                         state entering chunk c (stored in the input dtype)
    V'    = U - W S;   S <- Diag(eC) S + Kd^T V'

"reverse": dS from dht (the gradient of the state leaving the sequence; zero when absent), for
each chunk in reverse order

    dHs[c] = dS                       gradient of the state leaving chunk c
    dV'    = Aqk^T dO + Kd dS
    dS    <- Qg^T dO + Diag(eC) dS - W^T dV'                            (docs/design.md §2, transposed)
    dH0    = dS after the first chunk: the gradient of the sequence's initial state

"state_grad": the reverse walk without storing dHs. With dht = 0 it is the standalone state
gradient G = dh0 that the context-parallel backward needs (docs/design.md §4.2, step 1): o is affine in
h0, so G does not depend on h0 and no state is recomputed.

Each walk is software-pipelined (``num_stages``): the next chunk's tiles load (TMA) under this
chunk's MMAs. The full backward runs "forward" then "reverse" as two launches; one kernel with both
walks does not lower with num_stages > 1 in tilelang 0.1.15.

Numerics: S and dS are carried in fp32; GEMMs read copies rounded to the input dtype (as the
forward state pass does) and accumulate in fp32. Rows of dO past the sequence end read as zero.
"""
import functools

import tilelang.language as T

from ._common import check_state_launch, compile_kernel, tl_dtype


def _bwd_state_func(H, K, V, C, dtype, f32, block_v, threads, walk, num_stages):
    Hn = T.dynamic("H") if H is None else H
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")
    N = T.dynamic("N")
    NCS = T.dynamic("NCS")  # chunks of the stored states: NC, or 1 when nothing is stored
    BV = block_v

    @T.prim_func
    def kda_bwd_state(
        W: T.Tensor([NC, Hn, C, K], dtype),
        U: T.Tensor([NC, Hn, C, V], dtype),
        Qg: T.Tensor([NC, Hn, C, K], dtype),
        Kd: T.Tensor([NC, Hn, C, K], dtype),
        Aqk: T.Tensor([NC, Hn, C, C], dtype),
        Ec: T.Tensor([NC, Hn, K], f32),
        DO: T.Tensor([TT, Hn, V], dtype),
        Seq: T.Tensor([N, 4], "int32"),
        H0: T.Tensor([N, Hn, K, V], f32),
        DHT: T.Tensor([N, Hn, K, V], f32),
        Hs: T.Tensor([NCS, Hn, K, V], dtype),
        DHs: T.Tensor([NCS, Hn, K, V], dtype),
        DH0: T.Tensor([N, Hn, K, V], f32),
    ):
        # a grid axis per index: no division by the runtime head count in per-element addresses
        with T.Kernel(V // BV, Hn, N, threads=threads) as (iv, ih, n):
            c0 = Seq[n, 0]
            nc = Seq[n, 1]
            bos = Seq[n, 2]
            eos = Seq[n, 3]

            w_s = T.alloc_shared([C, K], dtype)
            kd_s = T.alloc_shared([C, K], dtype)
            ec_s = T.alloc_shared([K], f32)
            S_s = T.alloc_shared([K, BV], dtype)
            vn_s = T.alloc_shared([C, BV], dtype)
            S_f = T.alloc_fragment([K, BV], f32)
            vn_f = T.alloc_fragment([C, BV], f32)

            if walk == "forward":  # chunk-start states
                u_s = T.alloc_shared([C, BV], dtype)
                T.copy(H0[n, ih, :, iv * BV : (iv + 1) * BV], S_f)
                for c in T.Pipelined(nc, num_stages=num_stages):
                    ci = c0 + c
                    T.copy(W[ci, ih, :, :], w_s)
                    T.copy(Kd[ci, ih, :, :], kd_s)
                    T.copy(U[ci, ih, :, iv * BV : (iv + 1) * BV], u_s)
                    T.copy(Ec[ci, ih, :], ec_s)
                    T.copy(S_f, S_s)
                    T.copy(S_s, Hs[ci, ih, :, iv * BV : (iv + 1) * BV])
                    T.gemm(w_s, S_s, vn_f, clear_accum=True)
                    for i, j in T.Parallel(C, BV):
                        vn_f[i, j] = T.cast(u_s[i, j], f32) - vn_f[i, j]
                    T.copy(vn_f, vn_s)
                    for d, j in T.Parallel(K, BV):
                        S_f[d, j] = S_f[d, j] * ec_s[d]
                    T.gemm(kd_s, vn_s, S_f, transpose_A=True)
            else:  # state gradients, in reverse chunk order
                qg_s = T.alloc_shared([C, K], dtype)
                aqk_s = T.alloc_shared([C, C], dtype)
                do_s = T.alloc_shared([C, BV], dtype)
                T.copy(DHT[n, ih, :, iv * BV : (iv + 1) * BV], S_f)  # S_f carries dS
                for cr in T.Pipelined(nc, num_stages=num_stages):
                    c = nc - 1 - cr
                    ci = c0 + c
                    T.copy(W[ci, ih, :, :], w_s)
                    T.copy(Kd[ci, ih, :, :], kd_s)
                    T.copy(Qg[ci, ih, :, :], qg_s)
                    T.copy(Aqk[ci, ih, :, :], aqk_s)
                    T.copy(Ec[ci, ih, :], ec_s)
                    for i, j in T.Parallel(C, BV):
                        do_s[i, j] = T.if_then_else(bos + c * C + i < eos,
                                                    DO[bos + c * C + i, ih, iv * BV + j], T.cast(0, dtype))
                    T.copy(S_f, S_s)
                    if walk == "reverse":
                        T.copy(S_s, DHs[ci, ih, :, iv * BV : (iv + 1) * BV])
                    # dV' = Aqk^T dO + Kd dS, kept negated for the update below
                    T.gemm(aqk_s, do_s, vn_f, transpose_A=True, clear_accum=True)
                    T.gemm(kd_s, S_s, vn_f)
                    for i, j in T.Parallel(C, BV):
                        vn_f[i, j] = -vn_f[i, j]
                    T.copy(vn_f, vn_s)
                    # dS <- Diag(eC) dS + Qg^T dO - W^T dV'
                    for d, j in T.Parallel(K, BV):
                        S_f[d, j] = S_f[d, j] * ec_s[d]
                    T.gemm(qg_s, do_s, S_f, transpose_A=True)
                    T.gemm(w_s, vn_s, S_f, transpose_A=True)
                T.copy(S_f, DH0[n, ih, :, iv * BV : (iv + 1) * BV])

    return kda_bwd_state


WALKS = ("forward", "reverse", "state_grad")


@functools.lru_cache(maxsize=None)
def build_bwd_state_kernel(H, K, V, chunk_size, dtype, accum_dtype="float32", *, walk,
                           block_k=None, block_v=32, threads=128, num_stages=2):
    """Compile one walk of the backward state stage (T, chunks, N, H dynamic).

    Args:
        H: None (runtime, the default use) or an int to specialise.
        K, V, chunk_size: static sizes; V % block_v == 0; chunk_size a multiple of 16.
        dtype: q/k/v dtype name ("bfloat16" / "float16"); accum_dtype must be "float32".
        walk: "forward" (writes Hs), "reverse" (writes dHs and dH0) or "state_grad" (writes dH0
            only; Hs/dHs untouched and may be [1, H, K, V]). See the module docstring.
        block_v, threads, num_stages (software pipelining of the per-chunk loads): launch knobs;
            block_k unused (common factory signature).
    Returns:
        kernel(W[NC,H,C,K], U[NC,H,C,V], Qg[NC,H,C,K], Kd[NC,H,C,K], Aqk[NC,H,C,C], eC[NC,H,K] f32,
        dO[TT,H,V], Seq[N,4] i32, H0[N,H,K,V] f32, dHT[N,H,K,V] f32, Hs[NCS,H,K,V], dHs[NCS,H,K,V],
        dH0[N,H,K,V] f32); the walk's outputs are written, the arguments it does not read are
        ignored (forward: dO, dHT; reverse: H0).
    Raises:
        ValueError: an unknown walk, V not a multiple of block_v, accum_dtype not float32, or a
            launch that tilelang 0.1.15 miscompiles (:func:`._common.check_state_launch`).
    """
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
    if V % block_v or accum_dtype != "float32":
        raise ValueError(f"V={V} must be a multiple of block_v={block_v} and accum_dtype float32 "
                         f"(got {accum_dtype})")
    check_state_launch(block_v, threads)
    func = _bwd_state_func(H, K, V, chunk_size, tl_dtype(dtype), accum_dtype, block_v, threads, walk,
                           int(num_stages))
    return compile_kernel(func, name="kda_bwd_state")
