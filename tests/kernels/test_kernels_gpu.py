"""TileLang forward kernels vs the fp64 per-token recurrence, on a Hopper GPU (marker ``gpu``).

Every case draws fresh random inputs on the device: q, k (L2-normalised, as in the KDA layer),
v ~ N(0, 1), beta ~ U(0, 1), and per-channel gates down to the bound. Two gate laws:

* "bound":  g = g_min * sigmoid(randn), every channel decays fast (most memory gone in a few steps);
* "mixed":  g = g_min * sigmoid(randn + b_d) with a per-channel bias b_d in [-8, 3], so some channels
  hold their state over thousands of tokens (exercises the state pass and the summary's M) while
  others still reach g_min.

The oracle (kda_cp.reference.naive_recurrent_kda) runs in fp64 on the same bf16/fp16-rounded inputs.
Tolerances: relative RMS <= 5e-3 for o and the final state; <= 1e-3 for the summary.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu marker
    pytest.skip("needs CUDA", allow_module_level=True)

from kda_cp.reference import naive_recurrent_kda  # noqa: E402
from tests._utils import assert_close  # noqa: E402

kernels = pytest.importorskip("kda_cp.kernels")
from kda_cp.kernels._common import STATE_LAUNCHES  # noqa: E402

FWD_TOL = 5e-3
SUMMARY_TOL = 1e-3




def make(B, T, H, K, V, *, dtype=torch.bfloat16, gates="bound", g_min=-5.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def rnd(*s):
        return torch.randn(*s, generator=gen, device=dev, dtype=torch.float32)

    q = rnd(B, T, H, K).to(dtype)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(dtype)
    v = rnd(B, T, H, V).to(dtype)
    if gates == "bound":
        g = g_min * torch.sigmoid(rnd(B, T, H, K))
    else:
        bias = torch.linspace(-8.0, 3.0, K, device=dev)[torch.randperm(K, generator=gen, device=dev)]
        g = g_min * torch.sigmoid(rnd(B, T, H, K) + bias)
    beta = torch.rand(B, T, H, generator=gen, device=dev, dtype=torch.float32)
    return q, k, v, g.contiguous(), beta


def oracle(q, k, v, g, beta, scale, h0, cu_seqlens=None):
    d = lambda x: None if x is None else x.double()  # noqa: E731
    return naive_recurrent_kda(d(q), d(k), d(v), d(g), d(beta), scale=scale, initial_state=d(h0),
                               output_final_state=True, cu_seqlens=cu_seqlens)


FWD_CASES = [
    # (B, T, H, K, with_h0, gates, dtype)
    (1, 63, 4, 128, True, "bound", torch.bfloat16),
    (3, 64, 1, 64, False, "mixed", torch.bfloat16),
    (3, 1000, 4, 128, True, "mixed", torch.bfloat16),
    (1, 1000, 4, 64, True, "mixed", torch.float16),
    (1, 4096, 32, 128, False, "bound", torch.bfloat16),
    (3, 4096, 4, 64, True, "mixed", torch.bfloat16),
    (1, 32768, 32, 128, True, "mixed", torch.bfloat16),
]


@pytest.mark.parametrize("B,T,H,K,with_h0,gates,dtype", FWD_CASES,
                         ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{'h0' if c[4] else 'noh0'}-{c[5]}-"
                              f"{str(c[6]).split('.')[-1]}" for c in FWD_CASES])
def test_fwd_matches_fp64_recurrence(B, T, H, K, with_h0, gates, dtype):
    V = K
    q, k, v, g, beta = make(B, T, H, K, V, dtype=dtype, gates=gates, seed=T + 7 * H + K)
    h0 = torch.randn(B, H, K, V, device="cuda") if with_h0 else None
    scale = K ** -0.5
    o, ht = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=scale, initial_state=h0,
                                  output_final_state=True)
    o_ref, ht_ref = oracle(q, k, v, g, beta, scale, h0)
    assert_close("o", o_ref, o, FWD_TOL)
    assert_close("final_state", ht_ref, ht, FWD_TOL)


@pytest.mark.parametrize("K,with_h0,gates", [(128, True, "mixed"), (64, False, "bound")])
def test_fwd_packed_sequences(K, with_h0, gates):
    lens = [15, 241, 500, 1200, 47]
    H, V = 4, K
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    q, k, v, g, beta = make(1, sum(lens), H, K, V, gates=gates, seed=K)
    h0 = torch.randn(len(lens), H, K, V, device="cuda") if with_h0 else None
    o, ht = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0,
                                  output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = oracle(q, k, v, g, beta, K ** -0.5, h0, cu_seqlens=cu)
    assert_close("o", o_ref, o, FWD_TOL)
    assert_close("final_state", ht_ref, ht, FWD_TOL)
    # each sequence separately: the packed run must not leak state across boundaries
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert_close(f"o[seq {i}]", o_ref[:, a:b], o[:, a:b], FWD_TOL)


@pytest.mark.parametrize("launch", STATE_LAUNCHES, ids=lambda x: f"bv{x[0]}-t{x[1]}")
@pytest.mark.parametrize("K,dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float16)])
def test_fwd_every_state_launch(K, dtype, launch, monkeypatch):
    """Every launch of the state + output pass (_common.STATE_LAUNCHES), forced whatever
    state_launch would pick for the shape, bf16 and fp16: packed sequences, one of them over several
    chunks and not a multiple of 64, with h0. (This test found (64, 256) wrong, which no other shape
    here reached.)"""
    from kda_cp.kernels import _common

    monkeypatch.setattr(_common, "state_launch", lambda *args: launch)
    lens = [100, 700, 33]
    H, V = 3, K
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    q, k, v, g, beta = make(1, sum(lens), H, K, V, dtype=dtype, gates="mixed", seed=K + launch[0])
    h0 = torch.randn(len(lens), H, K, V, device="cuda")
    o, ht = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0,
                                  output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = oracle(q, k, v, g, beta, K ** -0.5, h0, cu_seqlens=cu)
    assert_close("o", o_ref, o, FWD_TOL)
    assert_close("final_state", ht_ref, ht, FWD_TOL)


def test_fwd_causal():
    """Changing tokens after position t must leave o[:t+1] bit-identical (no future leak)."""
    B, T, H, K = 1, 200, 2, 128
    q, k, v, g, beta = make(B, T, H, K, K, gates="mixed", seed=3)
    o1, _ = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=K ** -0.5)
    for t in (0, 37, 64, 100, 143):  # inside sub-chunks, on chunk and sub-chunk boundaries
        g2, k2 = g.clone(), k.clone()
        g2[:, t + 1:] = -5.0 * torch.rand_like(g2[:, t + 1:])
        k2[:, t + 1:] = torch.randn_like(k2[:, t + 1:])
        o2, _ = kernels.chunk_kda_fwd(q, k2, v, g2, beta, scale=K ** -0.5)
        assert torch.equal(o1[:, : t + 1], o2[:, : t + 1]), f"future tokens changed o[:{t + 1}]"


def _summary_oracle(k, v, g, beta):
    B, T, H, K = k.shape
    V = v.shape[-1]
    v_aug = torch.cat([v.double(), torch.zeros(B, T, H, K, device=k.device, dtype=torch.float64)], -1)
    h0 = torch.cat([torch.zeros(B, H, K, V, device=k.device, dtype=torch.float64),
                    torch.eye(K, device=k.device, dtype=torch.float64).expand(B, H, K, K)], -1)
    _, s = naive_recurrent_kda(k.double(), k.double(), v_aug, g.double(), beta.double(), scale=1.0,
                               initial_state=h0, output_final_state=True)
    return s[..., V:], s[..., :V]


@pytest.mark.parametrize("B,T,H,K", [(2, 1000, 4, 128), (1, 333, 2, 64), (3, 40, 3, 128)])
def test_summary_matches_fp64(B, T, H, K):
    V = K
    _, k, v, g, beta = make(B, T, H, K, V, gates="mixed", seed=11 + T)
    M, St = kernels.chunk_kda_summary(k, v, g, beta)
    M_ref, St_ref = _summary_oracle(k, v, g, beta)
    assert_close("M", M_ref, M, SUMMARY_TOL)
    assert_close("S_tilde", St_ref, St, SUMMARY_TOL)


def test_summary_composes_to_final_state():
    """(M2, S2) o (M1, S1) applied to h0 equals the whole sequence's final state."""
    B, T, H, K = 1, 1100, 4, 128
    cut = 420  # not a multiple of the chunk size
    _, k, v, g, beta = make(B, T, H, K, K, gates="mixed", seed=5)
    h0 = torch.randn(B, H, K, K, device="cuda")
    halves = [(x[:, :cut].contiguous(), x[:, cut:].contiguous()) for x in (k, v, g, beta)]
    M1, S1 = kernels.chunk_kda_summary(*[h[0] for h in halves])
    M2, S2 = kernels.chunk_kda_summary(*[h[1] for h in halves])
    M, S = M2.double() @ M1.double(), M2.double() @ S1.double() + S2.double()
    composed = M @ h0.double() + S
    _, ht_ref = oracle(k, k, v, g, beta, 1.0, h0)
    assert_close("composed final state", ht_ref, composed, SUMMARY_TOL)
    Mw, Sw = kernels.chunk_kda_summary(k, v, g, beta)
    assert_close("whole-sequence M vs composed", M, Mw, SUMMARY_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_summary_prepared_matches_fp64(dtype):
    """The CP summary from the forward's chunk-local tensors (W, Kd, U in the input dtype; the state
    and V' in two pieces, bf16 for bf16 input, TF32 for fp16): M and S~ of each sequence, and of
    the last one alone, against fp64. Its factors are the forward's own, so the forward's tolerance
    for the final state applies (not the 1e-3 of the fp32 summary, which recomputes W and Kd in
    fp32)."""
    H, K = 3, 128
    lens = [700, 0, 45, 1333]  # not multiples of the chunk size; an empty sequence is the identity map
    T = sum(lens)
    q, k, v, g, beta = make(1, T, H, K, K, dtype=dtype, gates="mixed", seed=41)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    prep = kernels.chunk_kda_fwd_prepare(q, k, v, g, beta, scale=K**-0.5, cu_seqlens=cu)
    M, St = kernels.chunk_kda_summary_prepared(prep)
    Ml, Sl = kernels.chunk_kda_summary_prepared(prep, last_only=True)
    assert M.shape == (4, H, K, K) and Ml.shape == (1, H, K, K)
    assert_close("last_only M vs fp64", _summary_oracle(*(x[:, int(cu[-2]):] for x in (k, v, g, beta)))[0], Ml, FWD_TOL)
    assert torch.equal(M[1], torch.eye(K, device="cuda").expand(H, K, K)) and not St[1].any()
    check_per_sequence(M, St, cu, k, v, g, beta, FWD_TOL)


def check_per_sequence(M, St, cu, k, v, g, beta, tol):
    """Each non-empty packed sequence's (M, S~) rows against the fp64 summary of its own tokens."""
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:
            continue
        M_ref, St_ref = _summary_oracle(*(x[:, a:b] for x in (k, v, g, beta)))
        assert_close(f"M of sequence {i}", M_ref, M[i:i + 1], tol)
        assert_close(f"S_tilde of sequence {i}", St_ref, St[i:i + 1], tol)


@pytest.mark.parametrize("pieces", [1, 3, 5])
@pytest.mark.parametrize("inputs", ["bf16 prepared", "fp16 prepared", "fp32"])
def test_summary_pieces_match_fp64(pieces, inputs):
    """The summary state kernel with each sequence cut into pieces summarised in parallel and
    composed (pieces longer than, equal to and shorter than a sequence's chunk count; empty pieces)
    gives each packed sequence's (M, S~) within tolerance of fp64: from the forward's prepared
    tensors (the forward's tolerance: its factors are rounded to the input dtype), and from the
    fp32 summary intra kernel (3xTF32 everywhere: the summary tolerance)."""
    from kda_cp.kernels.launch import kernel_inputs, summary_run
    from kda_cp.kernels._common import build_chunk_tables
    from kda_cp.kernels.intra import build_intra_summary_kernel

    H, K, C = 3, 128, 64
    lens = [45, 1333, 0, 130, 700]
    T = sum(lens)
    dtype = torch.float16 if inputs.startswith("fp16") else torch.bfloat16
    q, k, v, g, beta = make(1, T, H, K, K, dtype=dtype, gates="mixed", seed=47 + pieces)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    if inputs == "fp32":
        tab = build_chunk_tables(1, T, cu, C, k.device)
        NC = tab.num_chunks
        e = lambda *s: torch.empty(*s, device="cuda", dtype=torch.float32)  # noqa: E731
        W, U, Kd, Ec = e(NC, H, C, K), e(NC, H, C, K), e(NC, H, K, C), e(NC, H, K)
        _, kf, vf, gf, bf = kernel_inputs(k, k, v, g, beta)
        build_intra_summary_kernel(None, K, K, C, "bfloat16")(kf, vf, gf, bf, tab.chunk_table, W, U, Kd, Ec)
        tol = SUMMARY_TOL
    else:
        W, U, _, Kd, _, Ec, tab = kernels.chunk_kda_fwd_prepare(q, k, v, g, beta, scale=K**-0.5, cu_seqlens=cu).tensors
        tol = FWD_TOL
    M, St = summary_run(W, U, Kd, Ec, tab.seq_table, tab.num_chunks, pieces)
    assert torch.equal(M[2], torch.eye(K, device="cuda").expand(H, K, K)) and not St[2].any()
    check_per_sequence(M, St, cu, k, v, g, beta, tol)


def _chain_fp64(W, U, Kd, Ec, c0, nc):
    """(M, S~) of chunks [c0, c0 + nc) in fp64 from the prepared tensors themselves:
    S <- (Diag(eC) - Kd^T W) S + Kd^T U, from [S~ | M] = [0 | I]."""
    W, U, Kd, Ec = (x.double() for x in (W, U, Kd, Ec))
    H, K, V = W.shape[1], W.shape[3], U.shape[3]
    M = torch.eye(K, dtype=torch.float64, device=W.device).expand(H, K, K)
    S = torch.zeros(H, K, V, dtype=torch.float64, device=W.device)
    for c in range(c0, c0 + nc):
        A = torch.diag_embed(Ec[c]) - Kd[c].transpose(-1, -2) @ W[c]
        M, S = A @ M, A @ S + Kd[c].transpose(-1, -2) @ U[c]
    return M, S


@pytest.mark.parametrize("dtype,K", [(torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float16, 128)])
def test_prepared_summary_arithmetic_matches_fp64_chain(dtype, K):
    """The summary state pass on the forward's 16-bit tensors (bf16: bf16 MMAs on two-piece splits
    of the state and V'; fp16: TF32 MMAs on two-piece splits) against the same chain in fp64 on the
    same tensors, whole and cut into pieces, per packed sequence: within 1e-4 relative, a tenth of
    the summary tolerance; one bf16 piece (2^-9 relative per product) would not be. H200: bf16
    at most 4.5e-6; fp16 up to 1.4e-5 on the 21-chunk sequence (the TF32 tail piece is
    truncated, not rounded, so its error adds up along the chain instead of averaging out)."""
    from kda_cp.kernels.launch import summary_run

    H = 2
    lens = [700, 45, 1333]
    q, k, v, g, beta = make(1, sum(lens), H, K, K, dtype=dtype, gates="mixed", seed=int(torch.randint(1 << 30, ())))
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    W, U, _, Kd, _, Ec, tab = kernels.chunk_kda_fwd_prepare(q, k, v, g, beta, scale=K**-0.5, cu_seqlens=cu).tensors
    for pieces in (None, 3):
        M, St = summary_run(W, U, Kd, Ec, tab.seq_table, tab.num_chunks, pieces)
        for i, (c0, nc) in enumerate(tab.seq_table[:, :2].tolist()):
            M_ref, St_ref = _chain_fp64(W, U, Kd, Ec, c0, nc)
            assert_close(f"M of sequence {i} (pieces {pieces})", M_ref, M[i], 1e-4)
            assert_close(f"S_tilde of sequence {i} (pieces {pieces})", St_ref, St[i], 1e-4)


def test_summary_prepared_composes_to_final_state():
    """Two halves' prepared summaries, composed and applied to h0, give the whole sequence's final state."""
    B, T, H, K = 2, 1500, 4, 128
    cut = 587
    q, k, v, g, beta = make(B, T, H, K, K, gates="mixed", seed=43)
    h0 = torch.randn(B, H, K, K, device="cuda")
    pairs = []
    for a, b in ((0, cut), (cut, T)):
        xs = [x[:, a:b].contiguous() for x in (q, k, v, g, beta)]
        pairs.append(kernels.chunk_kda_summary_prepared(kernels.chunk_kda_fwd_prepare(*xs, scale=K**-0.5)))
    (M1, S1), (M2, S2) = pairs
    composed = M2.double() @ (M1.double() @ h0.double() + S1.double()) + S2.double()
    _, ht_ref = oracle(q, k, v, g, beta, 1.0, h0)
    assert_close("composed final state", ht_ref, composed, FWD_TOL)


def test_is_supported_on_this_gpu():
    q, k, v, g, beta = make(1, 64, 2, 128, 128)
    ok, why = kernels.is_supported(q, k, v, g, beta)
    assert ok == (torch.cuda.get_device_capability()[0] == 9), why


def test_prepared_forward_equals_one_call():
    """chunk_kda_fwd_prepare + chunk_kda_fwd(prepared=...) (how CP overlaps the exchange) gives the
    one-call result bitwise; a prepared result for another scale or other tensors is refused."""
    B, T, H, K = 1, 777, 3, 128
    q, k, v, g, beta = make(B, T, H, K, K, gates="mixed", seed=5)
    cu = torch.tensor([0, 100, 600, 777], device="cuda")
    h0 = torch.randn(3, H, K, K, device="cuda")
    prep = kernels.chunk_kda_fwd_prepare(q, k, v, g, beta, scale=K**-0.5, cu_seqlens=cu)
    o1, f1 = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=K**-0.5, cu_seqlens=cu, initial_state=h0,
                                   output_final_state=True, prepared=prep)
    o2, f2 = kernels.chunk_kda_fwd(q, k, v, g, beta, scale=K**-0.5, cu_seqlens=cu, initial_state=h0,
                                   output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(f1, f2)
    with pytest.raises(ValueError, match="prepared"):
        kernels.chunk_kda_fwd(q, k, v, g, beta, scale=0.2, cu_seqlens=cu, initial_state=h0, prepared=prep)
    with pytest.raises(ValueError, match="prepared"):
        kernels.chunk_kda_fwd(q, k.clone(), v, g, beta, scale=K**-0.5, cu_seqlens=cu, initial_state=h0,
                              prepared=prep)
