"""EXPERIMENT, not part of the package and never run on a GPU: the shared-operand state + output
pass (kda_cp/kernels/state.py) with the output on a second consumer warpgroup.

Warpgroup 0 carries the chain (S -> S_s[c % 2], V' = U - W S -> vn_s[c % 2], S <- eC S + Kd^T V'),
warpgroup 1 computes O = Qg S + Aqk V' from the same double-buffered S_s and vn_s, with named
barriers between them: READY + b (warpgroup 0 arrives after storing chunk c's S_s[b] and vn_s[b]
and a proxy fence; warpgroup 1 waits before its MMAs) and FREE + b (warpgroup 1 arrives after its
MMAs completed; warpgroup 0 waits before overwriting buffer b two chunks later, and for the last
two at the end). The TMA pipeline (T.Pipelined) releases each stage after both warpgroups
finished the chunk. Compiles with tilelang 0.1.15 for sm_90a at block_v 16 and 32 (384 threads:
TMA producer + two consumers, 240 registers each; 190 / 210 KB shared); block_v 64 compiles too
but needs 250 KB with three stages (over the 227 KB limit: it would take num_stages=2). The
generated code keeps each warpgroup's own syncs on separate barrier ids (3 and 4). See
kda_cp/kernels/NOTES.md, thirteenth session, "Probe". Next: time it against state.py's (32, 128)
and (16, 128) on an H200 and compare O and the final state bitwise; the signature has no H0
(start from zero) and always stores HT.

    python docs/experiments/state_ws.py     # compiles block_v 32 for K = V = 128, bf16
"""
import tilelang
import tilelang.language as T

from kda_cp.kernels._common import compile_kernel, tl_dtype

# named barrier ids: READY + b (chain -> output), FREE + b (output -> chain); TileLang takes 1-2
# for reductions and 3, 4, ... for the warpgroups' own syncs, so these stay clear of them
READY, FREE = 12, 14


def func(K, V, C, dtype, BV, num_stages=3):
    Hn = T.dynamic("H")
    TT = T.dynamic("TT")
    NC = T.dynamic("NC")
    N = T.dynamic("N")
    f32 = "float32"

    @T.prim_func
    def kda_state_ws(
        W: T.Tensor([NC, Hn, C, K], dtype),
        U: T.Tensor([NC, Hn, C, V], dtype),
        Qg: T.Tensor([NC, Hn, C, K], dtype),
        Kd: T.Tensor([NC, Hn, C, K], dtype),
        Aqk: T.Tensor([NC, Hn, C, C], dtype),
        Ec: T.Tensor([NC, Hn, K], f32),
        Seq: T.Tensor([N, 4], "int32"),
        O: T.Tensor([TT, Hn, V], dtype),
        HT: T.Tensor([N, Hn, K, V], f32),
    ):
        with T.Kernel(V // BV, Hn, N, threads=256) as (iv, ih, n):
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
            S_s = T.alloc_shared([2, K, BV], dtype)
            vn_s = T.alloc_shared([2, C, BV], dtype)
            o_s = T.alloc_shared([C, BV], dtype)
            T.annotate_layout({o_s: tilelang.layout.make_swizzled_layout(o_s)})
            S_f = T.alloc_fragment([K, BV], f32)
            vn_f = T.alloc_fragment([C, BV], f32)
            o_f = T.alloc_fragment([C, BV], f32)
            tx = T.get_thread_binding()
            if tx < 128:
                T.clear(S_f)
            for c in T.Pipelined(nc, num_stages=num_stages):
                ci = c0 + c
                T.copy(W[ci, ih, :, :], w_s)
                T.copy(U[ci, ih, :, iv * BV : (iv + 1) * BV], u_s)
                T.copy(Qg[ci, ih, :, :], qg_s)
                T.copy(Kd[ci, ih, :, :], kd_s)
                T.copy(Aqk[ci, ih, :, :], aqk_s)
                T.copy(Ec[ci, ih, :], ec_s)
                b = c % 2
                if tx < 128:  # the chain
                    if c >= 2:  # the output warpgroup is done with buffer b (chunk c - 2)
                        T.sync_threads(FREE + b, 256)
                    T.copy(S_f, S_s[b, :, :])
                    T.gemm(w_s, S_s[b, :, :], vn_f, clear_accum=True)
                    for i, j in T.Parallel(C, BV):
                        vn_f[i, j] = T.cast(u_s[i, j], f32) - vn_f[i, j]
                    T.copy(vn_f, vn_s[b, :, :])
                    T.fence_proxy_async()  # the generic-proxy stores before the other warpgroup's wgmma reads
                    T.named_barrier_arrive(READY + b, 256)
                    for d, j in T.Parallel(K, BV):
                        S_f[d, j] = S_f[d, j] * ec_s[d]
                    T.gemm(kd_s, vn_s[b, :, :], S_f, transpose_A=True)
                else:  # the output
                    T.sync_threads(READY + b, 256)
                    T.wgmma_gemm(qg_s, S_s[b, :, :], o_f, clear_accum=True)
                    T.wgmma_gemm(aqk_s, vn_s[b, :, :], o_f)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(o_f, num_regs=C * BV // 128)
                    T.named_barrier_arrive(FREE + b, 256)
                    if eos < bos:  # never true: Qg's and Aqk's last reads after the wait
                        O[bos, ih, iv * BV] = qg_s[0, 0] + aqk_s[0, 0]
                    T.copy(o_f, o_s)
                    for i, j in T.Parallel(C, BV):
                        if bos + c * C + i < eos:
                            O[bos + c * C + i, ih, iv * BV + j] = o_s[i, j]
            if tx < 128:
                for c in T.serial(T.min(nc, 2)):  # the output warpgroup's last two hand-backs
                    T.sync_threads(FREE + (nc - 1 - c) % 2, 256)
                T.copy(S_f, HT[n, ih, :, iv * BV : (iv + 1) * BV])

    return kda_state_ws


def build(K, V, C, dtype, BV):
    return compile_kernel(func(K, V, C, tl_dtype(dtype), BV), name="kda_state_ws")


if __name__ == "__main__":
    try:
        k = build(128, 128, 64, "bfloat16", 32)
        src = k.get_kernel_source()
        open("/tmp/state_ws.cu", "w").write(src)
        print("compiled")
    except Exception as e:
        print("FAILED", type(e).__name__, str(e)[-3000:])
