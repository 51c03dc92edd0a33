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


@pytest.mark.parametrize("groups,neg_eigval,bias,beta_in_kernel", [
    (1, False, True, True), (2, True, True, True), (1, False, False, False)],
    ids=["gate-beta", "gva2-neg-eigval", "gate-only-no-bias"])
def test_gate_in_kernel_matches_fp64(groups, neg_eigval, bias, beta_in_kernel, monkeypatch):
    """use_gate_in_kernel on the TileLang kernels (the gate computed inside the chunk-local kernel,
    no fp32 g in the forward) against fp64 autograd of the gate followed by the recurrence: o, the
    final state and the gradients of q, k, v, the pre-activations z and b, A_log, dt_bias and h0."""
    from kda_cp import glue
    from kda_cp.ops import GatedChunkKDAFunction

    monkeypatch.setenv("KDA_CP_GATE_IN_KERNEL", "1")

    H, K, V = 2, 128, 128
    HV = H * groups
    cu = torch.tensor([0, 77, 78, 301], device="cuda")  # T = 301, sequences of 77, 1 and 223 tokens
    T, n = int(cu[-1]), cu.numel() - 1
    dev, scale = "cuda", 2.0 if neg_eigval else 1.0
    q = torch.randn(1, T, H, K, device=dev).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, T, HV, V, device=dev).to(torch.bfloat16)
    z = (2 * torch.randn(1, T, HV, K, device=dev)).to(torch.bfloat16)
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16))
    dt_bias = torch.randn(HV * K, device=dev) if bias else None
    b = torch.randn(1, T, HV, device=dev) if beta_in_kernel else torch.rand(1, T, HV, device=dev) * scale
    h0 = torch.randn(n, HV, K, V, device=dev)
    do = torch.randn(1, T, HV, V, device=dev).to(torch.bfloat16)
    dht = torch.randn(n, HV, K, V, device=dev)
    inputs = [q, k, v, z, b, A_log, dt_bias, h0]

    ref = [None if x is None else x.double().requires_grad_(True) for x in inputs]
    g, beta = glue.kda_gate(ref[3], ref[5], ref[6], -5.0, ref[4] if beta_in_kernel else None, beta_scale=scale,
                            compiled=False)
    beta = beta if beta_in_kernel else ref[4]
    qr, kr = (x.repeat_interleave(groups, dim=2) for x in ref[:2])
    o, ht = naive_recurrent_kda(qr, kr, ref[2], g, beta, initial_state=ref[7], output_final_state=True,
                                cu_seqlens=cu)
    live = [i for i, x in enumerate(ref) if x is not None]
    want = [o, ht, *torch.autograd.grad((o, ht), [ref[i] for i in live], (do.double(), dht.double()))]

    leaves = [None if x is None else x.clone().requires_grad_(True) for x in inputs]
    o, ht = chunk_kda(*leaves[:5], initial_state=leaves[7], output_final_state=True, cu_seqlens=cu,
                      backend="tilelang", use_gate_in_kernel=True, A_log=leaves[5], dt_bias=leaves[6],
                      use_beta_sigmoid_in_kernel=beta_in_kernel, g_min=-5.0, allow_neg_eigval=neg_eigval)
    assert type(o.grad_fn).__name__ == GatedChunkKDAFunction.__name__ + "Backward", o.grad_fn
    got = [o, ht, *torch.autograd.grad((o, ht), [leaves[i] for i in live], (do, dht))]
    names = ["o", "final_state"] + [["dq", "dk", "dv", "dz", "db", "dA_log", "ddt_bias", "dh0"][i] for i in live]
    tol = {**TOL, "dz": 2e-2, "db": 2e-2, "dA_log": 2e-2, "ddt_bias": 2e-2}
    for name, a, bb in zip(names, want, got):
        assert torch.isfinite(bb).all(), name
        assert_close(name, a.detach(), bb.detach().double(), tol[name])


def test_gate_in_kernel_bad_A_log_is_a_value_error(monkeypatch):
    monkeypatch.setenv("KDA_CP_GATE_IN_KERNEL", "1")
    q = torch.randn(1, 70, 2, 128, device="cuda").to(torch.bfloat16)
    z, b = torch.randn_like(q), torch.randn(1, 70, 2, device="cuda")
    with pytest.raises(ValueError, match="A_log"):
        chunk_kda(q, q, q, z, b, use_gate_in_kernel=True, A_log=torch.zeros(3, device="cuda"), g_min=-5.0,
                  use_beta_sigmoid_in_kernel=True)
    with pytest.raises(ValueError, match="dt_bias"):
        chunk_kda(q, q, q, z, b, use_gate_in_kernel=True, A_log=torch.zeros(2, device="cuda"),
                  dt_bias=torch.zeros(5, device="cuda"), g_min=-5.0, use_beta_sigmoid_in_kernel=True)
