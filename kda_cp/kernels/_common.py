"""Shared helpers for the TileLang KDA kernels: targets, dtype names, chunk tables.

Nothing here launches a kernel. Kernels index tokens through a *chunk table* so that fixed-length
batches and packed sequences (``cu_seqlens``) run through the same code:

    table[c] = (bos_c, eos_c)   int32
        bos_c: first token (row of the flattened [B*T] token axis) of chunk c
        eos_c: one past the last token of the sequence that chunk c belongs to

A chunk covers tokens [bos_c, min(bos_c + chunk_size, eos_c)); rows past eos_c are read as zero
(k = q = v = 0, g = 0, beta = 0), which makes them inert in every stage. Chunks of one sequence are
consecutive in the table; ``seq_chunks[n] = (first chunk, number of chunks, bos)`` describes sequence n.
"""
from __future__ import annotations

import collections
import functools
import os
import weakref
from typing import NamedTuple

import torch

TARGET = {"kind": "cuda", "arch": "sm_90a"}
SUB = 16  # sub-chunk length: exp(+-gamma) over 16 steps of g >= -5 stays below e^80

#: The general-gate kernels (any g <= 0, ``g_min=None``) raise each step to this floor before the
#: chunk-local cumsum: log(fp32 eps) - 20, kda_cp.reference.decay_floor(torch.float32), so that one
#: huge step cannot erase the small ones from the fp32 cumsum. A no-op for bounded gates.
GENERAL_FLOOR = -35.94238515

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def tl_dtype(dtype: torch.dtype | str) -> str:
    """Map a torch dtype (or a TileLang dtype name) to the TileLang dtype name."""
    if isinstance(dtype, str):
        return dtype
    try:
        return _TORCH_TO_TL[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {list(_TORCH_TO_TL)}") from None


def compile_kernel(func, *, name: str, fast_math: bool = False):
    """Compile a prim_func for Hopper (sm_90a). TileLang's disk cache (TILELANG_CACHE_DIR) applies.

    fast_math: nvcc --use_fast_math (TileLang's tl.enable_fast_math). Taken by the kernels that
    compute an exponential per element (the chunk-local forward, the decayed-q/k kernel, the
    backward's "ut" and "dk"), which have no division, square root or log: exp2f becomes one
    ex2.approx.ftz instead of ex2.approx with a fix-up for results below 2^-126, and every fp32
    add, multiply and fma flushes subnormals to zero (-ftz=true): values under e^-87 next to terms
    of order one. About 5% faster for those kernels; outputs differ from the exact-denormal build
    by under 1e-33 relative.
    """
    import tilelang

    return tilelang.compile(func, target=TARGET,
                            pass_configs={"tl.enable_fast_math": True} if fast_math else None)


class ChunkTables(NamedTuple):
    """Index tables on the device.

    chunk_table: [NC, 2] int32, (bos, eos) per chunk (see module docstring).
    seq_table:   [N, 4] int32, (first chunk, number of chunks, bos, eos) per sequence.
    num_chunks:  NC (host int).
    """

    chunk_table: torch.Tensor
    seq_table: torch.Tensor
    num_chunks: int


_KNOWN_OFFSETS: dict[int, tuple] = {}  # id(tensor) -> (weakref, version, offsets), tensors made here
_DEVICE_OFFSETS: collections.OrderedDict = collections.OrderedDict()  # (offsets, device, inference) -> tensor


def _version(t: torch.Tensor):
    return None if t.is_inference() else t._version  # inference tensors keep no version counter


def remember_offsets(cu_seqlens: torch.Tensor, offsets) -> None:
    """Record the host values of an offsets tensor that this library made from them, so that
    :func:`host_offsets` does not read it back from the device. Only for such tensors: a caller's
    tensor can change without a version bump (e.g. a collective writing into it)."""
    key = id(cu_seqlens)
    ref = weakref.ref(cu_seqlens, lambda _r, key=key: _KNOWN_OFFSETS.pop(key, None))
    _KNOWN_OFFSETS[key] = (ref, _version(cu_seqlens), tuple(int(x) for x in offsets))


def host_offsets(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple of host ints: the recorded values of a tensor made by
    :func:`device_offsets` (unless modified in place since), else read from the device (a sync)."""
    hit = _KNOWN_OFFSETS.get(id(cu_seqlens))
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == _version(cu_seqlens):
        return hit[2]
    return tuple(cu_seqlens.detach().to("cpu", torch.int64).tolist())


def device_offsets(offsets, device) -> torch.Tensor:
    """Host offsets as an int64 tensor on ``device`` with its host values recorded: made once per
    (offsets, device) and reused while unmodified (a copy to the GPU waits for the stream)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (tuple(int(x) for x in offsets), str(device), torch.is_inference_mode_enabled())
    cu = _DEVICE_OFFSETS.get(key)
    if cu is not None and _KNOWN_OFFSETS.get(id(cu), (None, -1))[1] == _version(cu):
        _DEVICE_OFFSETS.move_to_end(key)
        return cu
    cu = torch.tensor(key[0], dtype=torch.int64, device=device)
    remember_offsets(cu, key[0])
    _DEVICE_OFFSETS[key] = cu
    if len(_DEVICE_OFFSETS) > 256:
        _DEVICE_OFFSETS.popitem(last=False)
    return cu


def build_chunk_tables(
    B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int, device: torch.device
) -> ChunkTables:
    """Build the chunk and sequence tables for B sequences of length T, or for packed ``cu_seqlens``.

    With ``cu_seqlens`` the offsets come from :func:`host_offsets` (no device read for the
    tensors that kda_cp's ops pass). Tables are cached per (B, T, offsets, chunk_size, device): a
    call's stages share them.
    """
    offsets = None if cu_seqlens is None else host_offsets(cu_seqlens)
    return _tables(B, T, offsets, chunk_size, str(device))


@functools.lru_cache(maxsize=64)
def _tables(B: int, T: int, offsets: tuple[int, ...] | None, chunk_size: int, device: str) -> ChunkTables:
    if offsets is None:
        starts = [b * T for b in range(B)]
        lens = [T] * B
    else:
        cu = list(offsets)
        starts = cu[:-1]
        lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    chunks: list[tuple[int, int]] = []
    seqs: list[tuple[int, int, int, int]] = []
    for s, n in zip(starts, lens):
        nc = (n + chunk_size - 1) // chunk_size
        seqs.append((len(chunks), nc, s, s + n))
        chunks.extend((s + i * chunk_size, s + n) for i in range(nc))
    if not chunks:  # every sequence empty: keep a valid (never launched) shape
        chunks = [(0, 0)]
    ct = torch.tensor(chunks, dtype=torch.int32).to(device)
    st = torch.tensor(seqs, dtype=torch.int32).to(device)
    return ChunkTables(ct, st, len(chunks))


def cache_dir_hint() -> str | None:
    return os.environ.get("TILELANG_CACHE_DIR")


def tf32_hi(x):
    """The TF32 head of an fp32 TileLang expression: x with its low 13 mantissa bits cleared.

    x = tf32_hi(x) + (x - tf32_hi(x)) exactly; the 3xTF32 product a b ~ a_hi b_hi + a_hi b_lo +
    a_lo b_hi then carries about fp32 accuracy (relative error ~1e-6) on TF32 tensor cores.
    """
    import tilelang.language as T

    return T.reinterpret(T.bitwise_and(T.reinterpret(x, "uint32"), T.uint32(0xFFFFE000)), "float32")


def sub_chunk_ref(gam_s, I, d):
    """r_I = gamma[SUB * I - 1] of key channel d, 0 for I = 0: the reference of sub-chunk I (a
    TileLang loop variable) in the kernels' exponent splits, read from the cumsum tile gam_s [C, *].

    Masked by a multiply, not a select: TVM simplifies the index of a select's taken branch under
    its condition (max(SUB I - 1, 0) -> SUB I - 1) while CUDA evaluates both branches, so a select
    read gam_s[-1] for I = 0 (outside the tile; the value was discarded).
    """
    import tilelang.language as T

    return gam_s[T.max(SUB * I - 1, 0), d] * T.cast(T.min(I, 1), "float32")


def row_scan_macro(C: int, ncols: int, threads: int, gate_min: float | None = None, floor: float | None = None):
    """A TileLang macro ``row_scan(gam_s, bos, eos)``: the inclusive cumsum over the C rows of each
    of the first ``ncols`` columns of the shared fp32 tile gam_s (in place), rows past the sequence
    end (bos + i >= eos) taken as 0. ``floor`` (the general gate: GENERAL_FLOOR) raises each step
    to at least that value first.

    With ``gate_min`` set the macro is ``row_scan(gam_s, bos, eos, z_s, a, bias, ih)`` and scans
    the gate g = gate_min * sigmoid(a * (z + bias[ih, d])) of the pre-activation tile z_s (C x
    ncols, any float dtype) instead of gam_s's contents: a = exp(A_log) of head ih, bias the fp32
    dt_bias buffer [H, K]. The gate is computed in the registers that load the
    scan, so g itself is never stored.

    Every thread of the block takes part: the column is cut into parts of SUB rows; thread t takes
    column t % ncols and the parts t // ncols, t // ncols + threads / ncols, ... (``threads`` must
    be a multiple of ``ncols``: ValueError). A thread loads its part into registers (independent
    loads), adds in a register chain, and publishes the part's total; after a barrier it adds the
    totals of the parts above, summed in part order, and stores the part back. The partition does
    not depend on ``threads``, so every kernel using this macro computes the same bits. One thread
    per column scanning all C rows would leave the other threads waiting at the next barrier."""
    import tilelang.language as T

    if gate_min is not None and floor is not None:
        raise ValueError("floor is for a scan of g itself, not of the bounded gate's pre-activation")
    if C % SUB or threads % ncols:
        raise ValueError(f"chunk_size must be a multiple of {SUB} and threads of the columns, got "
                         f"chunk_size={C}, threads={threads}, columns={ncols}")
    NP = C // SUB  # parts per column
    PT = threads // ncols  # threads per column
    MI = -(-NP // PT)  # parts per thread

    LOG2E = 1.4426950408889634

    def load(gam_s, z_s, i, d, a, b):
        if gate_min is None:
            return gam_s[i, d] if floor is None else T.max(gam_s[i, d], T.float32(floor))
        x = a * (T.cast(z_s[i, d], "float32") + b)
        return T.float32(gate_min) / (T.float32(1) + T.exp2(-x * LOG2E))

    @T.macro
    def row_scan(gam_s, bos, eos, z_s=None, a=None, bias=None, ih=None):
        tx = T.get_thread_binding()
        d = tx % ncols
        part_s = T.alloc_shared([NP, ncols], "float32")
        acc = T.alloc_local([MI * SUB], "float32")
        b = T.float32(0)
        if gate_min is not None:
            b_l = T.alloc_local([1], "float32")
            b_l[0] = bias[ih, d]
            b = b_l[0]
        for m in T.unroll(MI):
            p = tx // ncols + m * PT
            if p < NP:
                for r in T.unroll(SUB):
                    acc[m * SUB + r] = T.if_then_else(bos + p * SUB + r < eos, load(gam_s, z_s, p * SUB + r, d, a, b),
                                                      T.float32(0))
                for r in T.unroll(1, SUB):
                    acc[m * SUB + r] = acc[m * SUB + r - 1] + acc[m * SUB + r]
                part_s[p, d] = acc[m * SUB + SUB - 1]
        T.sync_threads()
        for m in T.unroll(MI):
            p = tx // ncols + m * PT
            if p < NP:
                off = T.float32(0)
                for pp in tuple(range(NP - 1)):  # the parts above, in part order (unrolled here)
                    off = off + T.if_then_else(pp < p, part_s[pp, d], T.float32(0))
                for r in T.unroll(SUB):
                    gam_s[p * SUB + r, d] = acc[m * SUB + r] + off

    return row_scan


def pairwise_macro(K: int, with_q: bool):
    """A TileLang macro ``pairwise(I, gam_s, k_s, q_s, out_s)``: the own 16 x 16 block of sub-chunk I
    (a loop variable) of the decayed products, summed pair by pair for the general gate (any g <= 0),
    where the anchored split's column factor exp(r_I - gamma_j) would be unbounded:

        out_s[r, j]      = sum_d k_i[d] k_j[d] exp(min(gamma_i[d] - gamma_j[d], 0))
        out_s[16 + r, j] = sum_d q_i[d] k_j[d] exp(min(gamma_i[d] - gamma_j[d], 0))   (with_q)

    i = 16 I + r, j' = 16 I + j, for j <= r (the min is then a no-op), and 0 for j > r; every
    (r, j) is written (fp32). The caller keeps j < r (K K^T) or j <= r (Q K^T). The block's rows (gamma, k, q) are read once into
    registers; then per column j, every thread forms the terms of its (row, channel) elements (a
    vector load of gamma_j and k_j, broadcast over rows) and a warp reduction over the channels
    gives column j of every row. gam_s [C, >= K] fp32; k_s, q_s [C, >= K] any float dtype; q_s
    unused without with_q.
    """
    import tilelang.language as T

    LOG2E = 1.4426950408889634
    f32 = "float32"

    @T.macro
    def pairwise(I, gam_s, k_s, q_s, out_s):
        gi = T.alloc_fragment([SUB, K], f32)
        ki = T.alloc_fragment([SUB, K], f32)
        pk = T.alloc_fragment([SUB, K], f32)
        sk = T.alloc_fragment([SUB], f32)
        if with_q:
            qi = T.alloc_fragment([SUB, K], f32)
            pq = T.alloc_fragment([SUB, K], f32)
            sq = T.alloc_fragment([SUB], f32)
        for r, d in T.Parallel(SUB, K):
            gi[r, d] = gam_s[SUB * I + r, d]
            ki[r, d] = T.cast(k_s[SUB * I + r, d], f32)
            if with_q:
                qi[r, d] = T.cast(q_s[SUB * I + r, d], f32)
        for j in T.serial(SUB):
            for r, d in T.Parallel(SUB, K):
                # a branch, not a select: where a warp's row lies before column j (the pairs that
                # the caller drops) the warp skips the exponentials
                if j <= r:
                    t = T.cast(k_s[SUB * I + j, d], f32) * T.exp2(
                        T.min(gi[r, d] - gam_s[SUB * I + j, d], T.float32(0)) * LOG2E)
                    pk[r, d] = ki[r, d] * t
                    if with_q:
                        pq[r, d] = qi[r, d] * t
                else:
                    pk[r, d] = T.float32(0)
                    if with_q:
                        pq[r, d] = T.float32(0)
            T.reduce_sum(pk, sk, dim=1)
            if with_q:
                T.reduce_sum(pq, sq, dim=1)
            for r in T.Parallel(SUB):
                out_s[r, j] = sk[r]
                if with_q:
                    out_s[SUB + r, j] = sq[r]

    return pairwise


def block_rows_macro(C: int, threads: int, beta_scaled: bool = False):
    """A TileLang macro ``block_rows(L_s, X_s, Td_s, tmp_s, beta_s=None)``: the block rows of the blocked
    triangular solve X = (I + A)^-1 (C x C, fp32 in shared memory), once the 16 x 16 diagonal blocks
    X_II are in X_s and in Td_s[I]: for I >= 1, X[I, :I] = X_II (-A[I, :I] X[:I, :I]), with
    A = L_s, or A = Diag(beta) L_s when ``beta_scaled`` (beta_s [C] fp32, given only then).
    G = threads / 16 threads own each row of a block row, each summing 16 I / G of its columns at
    once (one load of A or X_II serves them); `threads` must be 16 times a divisor of 16
    (ValueError). Several columns per thread share each load, where one sum per thread would take
    two shared loads per FMA."""
    import tilelang.language as T

    G = threads // SUB
    if threads % SUB or G > SUB or SUB % G:
        raise ValueError(f"threads must be {SUB} times a divisor of {SUB} (the solve), got {threads}")

    @T.macro
    def block_rows(L_s, X_s, Td_s, tmp_s, beta_s=None):
        tx = T.get_thread_binding()
        r = tx // G
        c0 = tx % G
        for I in tuple(range(1, C // SUB)):
            M = SUB * I // G
            a = T.alloc_local([M], "float32")
            for m in T.unroll(M):
                a[m] = T.float32(0)
            for j in T.serial(SUB * I):
                for m in T.unroll(M):
                    a[m] = a[m] - L_s[SUB * I + r, j] * X_s[j, c0 + G * m]
            for m in T.unroll(M):
                if beta_scaled:
                    tmp_s[r, c0 + G * m] = a[m] * beta_s[SUB * I + r]
                else:
                    tmp_s[r, c0 + G * m] = a[m]
            for m in T.unroll(M):
                a[m] = T.float32(0)
            for j in T.serial(SUB):
                for m in T.unroll(M):
                    a[m] = a[m] + Td_s[I, r, j] * tmp_s[j, c0 + G * m]
            for m in T.unroll(M):
                X_s[SUB * I + r, c0 + G * m] = a[m]

    return block_rows


#: (block_v, threads) launches of the state + output pass, widest first; state_launch picks one.
#: (64, 128) is the register-operand form (state.py), the others keep S and V' in shared memory.
#: Not (64, 256): tilelang 0.1.15 miscompiles it (see check_state_launch).
STATE_LAUNCHES = ((64, 128), (32, 128), (16, 128))

#: Measured time of one chunk step of each launch (microseconds, H200, K = V = 128, bf16, one block
#: per SM): the pass alone, `python scripts/tune_launches.py --kernels state+output`
#: (docs/results/h200_tune_launches.json): (64, 128) 0.633 ms / 512 steps at S1, (32, 128)
#: 0.506 ms / 512 at S1, (16, 128) 1.543 ms / 2048 at S3.
STATE_STEP_US = {(64, 128): 1.24, (32, 128): 0.99, (16, 128): 0.75}


def check_state_launch(block_v: int, threads: int) -> None:
    """Refuse a launch of the state passes (state.py, bwd_state.py) known to be miscompiled by
    tilelang 0.1.15 (the version this package pins).

    With two or more warpgroups splitting the value columns 32 per warpgroup (block_v 64 on 256
    threads), the state update's result is wrong from the second chunk on (relative RMS error 0.2 to
    0.45 in o on an H200, columns 16-31 of each warpgroup's 32 worst). Measured exact: (32, 256) (16 columns per warpgroup) and one warpgroup (128 threads)
    with block_v 16, 32 or 64. Wider splits over several warpgroups were never measured and are
    refused with the miscompiled one. Measured on the forward's state + output pass; the backward's
    state walks run the same GEMMs and are refused too.

    Raises:
        ValueError: for more than 16 value columns per warpgroup on two or more warpgroups.
    """
    if threads > 128 and block_v * 128 > 16 * threads:
        raise ValueError(f"block_v={block_v} with threads={threads} ({block_v * 128 // threads} value columns "
                         f"per warpgroup): 32 per warpgroup is miscompiled by tilelang 0.1.15 and wider "
                         f"splits are unmeasured; use at most 16 columns per warpgroup "
                         f"(block_v <= 16 * threads / 128) or threads=128")


def state_launch(sms: int, N: int, H: int, V: int) -> tuple[int, int]:
    """(block_v, threads) for the state + output pass of N sequences and H heads on `sms` SMs.

    Each block walks all chunks of its sequence in order, and every offered launch runs one block
    per SM (240 registers a thread), so the pass takes about waves x chunks x (time of one chunk
    step), waves = ceil(V / block_v * N * H / sms). Wider blocks take longer a step but are fewer.
    The rule: the launch of STATE_LAUNCHES with the least waves x STATE_STEP_US (the widest on a
    tie; the step times were measured at K = V = 128, bf16, and serve K = 64 and fp16 too). H200,
    K = V = 128: T = 32768, H = 32 (S1): (32, 128), 0.51 ms against (64, 128) 0.63 and (16, 128)
    0.77 (two waves); B = 8, T = 4096, H = 32 (S2): (64, 128), 0.40 ms against 0.53 and 0.79;
    T = 131072, H = 16 (S3): (16, 128), 1.54 ms against 1.97 and 2.47
    (docs/results/h200_tune_launches.json; each a median of 10, three times).
    """
    best = None
    for launch in STATE_LAUNCHES:
        block_v = launch[0]
        if V % block_v:
            continue
        cost = -(-(V // block_v) * N * H // max(sms, 1)) * STATE_STEP_US[launch]
        if best is None or cost < best[0]:
            best = (cost, launch)
    return best[1] if best else STATE_LAUNCHES[-1]  # V not a multiple of 16: the builder raises
