"""flash-linear-attention's KimiDeltaAttention and kda_cp's KDALayer with the same weights (through
kda_cp.interop) give the same output and input gradient on the GPU, within bf16 tolerance
(relative RMS 1e-2): both gate forms, with and without GVA, beta in [0, 1] and in [0, 2]
(marker ``gpu``; needs flash-linear-attention)."""
import pytest
import torch

from kda_cp.interop import export_kda_state_dict, import_kda_state_dict
from kda_cp.layers import KDAConfig, KDALayer
from tests._utils import assert_close

pytestmark = pytest.mark.gpu

TOL = 1e-2


@pytest.mark.parametrize("g_min,HV,neg", [(-5.0, 2, False), (None, 2, False), (-5.0, 4, False), (None, 4, True)],
                         ids=["bounded", "softplus", "bounded-gva", "softplus-gva-neg-eigval"])
def test_the_peer_layer_and_ours_agree(g_min, HV, neg):
    pytest.importorskip("fla")
    from kda_cp.peer import FlaKDALayer

    cfg = KDAConfig(d_model=256, num_heads=2, num_v_heads=HV, head_dim=128, output_gate_rank=128, g_min=g_min,
                    allow_neg_eigval=neg, backend="tilelang")
    torch.manual_seed(0)
    peer = FlaKDALayer(cfg).cuda().to(torch.bfloat16)
    with torch.no_grad():  # off the init (norm weight 1, A_log as initialised) on every tensor
        for p in peer.parameters():
            p.mul_(1 + 0.1 * torch.randn_like(p))
    ours = KDALayer(cfg).cuda().to(torch.bfloat16)
    sd = peer.inner.state_dict()
    ours.load_state_dict(import_kda_state_dict(sd, cfg, "fla"))
    back = export_kda_state_dict(ours.state_dict(), cfg, "fla")
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    cu = torch.tensor([0, 300, 301, 1000], device="cuda")
    x = torch.randn(1, 1000, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    outs = []
    for layer in (peer, ours):
        xx = x.clone().requires_grad_(True)
        y = layer(xx, cu_seqlens=cu)
        (dx,) = torch.autograd.grad(y, xx, dy)
        outs.append((y.float(), dx.float()))
    assert_close("y", outs[0][0], outs[1][0], TOL)
    assert_close("dx", outs[0][1], outs[1][1], TOL)
