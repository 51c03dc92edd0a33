"""chunk_kda(segment_len=...) on the TileLang kernels (marker ``gpu``): against fp64 autograd of the
per-token recurrence on the same bf16-rounded inputs, dense and packed, with initial and final
states and T not a multiple of 64; against the unsplit kernels (cuts on the chunk grid); and
bitwise equal from run to run; segment_len="auto" (the default) splitting few long chains exactly as
the explicit length does. Tolerances as the kernels' own tests: o and the final state 5e-3,
dq, dk, dv, dh0 8e-3, dg, dbeta 2e-2; split against unsplit 1e-3."""
import pytest
import torch

from kda_cp import chunk_kda, naive_recurrent_kda
from kda_cp.parallel.segments import AUTO_MIN_TOKENS, AUTO_SEGMENT_LEN, auto_segment_len
from tests._utils import assert_close

pytestmark = pytest.mark.gpu

TOL = {"o": 5e-3, "final_state": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dh0": 8e-3}


def _inputs(B, T, H, n, K=128):
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, K, device=dev).to(torch.bfloat16)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, device=dev))
    beta = torch.rand(B, T, H, device=dev)
    h0 = torch.randn(n, H, K, K, device=dev)
    do = torch.randn(B, T, H, K, device=dev).to(torch.bfloat16)
    dht = torch.randn(n, H, K, K, device=dev)
    return q, k, v, g, beta, h0, do, dht


def _run(fn, q, k, v, g, beta, h0, do, dht, cu, **kw):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, **kw)
    return [o, ht, *torch.autograd.grad((o, ht), leaves, (do, dht))]


@pytest.mark.parametrize("B,cu,L", [(1, None, 256), (2, None, 192), (1, [0, 300, 301, 1000], 128)],
                         ids=["dense", "dense-B2", "packed"])
def test_split_on_the_kernels_matches_fp64(B, cu, L):
    T, H = 1000, 2
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    inputs = _inputs(B, T, H, B if cu is None else len(cu) - 1)
    want = _run(naive_recurrent_kda, *(x.double() for x in inputs), cu_t)
    got = _run(chunk_kda, *inputs, cu_t, backend="tilelang", segment_len=L)
    for name, a, b in zip(TOL, want, got):
        assert_close(name, a.detach(), b.detach().double(), TOL[name])
    again = _run(chunk_kda, *inputs, cu_t, backend="tilelang", segment_len=L)
    for name, a, b in zip(TOL, got, again):
        assert torch.equal(a, b), f"{name}: not bitwise equal from run to run"
    plain = _run(chunk_kda, *inputs, cu_t, backend="tilelang", segment_len=None)
    for name, a, b in zip(TOL, plain, got):
        assert_close(f"{name} (split vs unsplit)", a.detach().double(), b.detach().double(), 1e-3)


def test_auto_splits_few_long_chains_as_the_explicit_length():
    T, H = AUTO_MIN_TOKENS + 333, 2  # one sequence, 2 heads of 128 columns: "auto" splits
    assert auto_segment_len((0, T), H, 128) == AUTO_SEGMENT_LEN
    inputs = _inputs(1, T, H, 1)
    auto = _run(chunk_kda, *inputs, None, backend="tilelang")
    explicit = _run(chunk_kda, *inputs, None, backend="tilelang", segment_len=AUTO_SEGMENT_LEN)
    for name, a, b in zip(TOL, auto, explicit):
        assert torch.equal(a, b), f"{name}: auto differs from segment_len={AUTO_SEGMENT_LEN}"
    plain = _run(chunk_kda, *inputs, None, backend="tilelang", segment_len=None)
    for name, a, b in zip(TOL, plain, auto):
        assert_close(f"{name} (auto vs unsplit)", a.detach().double(), b.detach().double(), 1e-3)
