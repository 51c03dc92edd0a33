"""Every TileLang backward kernel lowers and compiles for Hopper (sm_90a) with the local nvcc (no GPU).

Marker ``compile``. Skipped when tilelang or nvcc is absent. Builds each backward factory once
(K = V = 128, bf16; the state kernel with and without stored states), checks that the large GEMMs use wgmma and that
the "dk" kernel's GEMMs are TF32 (its 2xTF32 split is what keeps dg accurate).
"""
import shutil

import pytest

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
@pytest.mark.parametrize("store_states", [True, False])
def test_bwd_state_compiles(K, dtype, store_states):
    # the launches the library uses: the full backward (1 stage), the state gradient (2 stages)
    src = build_bwd_state_kernel(None, K, K, 64, dtype, store_states=store_states,
                                 num_stages=1 if store_states else 2).get_kernel_source()
    assert "wgmma" in src, "state-gradient GEMMs did not lower to wgmma"


@pytest.mark.parametrize("K,dtype", CONFIGS, ids=IDS)
def test_bwd_dv_compiles(K, dtype):
    assert "wgmma" in build_bwd_dv_kernel(None, K, K, 64, dtype).get_kernel_source()


@pytest.mark.parametrize("K,dtype", CONFIGS, ids=IDS)
def test_bwd_ut_compiles(K, dtype):
    assert "wgmma" in build_bwd_ut_kernel(None, K, K, 64, dtype).get_kernel_source()


@pytest.mark.parametrize("K,dtype", CONFIGS, ids=IDS)
def test_bwd_dk_compiles(K, dtype):
    src = build_bwd_dk_kernel(None, K, 64, dtype, scale=K ** -0.5).get_kernel_source()
    # the decayed products' backward must stay fp32-accurate (2xTF32): with bf16 or fp16 operands
    # dg loses its pairwise cancellation (relative RMS ~6e-2 instead of ~2e-3 on an H200)
    assert "kTensorFloat32" in src
    assert "kBFloat16, tl::DataType::kBFloat16" not in src and "kFloat16, tl::DataType::kFloat16" not in src


def test_factory_rejects_bad_config():
    with pytest.raises(ValueError):
        build_bwd_state_kernel(None, 64, 48, 64, "bfloat16", store_states=True)  # V % block_v
    with pytest.raises(ValueError):
        build_bwd_ut_kernel(None, 64, 64, 40, "bfloat16")  # chunk_size % 16
