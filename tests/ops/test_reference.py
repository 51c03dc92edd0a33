"""The chunked torch backend against the per-token recurrence (fp64), degenerate cases, causality."""

import pytest
import torch

from kda_cp import chunk_kda, naive_recurrent_kda
from kda_cp.reference import chunk_kda_summary_torch
from tests._utils import assert_close, make_inputs

CASES = [
    # id, B, T, H, K, V, chunk_size
    ("T63", 2, 63, 2, 16, 8, 64),
    ("T64", 1, 64, 3, 8, 12, 64),
    ("T200-uneven-KV", 2, 200, 2, 12, 20, 64),
    ("T1", 1, 1, 2, 8, 8, 64),
    ("T100-chunk32", 1, 100, 1, 16, 16, 32),
    ("T77-chunk16", 2, 77, 2, 8, 4, 16),
]


@pytest.mark.parametrize("B,T,H,K,V,C", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zero-h0", "h0"])
def test_chunk_matches_recurrence_fp64(B, T, H, K, V, C, with_h0):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, with_h0=with_h0)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C)
    assert o.dtype == torch.float64 and s.dtype == torch.float64
    assert_close("o", o_ref, o, 1e-10)
    assert_close("final_state", s_ref, s, 1e-10)
    o_nf, s_nf = chunk_kda(q, k, v, g, beta, initial_state=h0, chunk_size=C)
    assert s_nf is None
    assert torch.equal(o_nf, o)


@pytest.mark.parametrize("g_low,C", [(40, 64), (120, 64), (120, 16)])
def test_unbounded_gates_stay_finite(g_low, C):
    """The torch backend never forms a positive exponent: strong decay (g down to -g_low; at -120 a
    sub-chunk's span of 15 steps reaches exp(1800), past fp64's range, and a chunk's cumsum goes
    below -1000) is exact, gradients included."""
    q, k, v, _, beta, h0 = make_inputs(1, 150, 2, 8, 8, with_h0=True)
    g = -g_low * torch.rand(1, 150, 2, 8, dtype=torch.float64)
    g[..., :2] *= 0.01  # slow channels keep a long memory next to the fast ones
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o_ref, s_ref = naive_recurrent_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, g_min=None, chunk_size=C)
    assert g[0, :C].sum(0).min() < -1000 or g_low < 100
    assert_close("o", o_ref, o, 1e-10)
    assert_close("final_state", s_ref, s, 1e-10)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    want = torch.autograd.grad((o_ref, s_ref), leaves, (do, ds))
    got = torch.autograd.grad((o, s), leaves, (do, ds))
    for name, w, x in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], want, got):
        assert_close(name, w, x, 1e-9)


def test_unbounded_gates_packed_gva_neg_eigval():
    """General gates (g_min=None) in a packed batch, with GVA (HV = 2H: value head j reads key head
    j // 2) and beta in (0, 2) (allow_neg_eigval): steps below -20 and chunk cumsums below -1000
    next to slow channels (g ~ -1e-3), per-sequence initial and final states, every gradient,
    against the recurrence on the repeated key heads."""
    H, HV, K, V, T = 2, 4, 8, 6, 171
    cu = torch.tensor([0, 50, 51, 171])  # the last sequence spans two 64-token chunks and a part
    gen = torch.Generator().manual_seed(21)
    q, k, v, _, beta, _ = make_inputs(1, T, HV, K, V, seed=22)
    q, k = q[:, :, :H].contiguous(), k[:, :, :H].contiguous()
    beta = 2 * beta
    g = -40.0 * torch.rand(1, T, HV, K, generator=gen, dtype=torch.float64)
    g[..., :2] = -1e-3 * (0.5 + torch.rand(1, T, HV, 2, generator=gen, dtype=torch.float64))
    assert g.min() < -20 and g[0, 51:115].sum(0).min() < -1000 and beta.max() > 1
    h0 = torch.randn(3, HV, K, V, generator=gen, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    qr, kr = (x.repeat_interleave(2, dim=2) for x in leaves[:2])
    o_ref, s_ref = naive_recurrent_kda(qr, kr, *leaves[2:5], initial_state=leaves[5], output_final_state=True,
                                       cu_seqlens=cu)
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, g_min=None,
                     allow_neg_eigval=True)
    assert_close("o", o_ref, o, 1e-10)
    assert_close("final_state", s_ref, s, 1e-10)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(s.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad((o_ref, s_ref), leaves, (do, ds))
    got = torch.autograd.grad((o, s), leaves, (do, ds))
    for name, w, x in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], want, got):
        assert_close(name, w, x, 1e-10)


def test_gradients_match_recurrence_fp64():
    B, T, H, K, V = 2, 90, 2, 8, 6
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, requires_grad=True, with_h0=True)
    do = torch.randn(B, T, H, V, dtype=torch.float64)
    dht = torch.randn(B, H, K, V, dtype=torch.float64)
    inputs = (q, k, v, g, beta, h0)

    def grads(fn):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return torch.autograd.grad((o * do).sum() + (s * dht).sum(), inputs)

    ref = grads(naive_recurrent_kda)
    out = grads(chunk_kda)
    for name, r, o in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ref, out):
        assert_close(name, r, o, 1e-10)


def test_float32_against_fp64_recurrence():
    q, k, v, g, beta, h0 = make_inputs(2, 130, 2, 16, 16, with_h0=True)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(), output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert_close("o", o_ref, o, 1e-5)
    assert_close("final_state", s_ref, s, 1e-5)


@pytest.mark.parametrize("big", [-1e4, -1e8, -2e37])
def test_float32_steps_of_any_size_keep_the_small_ones(big):
    """In fp32, one step of decay `big` (down to -2e37, finite) among steps of about -0.1 must not
    erase those small steps from the within-chunk cumsum (at -1e8 the fp32 cumsum alone would lose
    them: o off by 60%; at -2e37 it would overflow to NaN). Channel 0 takes the big step mid-chunk,
    channel 1 on every token; the other channels are ordinary."""
    q, k, v, g, beta, h0 = make_inputs(1, 100, 2, 8, 8, with_h0=True)
    g = g.clone()
    g[0, :, :, :2] = -0.1 * torch.rand(100, 2, 2, dtype=torch.float64) - 0.05
    g[0, 37, :, 0] = big
    g[0, :, 1, 1] = big
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o_ref, s_ref = naive_recurrent_kda(*ref_leaves[:5], initial_state=ref_leaves[5], output_final_state=True)
    leaves = [x.float().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, g_min=None)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("final_state", s_ref, s, 1e-5)
    do, ds = torch.randn_like(o_ref), torch.randn_like(s_ref)
    want = torch.autograd.grad((o_ref, s_ref), ref_leaves, (do, ds))
    got = torch.autograd.grad((o, s), leaves, (do.float(), ds.float()))
    for name, w, x in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], want, got):
        assert_close(name, w, x, 1e-5)


def test_packed_sequences_equal_separate_runs():
    lengths = [15, 70, 1, 33]
    T = sum(lengths)
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 8, 8)
    h0 = torch.randn(len(lengths), 2, 8, 8, dtype=torch.float64)
    cu = torch.tensor([0, 15, 85, 86, 119])
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert_close("o", o_ref, o, 1e-10)
    assert_close("final_state", s_ref, s, 1e-10)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(a, b)
        o_i, s_i = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                       initial_state=h0[i:i + 1], output_final_state=True)
        assert_close(f"o[seq {i}]", o_i, o[:, sl], 1e-10)
        assert_close(f"state[seq {i}]", s_i, s[i:i + 1], 1e-10)


# ---- three degenerate cases: KDA reduces to known recurrences ------------------------------


def _gdn_recurrence(q, k, v, g_scalar, beta, scale):
    """Gated DeltaNet with a scalar gate per head: S = a (I - b k k^T) S + b k v^T."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=q.dtype)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for t in range(T):
        S = S * g_scalar[:, t].exp()[..., None, None]
        kt, bt = k[:, t], beta[:, t][..., None]
        S = S + torch.einsum("bhk,bhv->bhkv", kt, bt * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)))
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o


def test_equal_channels_is_scalar_gate_gdn():
    q, k, v, _, beta, _ = make_inputs(2, 100, 2, 8, 8)
    g_scalar = -5 * torch.sigmoid(torch.randn(2, 100, 2, dtype=torch.float64))
    g = g_scalar[..., None].expand(2, 100, 2, 8).contiguous()
    o, _ = chunk_kda(q, k, v, g, beta)
    assert_close("o", _gdn_recurrence(q, k, v, g_scalar, beta, 8**-0.5), o, 1e-10)


def test_beta_zero_is_pure_decay():
    q, k, v, g, _, h0 = make_inputs(1, 90, 2, 8, 8, with_h0=True)
    beta = torch.zeros(1, 90, 2, dtype=torch.float64)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    gamma = g.cumsum(1)  # [B, T, H, K]
    o_ref = torch.einsum("bthk,bhkv->bthv", q * gamma.exp(), h0) * 8**-0.5
    assert_close("o", o_ref, o, 1e-10)
    assert_close("final_state", h0 * gamma[:, -1].exp()[..., None], s, 1e-10)


def test_zero_gate_is_deltanet():
    q, k, v, _, beta, _ = make_inputs(2, 100, 2, 8, 8)
    g = torch.zeros(2, 100, 2, 8, dtype=torch.float64)
    o, _ = chunk_kda(q, k, v, g, beta)
    assert_close("o", _gdn_recurrence(q, k, v, torch.zeros(2, 100, 2, dtype=torch.float64), beta, 8**-0.5), o, 1e-10)


@pytest.mark.parametrize("p", [1, 37, 64, 65, 130])
def test_causality(p):
    """Changing inputs at t >= p leaves outputs before p unchanged (bitwise)."""
    q, k, v, g, beta, _ = make_inputs(1, 150, 2, 8, 8)
    o, _ = chunk_kda(q, k, v, g, beta)
    q2, k2, v2, g2, beta2 = (x.clone() for x in (q, k, v, g, beta))
    for x in (q2, k2, v2):
        x[:, p:] = torch.randn_like(x[:, p:]) * 10
    g2[:, p:] = -5 * torch.rand_like(g2[:, p:])
    beta2[:, p:] = torch.rand_like(beta2[:, p:])
    o2, _ = chunk_kda(q2, k2, v2, g2, beta2)
    assert torch.equal(o[:, :p], o2[:, :p])
    assert not torch.allclose(o[:, p:], o2[:, p:])


def test_summary_is_the_affine_map_of_the_segment():
    q, k, v, g, beta, h0 = make_inputs(2, 111, 2, 8, 6, with_h0=True)
    M, St = chunk_kda_summary_torch(k, v, g, beta)
    _, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close("M @ h0 + S~", s_ref, M @ h0 + St, 1e-10)
    # M is the product of the per-token transitions (I - b k k^T) Diag(exp(g))
    eye = torch.eye(8, dtype=torch.float64)
    M_ref = eye.expand(2, 2, 8, 8).clone()
    for t in range(111):
        kt = k[:, t]
        Mt = (eye - beta[:, t][..., None, None] * kt[..., :, None] * kt[..., None, :]) * g[:, t].exp()[..., None, :]
        M_ref = Mt @ M_ref
    assert_close("M", M_ref, M, 1e-10)


def test_empty_sequences_in_a_packed_batch():
    q, k, v, g, beta, _ = make_inputs(1, 10, 2, 8, 4)
    h0 = torch.randn(4, 2, 8, 4, dtype=torch.float64)
    cu = torch.tensor([0, 5, 5, 10, 10])
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert_close("o", o_ref, o, 1e-10)
    assert_close("final_state", s_ref, s, 1e-10)
    assert torch.equal(s[1], h0[1]) and torch.equal(s[3], h0[3])  # an empty sequence keeps its state


def test_an_empty_batch_gives_empty_outputs_like_chunk_kda():
    q, k, v, g, beta, _ = make_inputs(0, 5, 2, 4, 3)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert o_ref.shape == o.shape == (0, 5, 2, 3) and s_ref.shape == s.shape == (0, 2, 4, 3)


def test_meta_offsets_are_refused_by_name():
    one = make_inputs(1, 20, 2, 8, 4)[:5]
    with pytest.raises(ValueError, match="cu_seqlens must hold its offsets .* got a meta tensor"):
        chunk_kda(*one, cu_seqlens=torch.tensor([0, 7, 20], device="meta"))


def test_recurrence_checks_its_inputs_like_chunk_kda():
    """Inputs the per-token loop would silently mis-read (it indexes k, v by q's batch, walks the
    given segments) are ValueErrors naming the argument; the same inputs are valid otherwise."""
    q, k, v, g, beta, _ = make_inputs(2, 40, 2, 8, 8)
    with pytest.raises(ValueError, match=r"^k must have q's shape"):
        naive_recurrent_kda(q, k[:1], v, g, beta)
    one = [x[:1] for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match=r"cu_seqlens must end at the packed length T = 40"):
        naive_recurrent_kda(*one, cu_seqlens=torch.tensor([0, 10, 30]))
    with pytest.raises(ValueError, match=r"cu_seqlens must not decrease"):
        naive_recurrent_kda(*one, cu_seqlens=torch.tensor([0, 30, 20, 40]))
    with pytest.raises(ValueError, match=r"cu_seqlens needs B == 1"):
        naive_recurrent_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10, 40]))
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] = \[2, 2, 8, 8\]"):
        naive_recurrent_kda(*one, cu_seqlens=[0, 10, 40], initial_state=torch.zeros(3, 2, 8, 8, dtype=q.dtype))
    # a list of offsets is taken as chunk_kda takes it, and gives chunk_kda's answer
    o_ref, s_ref = naive_recurrent_kda(*one, cu_seqlens=[0, 10, 40], output_final_state=True)
    o, s = chunk_kda(*one, cu_seqlens=[0, 10, 40], output_final_state=True, chunk_size=16)
    assert_close("o", o_ref, o, 1e-10)
    assert_close("final_state", s_ref, s, 1e-10)
