"""The general-gate TileLang kernels (``g_min=None``: any g <= 0) vs the fp64 recurrence, on a Hopper
GPU (marker ``gpu``).

Gates are Kimi Linear's: g = -exp(A_log) * softplus(f + dt_bias), A_log = log U(1, 16), with
per-channel biases over [-6, 6], so that slow channels keep the state across many chunks while fast
ones take steps below -20 and chunk cumsums below -1000 (checked per case). Inputs are drawn fresh
per case; the oracle is kda_cp.reference.naive_recurrent_kda in fp64 (autograd for the gradients) on
the same bf16/fp16-rounded inputs. Tolerances are the bounded kernels': o and states 5e-3, the
summary 1e-3, dq, dk, dv, dh0 8e-3, dg, dbeta 2e-2 (relative RMS), and everything finite.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu marker
    pytest.skip("needs CUDA", allow_module_level=True)

kernels = pytest.importorskip("kda_cp.kernels")
from kda_cp.kernels import backward  # noqa: E402
from kda_cp.reference import naive_recurrent_kda  # noqa: E402
from tests._utils import assert_close  # noqa: E402
from tests.kernels.test_kernels_bwd_gpu import NAMES, TOL, assert_grads_close, oracle_grads  # noqa: E402
from tests.kernels.test_kernels_gpu import FWD_TOL, SUMMARY_TOL, _summary_oracle  # noqa: E402


def softplus_gates(B, T, H, K):
    a = torch.empty(H, 1, device="cuda").uniform_(1, 16)
    a[0] = 16.0  # the top of A_log's init range on one head: steps below -20 in every case
    bias = torch.stack([torch.linspace(-6.0, 6.0, K, device="cuda")[torch.randperm(K, device="cuda")]
                        for _ in range(H)])
    g = -a * torch.nn.functional.softplus(torch.randn(B, T, H, K, device="cuda") + bias)
    return g.contiguous()


def make(B, T, H, K, n_states, *, dtype=torch.bfloat16):
    q = torch.randn(B, T, H, K, device="cuda").to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dtype)
    v = torch.randn(B, T, H, K, device="cuda").to(dtype)
    g = softplus_gates(B, T, H, K)
    beta = torch.rand(B, T, H, device="cuda")
    do = torch.randn(B, T, H, K, device="cuda").to(dtype)
    h0 = torch.randn(n_states, H, K, K, device="cuda")
    dht = torch.randn(n_states, H, K, K, device="cuda")
    if T >= 64:
        assert g.min() < -20 and g[:, :64].sum(1).min() < -1000, "the case must reach the general gate's range"
    return q, k, v, g, beta, do, h0, dht


def finite(*xs):
    return all(bool(torch.isfinite(x).all()) for x in xs if x is not None)


CASES = [  # (B, T, H, K, dtype)
    (1, 63, 4, 128, torch.bfloat16),
    (2, 1000, 4, 128, torch.bfloat16),
    (1, 4096, 2, 64, torch.bfloat16),
    (1, 1000, 2, 64, torch.float16),
]


@pytest.mark.parametrize("B,T,H,K,dtype", CASES, ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{str(c[4])[6:]}" for c in CASES])
def test_general_fwd_bwd_match_fp64(B, T, H, K, dtype):
    q, k, v, g, beta, do, h0, dht = make(B, T, H, K, B, dtype=dtype)
    scale = K ** -0.5
    o, ht = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                  g_min=None)
    o_ref, ht_ref = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), scale=scale,
                                        initial_state=h0.double(), output_final_state=True)
    assert finite(o, ht)
    assert_close("o", o_ref, o, FWD_TOL)
    assert_close("final_state", ht_ref, ht, FWD_TOL)
    out = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht, g_min=None)
    assert finite(*out)
    assert_grads_close(oracle_grads(q, k, v, g, beta, scale, h0, do, dht), out)


def test_general_packed_sequences_and_prepared():
    """Packed sequences with boundaries inside chunks and a tail past the last one (zero gradients
    there); the prepared forward shared by the state gradient and the backward, bitwise; the general
    kernels' prepared forward is refused by a call of the bounded ones."""
    lens = [300, 17, 500, 64, 29]
    H, K = 3, 128
    P = sum(lens)
    T = P + 11
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v, g, beta, do, h0, dht = make(1, T, H, K, len(lens))
    scale = K ** -0.5
    prep = kernels.chunk_kda_fwd_prepare(q, k, v, g, beta, scale=scale, cu_seqlens=cu, g_min=None)
    o, ht = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                  cu_seqlens=cu, g_min=None, prepared=prep)
    o_ref, ht_ref = naive_recurrent_kda(*(x[:, :P].double() for x in (q, k, v, g, beta)), scale=scale,
                                        initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    assert_close("o", o_ref, o[:, :P], FWD_TOL)
    assert_close("final_state", ht_ref, ht, FWD_TOL)
    G = backward.chunk_kda_state_grad(q, k, v, g, beta, scale=scale, do=do, cu_seqlens=cu, g_min=None,
                                      prepared=prep)
    assert torch.equal(G, backward.chunk_kda_state_grad(q, k, v, g, beta, scale=scale, do=do, cu_seqlens=cu,
                                                        g_min=None))
    with pytest.raises(ValueError, match="made for other inputs"):  # the same tensors, the bounded kernels
        backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, do=do, cu_seqlens=cu, prepared=prep)
    out = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht, cu_seqlens=cu,
                                 g_min=None, prepared=prep)
    ref = oracle_grads(*(x[:, :P] for x in (q, k, v, g, beta)), scale, h0, do[:, :P], dht, cu_seqlens=cu)
    assert_close("state_grad", oracle_grads(*(x[:, :P] for x in (q, k, v, g, beta)), scale, h0, do[:, :P], None,
                                            cu_seqlens=cu)[5], G, TOL["dh0"])
    for name, r, x in zip(NAMES, ref, out):
        sl = x if name == "dh0" else x[:, :P]
        assert_close(name, r, sl, TOL[name])
        if name != "dh0":
            assert torch.equal(x[:, P:], torch.zeros_like(x[:, P:])), f"{name}: padding tail not zero"


@pytest.mark.parametrize("B,T,H,K", [(2, 1000, 4, 128), (1, 333, 2, 64)])
def test_general_summary_matches_fp64(B, T, H, K):
    _, k, v, g, beta, _, _, _ = make(B, T, H, K, B)
    M, St = kernels.chunk_kda_summary(k, v, g, beta, g_min=None)
    M_ref, St_ref = _summary_oracle(k, v, g, beta)
    assert finite(M, St)
    assert_close("M", M_ref, M, SUMMARY_TOL)
    assert_close("S_tilde", St_ref, St, SUMMARY_TOL)
    prep = kernels.chunk_kda_fwd_prepare(k, k, v, g, beta, scale=1.0, g_min=None)
    Mp, Sp = kernels.chunk_kda_summary_prepared(prep)
    assert_close("M (prepared)", M_ref, Mp, FWD_TOL)
    assert_close("S_tilde (prepared)", St_ref, Sp, FWD_TOL)


def test_general_kernels_on_bounded_gates_match_the_bounded_kernels():
    """On gates inside [-5, 0] both kernel families compute the same sums (the own blocks pairwise
    in fp32 or anchored in bf16): o and every gradient agree within the kernels' tolerances."""
    B, T, H, K = 1, 2000, 4, 128
    q, k, v, _, beta, do, h0, dht = make(B, T, H, K, B)
    g = (-5 * torch.sigmoid(torch.randn(B, T, H, K, device="cuda"))).contiguous()
    scale = K ** -0.5
    a = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    b = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True, g_min=None)
    for name, x, y in zip(("o", "final_state"), a, b):
        assert_close(name, x.double(), y, FWD_TOL)
    ga = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht)
    gb = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht, g_min=None)
    for name, x, y in zip(NAMES, ga, gb):
        assert_close(name, x.double(), y, TOL[name])
