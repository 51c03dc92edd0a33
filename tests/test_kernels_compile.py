"""Every TileLang kernel lowers and compiles for Hopper (sm_90a) with the local nvcc (no GPU needed).

Marker ``compile``. Skipped when tilelang or nvcc is absent. Builds each factory at the configs the
library launches (K = V in {64, 128}, bf16 and fp16, with/without initial and final state) and checks
that the generated CUDA uses Hopper's wgmma for the bf16 GEMMs.
"""
import shutil

import pytest

pytestmark = pytest.mark.compile

tilelang = pytest.importorskip("tilelang")
if shutil.which("nvcc") is None:
    pytest.skip("nvcc not found", allow_module_level=True)

from kda_cp.kernels.intra import build_intra_kernel, build_intra_summary_kernel  # noqa: E402
from kda_cp.kernels.state import build_state_output_kernel, build_summary_kernel  # noqa: E402


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_intra_compiles(K, dtype):
    ker = build_intra_kernel(None, K, K, 64, dtype, scale=K ** -0.5)
    src = ker.get_kernel_source()
    assert "wgmma" in src, "W/U GEMMs did not lower to wgmma"


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("store_ht", [False, True])
def test_state_output_compiles(K, with_h0, store_ht):
    ker = build_state_output_kernel(None, K, K, 64, "bfloat16", with_h0=with_h0, store_ht=store_ht)
    assert "wgmma" in ker.get_kernel_source()


def test_state_output_fp16_compiles():
    build_state_output_kernel(None, 64, 64, 64, "float16", with_h0=True, store_ht=True)


@pytest.mark.parametrize("K", [64, 128])
def test_summary_kernels_compile(K):
    isrc = build_intra_summary_kernel(None, K, K, 64, "bfloat16").get_kernel_source()
    assert "kBFloat16, tl::DataType::kBFloat16" not in isrc and "kTensorFloat32" in isrc
    ker = build_summary_kernel(None, K, K, 64)
    src = ker.get_kernel_source()
    # M must not go through bf16 GEMMs: only TF32 (3xTF32 split) MMA on fp32 data
    assert "kBFloat16" not in src and "kFloat16" not in src
    assert "kTensorFloat32" in src
