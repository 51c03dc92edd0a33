"""Every TileLang backward kernel lowers and compiles for Hopper (sm_90a) with the local nvcc (no GPU).

Marker ``compile``. Skipped when tilelang or nvcc is absent. Builds each backward factory once
(K = V = 128, bf16; each walk of the state kernel), checks that the large GEMMs use wgmma and that
the "dk" kernel's GEMMs take bf16 operands.
"""
import shutil

import pytest
from tests._utils import NEGATIVE_GAM_OFFSET, assert_async_mma_order, async_mma_events, loop_headers

pytestmark = pytest.mark.compile

tilelang = pytest.importorskip("tilelang")
if shutil.which("nvcc") is None:
    pytest.skip("nvcc not found", allow_module_level=True)

from kda_cp.kernels.bwd_intra import build_bwd_dk_kernel, build_bwd_dv_kernel, build_bwd_ut_kernel  # noqa: E402
from kda_cp.kernels.bwd_state import build_bwd_state_kernel  # noqa: E402

# One launch configuration per factory keeps CI (2 cores, ~1-2 min per kernel) short; the GPU tests
# run every configuration kda_cp.kernels.backward launches.
CONFIGS = [(128, "bfloat16")]
IDS = [f"K{k}-{d}" for k, d in CONFIGS]


@pytest.mark.parametrize("K,dtype", CONFIGS, ids=IDS)
@pytest.mark.parametrize("walk", ["forward", "reverse", "state_grad"])
def test_bwd_state_compiles(K, dtype, walk):
    # every walk with its default two pipeline stages, as kda_cp.kernels.backward launches them
    src = build_bwd_state_kernel(None, K, K, 64, dtype, walk=walk).get_kernel_source()
    assert "wgmma" in src, "state-walk GEMMs did not lower to wgmma"
    # a grid axis per index: no 64-bit division by the runtime head count in per-element addresses
    assert "((int64_t)H)" not in src.replace("* ((int64_t)H)", "")


@pytest.mark.parametrize("K,dtype", CONFIGS, ids=IDS)
def test_bwd_dv_compiles(K, dtype):
    src = build_bwd_dv_kernel(None, K, K, 64, dtype).get_kernel_source()
    assert "wgmma" in src
    # deC's row sum on every thread, a part of the V columns each (one thread per row over all V
    # columns, the others waiting: 1.54 ms at S1 on an H200 against 1.43)
    assert not loop_headers(src, "j", K) and "dec_s" in src


@pytest.mark.parametrize("K,dtype", CONFIGS, ids=IDS)
def test_bwd_ut_compiles(K, dtype):
    src = build_bwd_ut_kernel(None, K, K, 64, dtype).get_kernel_source()
    assert "wgmma" in src
    assert loop_headers(src, "I", 4)  # the sub-chunk loop is not unrolled (1.5x slower)
    assert not NEGATIVE_GAM_OFFSET.search(src), "a read of gam_s before its start (row I*16 - 1 for I = 0)"
    # g, k and the chunk tiles come in by TMA, the scan waiting for g alone (S1 on an H200 1.58 ->
    # 1.45 ms, same bits); no per-thread global loads of them remain
    for desc in ("G_desc", "Kx_desc", "DW_desc", "DU_desc", "W_desc", "U_desc"):
        assert f"tl::tma_load({desc}," in src, desc
    for name in ("G", "Kx", "DW", "DU", "W", "U"):  # no per-thread global loads of them, vector or scalar
        assert f"({name} +" not in src and f" {name}[" not in src and f"({name}[" not in src, name
    assert src.index("bg[0].wait(0)") < src.index("bk[0].wait(0)")


@pytest.mark.parametrize("K,dtype", CONFIGS + [(64, "float16")], ids=IDS + ["K64-float16"])
def test_bwd_dk_compiles(K, dtype):
    src = build_bwd_dk_kernel(None, K, 64, dtype, scale=K ** -0.5).get_kernel_source()
    # the decayed products' backward: bf16 MMAs on dM (bf16) and the two-piece bf16 split of the
    # factors (tests/kernels/test_kernels_bwd_mirror.py::test_dk_operand_split_keeps_dg_accurate says why);
    # never fp16 operands, whose range the factors (up to e^80) exceed
    assert "kBFloat16, tl::DataType::kBFloat16" in src
    assert "kFloat16, tl::DataType::kFloat16" not in src and "kTensorFloat32" not in src
    # the chunk's 64 tokens as M: warpgroup MMAs (as M = 16 mma.sync GEMMs per sub-chunk, 4.96 ms at
    # S1 on an H200, of which 1.6 ms the GEMMs)
    assert "wgmma_ss" in src and "mma_sync" not in src
    assert "__launch_bounds__(256, 2)" in src  # <= 128 registers: two blocks per SM (1.5x faster than one)
    # the sub-chunk loops (row side by J, column side by I) are not unrolled (1.5x slower)
    assert loop_headers(src, "J", 4) and loop_headers(src, "I", 4)
    assert not NEGATIVE_GAM_OFFSET.search(src), "a read of gam_s before its start (row I*16 - 1 for I = 0)"
    # the gate cumsums run on every thread, and the per-channel sum of Kd dKd inside the reverse one:
    # a 64-thread scan and a row reduction (eight AllReduce rounds, each with a barrier) would make
    # the other warps wait (docs/kernels.md)
    assert "AllReduce" not in src
    assert "if (((int)threadIdx.x) < 64)" not in src


@pytest.mark.parametrize("K,dtype", CONFIGS, ids=IDS)
def test_bwd_dk_orders_async_mmas_and_table_stores(K, dtype):
    """ "dk" issues each sub-chunk's four MMAs back to back and waits once; both warpgroups read the
    factor tables that the next sub-chunk overwrites. In both loops (row side over J, column side
    over I) every table store must follow the MMAs' wait and a barrier, and every MMA a barrier
    and a proxy fence after the stores (tests/_utils.assert_async_mma_order)."""
    src = build_bwd_dk_kernel(None, K, 64, dtype, scale=K ** -0.5).get_kernel_source()
    (row_loop,), (col_loop,) = loop_headers(src, "J", 4), loop_headers(src, "I", 4)
    for loop in (row_loop, col_loop):
        events = async_mma_events(src, loop)
        assert sum(e[0] == "issue" for e in events) == 4 and sum(e[0] == "wait" for e in events) == 1, events
        assert_async_mma_order(events)


def test_general_gate_bwd_kernels_compile():
    """g_min=None's "ut" and "dk": the gate scan floors each step (GENERAL_FLOOR), the sub-chunk
    loops stay loops, "dk" keeps two blocks per SM and the order of its asynchronous MMAs and table
    stores (the pairwise own blocks add CUDA-core work after each loop, no MMA)."""
    floor = "/*-3.594239e+01*/"
    ut = build_bwd_ut_kernel(None, 128, 128, 64, "bfloat16", general=True).get_kernel_source()
    dk = build_bwd_dk_kernel(None, 128, 64, "bfloat16", scale=128 ** -0.5, general=True).get_kernel_source()
    for src in (ut, dk):
        assert src.count(floor) == 1
        assert loop_headers(src, "I", 4)
        assert not NEGATIVE_GAM_OFFSET.search(src)
    assert "pw_s" in ut
    assert "__launch_bounds__(256, 2)" in dk and "wgmma_ss" in dk and "mma_sync" not in dk
    (row_loop,), (col_loop,) = loop_headers(dk, "J", 4), loop_headers(dk, "I", 4)
    for loop in (row_loop, col_loop):
        events = async_mma_events(dk, loop)
        assert sum(e[0] == "issue" for e in events) == 4 and sum(e[0] == "wait" for e in events) == 1, events
        assert_async_mma_order(events)


def test_factory_rejects_bad_config():
    with pytest.raises(ValueError):
        build_bwd_state_kernel(None, 64, 48, 64, "bfloat16", walk="reverse")  # V % block_v
    with pytest.raises(ValueError, match="walk"):
        build_bwd_state_kernel(None, 64, 64, 64, "bfloat16", walk="both")
    with pytest.raises(ValueError):
        build_bwd_ut_kernel(None, 64, 64, 40, "bfloat16")  # chunk_size % 16
    with pytest.raises(ValueError, match="chunk_size must be 64"):  # the wgmma M, not a compile error
        build_bwd_dk_kernel(None, 64, 32, "bfloat16", scale=0.125)
    with pytest.raises(ValueError, match="threads"):  # the scans give each channel the same threads
        build_bwd_dk_kernel(None, 128, 64, "bfloat16", scale=0.125, threads=96)
    with pytest.raises(ValueError, match="threads"):
        build_bwd_ut_kernel(None, 128, 128, 64, "bfloat16", threads=192)
    with pytest.raises(ValueError, match="threads"):  # deC's row sum: the same threads per row
        build_bwd_dv_kernel(None, 128, 128, 64, "bfloat16", threads=192)
