"""Grouped value attention (HV a multiple of H) and allow_neg_eigval (beta in [0, 2]) through
chunk_kda on the TileLang kernels, against fp64 autograd of the per-token recurrence on the key
heads repeated per group (marker ``gpu``). Fresh random inputs per case; packed sequences with
lengths that are not multiples of the chunk size; an initial state and a final-state gradient.
Tolerances as the kernels' own tests: 5e-3 for o and the final state, 8e-3 for dq, dk, dv, dh0,
2e-2 for dg, dbeta."""
import pytest
import torch

from kda_cp import chunk_kda, naive_recurrent_kda
from tests._utils import assert_close

pytestmark = pytest.mark.gpu

TOL = {"o": 5e-3, "final_state": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dh0": 8e-3}


@pytest.mark.parametrize("groups,neg_eigval", [(2, False), (1, True), (4, True)],
                         ids=["gva2", "neg-eigval", "gva4-neg-eigval"])
def test_options_on_the_kernels_match_fp64(groups, neg_eigval):
    H, K, V = 2, 128, 128
    HV = H * groups
    cu = torch.tensor([0, 130, 131, 389], device="cuda")  # T = 389, sequences of 130, 1 and 258 tokens
    T, n = int(cu[-1]), cu.numel() - 1
    dev = "cuda"
    q = torch.randn(1, T, H, K, device=dev).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, T, HV, V, device=dev).to(torch.bfloat16)
    g = -5 * torch.sigmoid(torch.randn(1, T, HV, K, device=dev))
    beta = torch.rand(1, T, HV, device=dev) * (2 if neg_eigval else 1)
    h0 = torch.randn(n, HV, K, V, device=dev)
    do = torch.randn(1, T, HV, V, device=dev).to(torch.bfloat16)
    dht = torch.randn(n, HV, K, V, device=dev)

    ref = [x.double().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    qr, kr = (x.repeat_interleave(groups, dim=2) for x in ref[:2])
    o, ht = naive_recurrent_kda(qr, kr, *ref[2:5], initial_state=ref[5], output_final_state=True, cu_seqlens=cu)
    want = [o, ht, *torch.autograd.grad((o, ht), ref, (do.double(), dht.double()))]

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
                      backend="tilelang", allow_neg_eigval=neg_eigval)
    got = [o, ht, *torch.autograd.grad((o, ht), leaves, (do, dht))]
    for name, a, b in zip(TOL, want, got):
        assert_close(name, a.detach(), b.detach().double(), TOL[name])
