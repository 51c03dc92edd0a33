"""Every TileLang kernel lowers and compiles for Hopper (sm_90a) with the local nvcc (no GPU needed).

Marker ``compile``. Skipped when tilelang or nvcc is absent. Builds each of the four kernel factories
at representative launch configs (K = V in {64, 128}, bf16 and fp16, with/without initial and final
state) and checks the instruction choice in the generated CUDA: wgmma for the bf16/fp16 GEMMs of
the forward, and only TF32 MMAs on split fp32 data (3xTF32) in the summary, never a 16-bit GEMM;
and, in the summary's loop of asynchronous MMAs, the barriers, proxy fences and waits that keep its
shared-memory operand stores from racing the other warpgroup's MMAs.
About 5 minutes on 2 CPU cores (the chunk-local kernels take ~100 s each to compile there).
"""
import re
import shutil

import pytest
from tests._utils import (NEGATIVE_GAM_OFFSET, assert_async_mma_order, assert_released_after_wait, async_mma_events,
                          loop_headers, loop_text, mma_loop)

pytestmark = [pytest.mark.compile, pytest.mark.slow]

tilelang = pytest.importorskip("tilelang")
if shutil.which("nvcc") is None:
    pytest.skip("nvcc not found", allow_module_level=True)

from kda_cp.kernels.intra import build_decay_kernel, build_intra_kernel, build_intra_summary_kernel  # noqa: E402
from kda_cp.kernels._common import STATE_LAUNCHES  # noqa: E402
from kda_cp.kernels.state import build_state_output_kernel, build_summary_kernel  # noqa: E402


@pytest.mark.parametrize("K,dtype", [(128, "bfloat16"), (64, "float16")])
def test_intra_compiles(K, dtype):
    src = build_intra_kernel(None, K, K, 64, dtype, scale=K ** -0.5).get_kernel_source()
    assert "wgmma" in src, "W/U GEMMs did not lower to wgmma"
    # the sub-chunk row blocks stay loops: unrolled, the kernel stalled on instruction fetch (2.4x
    # slower); two loops, the first half of the row blocks over the first half of the columns (their
    # sub-chunks: one m16n8 MMA tile per warp instead of two; S1 on an H200 1.375 -> 1.340 ms)
    assert len(loop_headers(src, "I", 2)) == 2
    assert src.count("tl::mma_sync<") == 3
    assert not NEGATIVE_GAM_OFFSET.search(src), "a read of gam_s before its start (row I*16 - 1 for I = 0)"
    # W and U leave through shared memory by TMA (the fragment's 4-byte stores were 11% of the
    # stall samples), and Akk and Aqk of a row block come from one MMA (two 16-row A operands had
    # each of the 8 warps load a whole A): S1 on an H200 1.51 -> 1.39 ms, same bits
    assert src.count("tl::tma_store(") == 2
    # g, k, q and v come in by TMA, issued by one thread (per-thread loads with a row predicate each:
    # address arithmetic was 9% of the instructions, and the scan waited for all of them; S1 on an
    # H200 1.31 -> 1.10 ms, same bits); the scan waits for g alone
    for desc in ("G_desc", "Kx_desc", "Q_desc", "Vx_desc"):
        assert f"tl::tma_load({desc}," in src, desc
    for name in ("G", "Kx", "Q", "Vx"):  # no per-thread global loads of them, vector or scalar
        assert f"({name} +" not in src and f"{name}[" not in src, name
    assert src.index("bar_g[0].wait(0)") < src.index("bar_kq[0].wait(0)") < src.index("bar_v[0].wait(0)")
    assert "kqp_s" in src and "kp_s" not in src.replace("kqp_s", "")


def _shared_bytes(src):
    """The end of the last dynamic shared-memory buffer of a kernel's source (its footprint)."""
    C, K, bf, f4 = 64, 128, 2, 4  # the chunk-local kernel's tiles at K = V = 128 (kda_cp/kernels/intra.py)
    sizes = {"gam_s": C * K * f4, "k_s": C * K * bf, "q_s": C * K * bf, "beta_s": C * f4, "kqp_s": 32 * K * bf,
             "km_s": C * K * bf, "L_s": C * (C + 8) * f4, "Ti_s": C * C * f4, "Td_s": 4 * 16 * 16 * f4,
             "tmp_s": 16 * C * f4, "Ti_c": C * C * bf, "vb_s": C * K * bf, "wo_s": C * K * bf, "uo_s": C * K * bf,
             "part_s": 4 * K * f4, "pw_s": 32 * 16 * f4}
    offs = re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src)
    assert offs and {n for n, _ in offs} <= set(sizes), [n for n, _ in offs if n not in sizes]
    return max(int(o) + sizes[n] for n, o in offs)


def test_intra_with_the_gate_inside_compiles():
    """use_gate_in_kernel's chunk-local kernel: z (bf16) arrives by TMA in place of the fp32 g, the
    gate is computed in the scan's loads (g never written), beta's sigmoid in its load, and the
    shared-memory footprint stays that of the plain kernel's order (two blocks per SM: at most
    113 KiB each; a separate z tile took 124 KiB)."""
    scale = 128 ** -0.5
    src = build_intra_kernel(None, 128, 128, 64, "bfloat16", scale=scale, gate_min=-5.0, beta_scale=1.0
                             ).get_kernel_source()
    plain = build_intra_kernel(None, 128, 128, 64, "bfloat16", scale=scale).get_kernel_source()
    assert "tl::tma_load(Z_desc," in src and "G_desc" not in src
    assert "Alog[" in src and "Bias[" in src
    assert src.count("tl::mma_sync<") == 3 and "wgmma" in src
    assert _shared_bytes(src) <= 113 * 1024, _shared_bytes(src)
    assert _shared_bytes(plain) <= 113 * 1024
    with pytest.raises(ValueError, match="bf16"):
        build_intra_kernel(None, 128, 128, 64, "float16", scale=scale, gate_min=-5.0)
    with pytest.raises(ValueError, match="beta_scale"):
        build_intra_kernel(None, 128, 128, 64, "bfloat16", scale=scale, beta_scale=1.0)


FLOOR = "/*-3.594239e+01*/"  # GENERAL_FLOOR as TileLang prints it


def test_general_gate_kernels_compile():
    """g_min=None (any g <= 0): the chunk-local, summary and decayed-q/k kernels floor each step at
    GENERAL_FLOOR in the scan (the decay kernel as the chunk-local one, so their Qg, Kd stay bitwise
    equal), sum the own sub-chunk blocks pairwise, and the chunk-local kernel keeps its two blocks
    per SM (at most 113 KiB of shared memory) and its MMAs. The bounded kernels carry no floor."""
    scale = 128 ** -0.5
    fwd = build_intra_kernel(None, 128, 128, 64, "bfloat16", scale=scale, general=True).get_kernel_source()
    assert fwd.count(FLOOR) == 1 and "pw_s" in fwd
    # the own blocks' sums over the channels are warp reductions (no shared-memory workspace)
    reduces = re.findall(r"AllReduce<tl::SumOp, (\d+), (\d+)", fwd)
    assert reduces and all(int(n) <= 32 and s == "1" for n, s in reduces), reduces
    assert fwd.count("tl::mma_sync<") == 3 and "wgmma" in fwd
    assert _shared_bytes(fwd) <= 113 * 1024, _shared_bytes(fwd)
    assert not NEGATIVE_GAM_OFFSET.search(fwd)
    for src in (build_intra_summary_kernel(None, 128, 128, 64, "bfloat16", general=True).get_kernel_source(),
                build_decay_kernel(None, 128, 64, "bfloat16", scale=scale, general=True).get_kernel_source()):
        assert src.count(FLOOR) == 1
    assert FLOOR not in build_intra_kernel(None, 128, 128, 64, "bfloat16", scale=scale).get_kernel_source()
    with pytest.raises(ValueError, match="general"):
        build_intra_kernel(None, 128, 128, 64, "bfloat16", scale=scale, gate_min=-5.0, general=True)
    small = build_intra_kernel(None, 64, 64, 64, "float16", scale=0.125, general=True).get_kernel_source()
    assert small.count(FLOOR) == 1 and "pw_s" in small  # K = 64, fp16: 16-lane reductions


@pytest.mark.parametrize("K,dtype", [(128, "bfloat16"), (64, "float16")])
def test_decay_kernel_compiles(K, dtype):
    """The backward's remake of Qg, Kd (the forward keeps W, U, Aqk, eC only)."""
    src = build_decay_kernel(None, K, 64, dtype, scale=K ** -0.5).get_kernel_source()
    assert "float acc[64];" in src, "the gate scan adds in registers (a chain of shared-memory round trips was slower)"


def test_exponential_kernels_compile_with_fast_math():
    """The kernels with an exponential per element compile with nvcc fast math (one ex2.approx.ftz
    per exponential; S1 on an H200: chunk-local forward 1.62 -> 1.53 ms, "dk" 2.11 -> 2.02), the
    state passes without. The backward's decayed-q/k kernel must remake the chunk-local kernel's
    Qg and Kd bitwise, so the two must compile alike."""
    from kda_cp.kernels.bwd_intra import build_bwd_dk_kernel, build_bwd_ut_kernel

    K, dt, scale = 128, "bfloat16", 128 ** -0.5
    fast = {"tl.enable_fast_math": True}
    for ker in (build_intra_kernel(None, K, K, 64, dt, scale=scale), build_decay_kernel(None, K, 64, dt, scale=scale),
                build_bwd_ut_kernel(None, K, K, 64, dt), build_bwd_dk_kernel(None, K, 64, dt, scale=scale)):
        assert ker.pass_configs == fast
    launch = STATE_LAUNCHES[0]
    state = build_state_output_kernel(None, K, K, 64, dt, with_h0=True, store_ht=True, block_v=launch[0],
                                      threads=launch[1])
    assert not (state.pass_configs or {}).get("tl.enable_fast_math")


@pytest.mark.parametrize("K,dtype,with_h0,store_ht,launch", [
    (128, "bfloat16", True, True, (64, 128)), (128, "bfloat16", False, False, (16, 128)),
    (128, "bfloat16", True, False, (16, 128)), (64, "float16", True, False, (64, 128)),
    (64, "bfloat16", False, True, (64, 128)), (128, "float16", False, True, (32, 256)),
    (128, "bfloat16", True, True, (32, 128)), (64, "float16", False, False, (32, 128))])
def test_state_output_compiles(K, dtype, with_h0, store_ht, launch):
    """Every offered launch (and the shared-operand (32, 256), which the builder still accepts).
    (64, 128) is the register-operand form: S^T and V'^T are the A operands of register-sourced
    MMAs and never stored to shared memory, which holds only the TMA-fed tiles and O^T on its way
    out; no division by the runtime head count (a grid axis per index: the output's per-element
    addresses had one, which cost a third of the pass); O stored from a shared tile in 16-byte
    rows, and the shared-operand form pipelined three chunks deep."""
    assert launch in STATE_LAUNCHES or launch == (32, 256)
    block_v, threads = launch
    src = build_state_output_kernel(None, K, K, 64, dtype, with_h0=with_h0, store_ht=store_ht, block_v=block_v,
                                    threads=threads).get_kernel_source()
    assert "wgmma" in src
    # the output's Qg S issued behind W S, the warpgroup waiting for W S alone (S1: shared-operand
    # form 0.59 -> 0.56 ms; register-operand form 0.76 -> 0.68 ms, on an H200)
    assert src.count("tl::wait_wgmma<1>();") == 1
    # a grid axis per index: no 64-bit division by the runtime head count in the per-element
    # addresses (in the register-operand form's output stores they cost a third of the pass)
    assert "((int64_t)H)" not in src.replace("* ((int64_t)H)", "")
    shared = set(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem", src))
    # O leaves through a shared tile in 16-byte rows (from the fragment: 4-byte pieces, a fifth of
    # the shared-operand pass at S1 on an H200)
    assert "o_s" in shared and "*(uint4*)(O + " in src
    if launch == (64, 128):
        assert src.count("tl::wgmma_rs<") == 4 and "tl::wgmma_ss<" not in src
        assert shared == {"w_s", "u_s", "qg_s", "kd_s", "aqk_s", "ec_s", "o_s"}
        assert_released_after_wait(src, mma_loop(src))
    else:  # three chunks of the TMA-fed tiles in flight (two: the next chunk's loads were late)
        loop = loop_text(src, mma_loop(src))
        assert re.search(r"\bc(?:_\d+)? % 3", loop) and not re.search(r"\bc(?:_\d+)? & 1", loop)


@pytest.mark.parametrize("K,launch", [(128, (32, 256)), (64, (16, 128)), (128, (64, 128))])
def test_state_output_releases_tiles_after_its_mmas(K, launch):
    """Both forms of the state + output pass issue W S and Qg S together (the register-operand form:
    S^T W^T and S^T Qg^T) and wait for the first only (wait<1>), then the state update and Aqk V'
    and wait once for all: each pipelined tile goes back to the TMA producer only after the MMAs
    that read it completed (W not before the wait<1>; Kd, Qg, Aqk not before the last wait), the
    V' accumulator read only after the wait<1> and the accumulators only after the last wait
    (operand fences right behind each wait), and (shared-operand form) V' and the next chunk's
    state stored into shared memory only when no pending MMA reads them."""
    block_v, threads = launch
    src = build_state_output_kernel(None, K, K, 64, "bfloat16", with_h0=True, store_ht=True, block_v=block_v,
                                    threads=threads).get_kernel_source()
    assert src.count("wait_wgmma<0>") == 1
    after_wait = src[src.index("wait_wgmma<0>();"):].splitlines()[1:3]
    assert all("warpgroup_fence_operand" in line for line in after_wait), \
        "reads of the accumulators must stay after the wait (operand fences)"
    after_partial = src[src.index("wait_wgmma<1>();"):].splitlines()[1]
    assert "warpgroup_fence_operand" in after_partial and "vn_f" in after_partial, \
        "V' must be read only after the wait for its MMA (operand fence)"
    assert_released_after_wait(src, mma_loop(src))


@pytest.mark.parametrize("early", ["mbarrier[3].arrive();", "mbarrier[3].arrive(0, p);", "tl::mbarrier_arrive(b);",
                                   "((bfloat16_t*)vn_s)[i] = x;", "*(uint4*)(((half_t*)vn_s) + i) = x;",
                                   "tl::ptx_stmatrix_m8n8_x4(a, b, c, d, e);"])
def test_release_check_catches_an_early_release(early):
    header = "for (int c_1 = 0; c_1 < n; ++c_1) {"
    loop = header + "\n  tl::warpgroup_arrive();\n  tl::warpgroup_commit_batch();\n  {}\n  tl::wait_wgmma<0>();\n}}\n"
    with pytest.raises(AssertionError, match="may still read"):
        assert_released_after_wait(loop.replace("{}", early, 1).replace("}}", "}"), header)
    late = loop.replace("  {}\n  tl::wait_wgmma<0>();", "  tl::wait_wgmma<0>();\n  " + early).replace("}}", "}")
    assert_released_after_wait(late, header)


def test_release_check_follows_partial_waits():
    """wait<1> completes all but the last MMA group: a tile read only by the completed group may be
    handed back (its release barrier read off the producer's wait before the TMA load into it), a
    tile the pending group reads may not, nor a tile before the MMA that reads it, nor a barrier
    the producer does not name."""
    producer = "\n".join([
        "for (int c = 0; c < n; ++c) {",
        "  mbarrier[((c & 1) + 4)].wait((((c & 3) >> 1) ^ 1));",
        "  tl::tma_load(W_desc, mbarrier[(c & 1)], (&(((bfloat16_t*)w_s)[((c & 1) * 8192)])), 0, 0);",
        "  mbarrier[((c & 1) + 6)].wait((((c & 3) >> 1) ^ 1));",
        "  tl::tma_load(Qg_desc, mbarrier[((c & 1) + 2)], (&(((bfloat16_t*)qg_s)[((c & 1) * 8192)])), 0, 0);",
        "}"])
    header = "for (int c_1 = 0; c_1 < n; ++c_1) {"
    loop = "\n".join([
        header,
        "  mbarrier[(c_1 & 1)].wait(p);",
        "  mbarrier[((c_1 & 1) + 2)].wait(p);",
        "  tl::initialize_wgmma_descriptor<1, 1, 64>(desc_a, (&(((bfloat16_t*)w_s)[0])));",
        "  tl::warpgroup_arrive();",
        "  tl::warpgroup_commit_batch();",
        "  {}",
        "  tl::initialize_wgmma_descriptor<1, 1, 64>(desc_b, (&(((bfloat16_t*)qg_s)[0])));",
        "  tl::warpgroup_arrive();",
        "  tl::warpgroup_commit_batch();",
        "  tl::wait_wgmma<1>();",
        "  [}",
        "  tl::wait_wgmma<0>();",
        "}"])

    def check(early="", late=""):
        assert_released_after_wait(producer + "\n" + loop.replace("{}", early).replace("[}", late), header)

    check(late="mbarrier[((c_1 & 1) + 4)].arrive();")  # w_s: its group is done
    check(late="((bfloat16_t*)vn_s)[i] = x;")  # read by no pending group
    for late in ("mbarrier[((c_1 & 1) + 6)].arrive();", "((bfloat16_t*)qg_s)[i] = x;", "mbarrier[5].arrive();",
                 "tl::ptx_stmatrix_m8n8_x4(a, b, c, d, e);"):
        with pytest.raises(AssertionError, match="may still read"):
            check(late=late)
    with pytest.raises(AssertionError, match="before the MMA"):  # qg_s handed back before Qg S issues
        check(early="mbarrier[((c_1 & 1) + 6)].arrive();")


@pytest.mark.parametrize("K,dtype,operands", [(128, "bfloat16", "bf16x2"), (64, "bfloat16", "bf16x2"),
                                              (128, "bfloat16", "tf32x2"), (64, "float16", "bf16x2")])
def test_cp_summary_kernel_compiles(K, dtype, operands):
    """The summary state pass on the forward's 16-bit W/Kd (what CP runs). bf16 input: bf16 MMAs on
    the exact W/Kd and two-piece bf16 splits of the state and V', which stay in registers as the
    MMAs' A operands (every MMA register-sourced; S and V' never stored to shared memory), W, Kd, U
    and eC brought by TMA; fp16 input (not exact in bf16), or tf32x2 asked for: TF32 MMAs only,
    never a 16-bit MMA."""
    src = build_summary_kernel(None, K, K, 64, dtype=dtype, operands=operands).get_kernel_source()
    if dtype == "bfloat16" and operands == "bf16x2":
        assert "kBFloat16, tl::DataType::kBFloat16" in src and "kTensorFloat32" not in src
        assert src.count("tl::wgmma_rs<") == 4 and "tl::wgmma_ss<" not in src
        shared = set(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem", src))
        assert shared == {"w_s", "kd_s", "u_s", "ec_s"} and src.count("tl::tma_load(") == 4
        assert_released_after_wait(src, mma_loop(src))
    else:
        assert "kTensorFloat32" in src
        assert "kBFloat16, tl::DataType::kBFloat16" not in src and "kFloat16, tl::DataType::kFloat16" not in src


@pytest.mark.parametrize("K", [128, 64])
def test_summary_kernels_compile(K):
    isrc = build_intra_summary_kernel(None, K, K, 64, "bfloat16").get_kernel_source()
    src = build_summary_kernel(None, K, K, 64).get_kernel_source()
    for s in (isrc, src):  # M must never pass through a 16-bit or plain single-pass GEMM
        assert "kTensorFloat32" in s
        assert "kBFloat16, tl::DataType::kBFloat16" not in s and "kFloat16, tl::DataType::kFloat16" not in s


@pytest.mark.parametrize("K,dtype,operands", [(128, "bfloat16", "tf32x2"), (64, "float16", "bf16x2"),
                                              (128, "float32", "bf16x2")])
def test_summary_kernel_orders_async_mmas_and_stores(K, dtype, operands):
    """The TF32 summary kernel overlaps its operand stores with asynchronous MMAs of two warpgroups. In
    the generated loop (taken cyclically, as iterations follow each other), every store into a
    shared operand must come after the wait of the last MMA group that read it and a block barrier
    after that wait (else the other warpgroup's MMA may still read it), and every MMA group must
    come after a barrier and a proxy fence that follow the last store into what it reads."""
    src = build_summary_kernel(None, K, K, 64, dtype=dtype, operands=operands).get_kernel_source()
    assert_async_mma_order(async_mma_events(src, mma_loop(src)))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_conv_glue_kernels_compile(backward, packed):
    """The layer's conv + SiLU + L2Norm kernels (kda_cp.kernels.conv) build for q (normed) and v,
    reading x rows inside a wider buffer (row stride 784 > 768 channels). Each tile's loads (x, and
    dY in the backward) go out by TMA one tile ahead: two barriers, each waited on with the trip's
    parity, and a load issued before the first wait of every trip; Lags is read only when packed."""
    from kda_cp.kernels.conv import build_conv_kernel

    for part in (0, 2):
        src = build_conv_kernel(768, 784, 2, 128, 4, part, "bfloat16", "bfloat16", 1e-6,
                                backward=backward, packed=packed).get_kernel_source()
        body = src[src.index("__global__ void __launch_bounds__"):]
        loop = body[body.index("for (int p = 0;"):]
        assert loop.count("tma_load(X_desc") == 2 and loop.count("tma_load(DY_desc") == (2 if backward else 0)
        assert "bar_a[0].wait((p & 1))" in loop and "bar_b[0].wait((p & 1))" in loop
        assert loop.index("tma_load(X_desc, bar_b") < loop.index("bar_a[0].wait")
        assert ("Lags[" in body) == packed


def test_conv_gva_value_part_reads_its_own_columns():
    """Under GVA the v part has its own head count and first column: 4 value heads from column 512
    of q | k | v = 256 | 256 | 512 channels read x at 512 + 128 h; a part outside x is a ValueError."""
    from kda_cp.kernels.conv import build_conv_kernel

    src = build_conv_kernel(1024, 1040, 4, 128, 4, 2, "bfloat16", "bfloat16", 1e-6, backward=False,
                            packed=False, base=512).get_kernel_source()
    assert "tl::tma_load(X_desc, bar_a[0], (&(((bfloat16_t*)xa)[0])), ((((int)blockIdx.y) * 128) + 512)" in src
    with pytest.raises(ValueError, match="outside x's C=1024"):
        build_conv_kernel(1024, 1040, 4, 128, 4, 2, "bfloat16", "bfloat16", 1e-6, backward=False, base=640)


def test_conv_backward_launch_bounds_follow_the_launch():
    """tune_conv.py's launches: the backward asks ptxas for the blocks per SM it plans for (its
    default, 256 threads and two blocks), and the same kernel builds for 512 threads and one."""
    from kda_cp.kernels.conv import BWD_LAUNCH, build_conv_kernel

    for launch in (BWD_LAUNCH, (512, 1)):
        src = build_conv_kernel(768, 784, 2, 128, 4, 0, "bfloat16", "bfloat16", 1e-6, backward=True,
                                packed=False, launch=launch).get_kernel_source()
        assert f"__launch_bounds__({launch[0]}, {launch[1]})" in src

