"""Every TileLang kernel lowers and compiles for Hopper (sm_90a) with the local nvcc (no GPU needed).

Marker ``compile``. Skipped when tilelang or nvcc is absent. Builds each of the four kernel factories
at representative launch configs (K = V in {64, 128}, bf16 and fp16, with/without initial and final
state) and checks the instruction choice in the generated CUDA: wgmma for the bf16/fp16 GEMMs of
the forward, and only TF32 MMAs on split fp32 data (3xTF32) in the summary, never a 16-bit GEMM.
About 5 minutes on 2 CPU cores (the chunk-local kernels take ~100 s each to compile there).
"""
import shutil

import pytest

pytestmark = [pytest.mark.compile, pytest.mark.slow]

tilelang = pytest.importorskip("tilelang")
if shutil.which("nvcc") is None:
    pytest.skip("nvcc not found", allow_module_level=True)

from kda_cp.kernels.intra import build_intra_kernel, build_intra_summary_kernel  # noqa: E402
from kda_cp.kernels.state import build_state_output_kernel, build_summary_kernel  # noqa: E402


@pytest.mark.parametrize("K,dtype", [(128, "bfloat16"), (64, "float16")])
def test_intra_compiles(K, dtype):
    src = build_intra_kernel(None, K, K, 64, dtype, scale=K ** -0.5).get_kernel_source()
    assert "wgmma" in src, "W/U GEMMs did not lower to wgmma"


@pytest.mark.parametrize("K,dtype,with_h0,store_ht", [
    (128, "bfloat16", True, True), (128, "bfloat16", False, False), (64, "float16", True, False)])
def test_state_output_compiles(K, dtype, with_h0, store_ht):
    ker = build_state_output_kernel(None, K, K, 64, dtype, with_h0=with_h0, store_ht=store_ht)
    assert "wgmma" in ker.get_kernel_source()


@pytest.mark.parametrize("K,dtype", [(128, "bfloat16"), (64, "float16")])
def test_cp_summary_kernel_compiles(K, dtype):
    """The summary state pass on the forward's 16-bit W/Kd (what CP runs): TF32 MMAs only."""
    src = build_summary_kernel(None, K, K, 64, dtype=dtype).get_kernel_source()
    assert "kTensorFloat32" in src
    assert "kBFloat16, tl::DataType::kBFloat16" not in src and "kFloat16, tl::DataType::kFloat16" not in src


@pytest.mark.parametrize("K", [128, 64])
def test_summary_kernels_compile(K):
    isrc = build_intra_summary_kernel(None, K, K, 64, "bfloat16").get_kernel_source()
    src = build_summary_kernel(None, K, K, 64).get_kernel_source()
    for s in (isrc, src):  # M must never pass through a 16-bit or plain single-pass GEMM
        assert "kTensorFloat32" in s
        assert "kBFloat16, tl::DataType::kBFloat16" not in s and "kFloat16, tl::DataType::kFloat16" not in s
