"""TileLang KDA backward vs fp64 autograd of the per-token recurrence, on a Hopper GPU (marker ``gpu``).

Every case draws fresh random inputs on the device (no fixed seed): q, k (L2-normalised), v ~ N(0, 1),
gates g = -5 * sigmoid(randn) per channel (down to the bound), beta ~ U(0, 1) per token, do ~ N(0, 1),
and, where the case says so, h0 and dht ~ N(0, 1). The oracle is torch autograd of
kda_cp.reference.naive_recurrent_kda in fp64 on the same bf16/fp16-rounded inputs.

Tolerances: relative RMS <= 8e-3 for dq, dk, dv, dh0 and <= 2e-2 for dg, dbeta.
``test_stages_match_mirror`` compares every intermediate of the kernels with the fp64 mirror
(tests/_bwd_mirror.py) so that a failure names the stage.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU too; conftest skips the gpu marker
    pytest.skip("needs CUDA", allow_module_level=True)

kernels = pytest.importorskip("kda_cp.kernels")
from kda_cp.kernels import backward  # noqa: E402
from tests._bwd_mirror import chunk_kda_bwd_mirror  # noqa: E402
from kda_cp.reference import naive_recurrent_kda  # noqa: E402
from tests._utils import assert_close, rel_rms  # noqa: E402

TOL = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2}
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")




def make(B, T, H, K, V, n_states, *, dtype=torch.bfloat16, g_min=-5.0):
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device=dev).to(dtype)
    g = (g_min * torch.sigmoid(torch.randn(B, T, H, K, device=dev))).contiguous()
    beta = torch.rand(B, T, H, device=dev)
    do = torch.randn(B, T, H, V, device=dev).to(dtype)
    h0 = torch.randn(n_states, H, K, V, device=dev)
    dht = torch.randn(n_states, H, K, V, device=dev)
    return q, k, v, g, beta, do, h0, dht


def assert_grads_close(ref, out):
    """Every gradient (NAMES order) within TOL of the reference; a failure lists all that fail."""
    errs = {}
    for name, r, o in zip(NAMES, ref, out):
        try:
            assert_close(name, r, o, TOL[name])
        except AssertionError as e:
            errs[name] = str(e)
    assert not errs, errs


def oracle_grads(q, k, v, g, beta, scale, h0, do, dht, cu_seqlens=None):
    """fp64 autograd of the recurrence; returns (dq, dk, dv, dg, dbeta, dh0)."""
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    h0d = (h0 if h0 is not None else torch.zeros(n, H, K, V, device=q.device)).double()
    leaves = [x.double().requires_grad_(True) for x in (q, k, v, g, beta)] + [h0d.requires_grad_(True)]
    o, ht = naive_recurrent_kda(*leaves[:5], scale=scale, initial_state=leaves[5], output_final_state=True,
                                cu_seqlens=cu_seqlens)
    outs, grads = [o], [do.double()]
    if dht is not None:
        outs.append(ht)
        grads.append(dht.double())
    return torch.autograd.grad(outs, leaves, grads)


CASES = [  # (B, T, H, K, with_h0, with_dht, dtype)
    (1, 63, 4, 128, True, True, torch.bfloat16),
    (2, 64, 1, 64, False, True, torch.bfloat16),
    (1, 1000, 4, 128, True, True, torch.bfloat16),
    (2, 1000, 1, 64, True, False, torch.bfloat16),
    (1, 4096, 4, 64, True, True, torch.bfloat16),
    (1, 4096, 1, 128, False, False, torch.bfloat16),
    (1, 1000, 2, 64, True, True, torch.float16),
]


@pytest.mark.parametrize(
    "B,T,H,K,with_h0,with_dht,dtype", CASES,
    ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{'h0' if c[4] else 'noh0'}-{'dht' if c[5] else 'nodht'}-"
         f"{str(c[6]).split('.')[-1]}" for c in CASES])
def test_bwd_matches_fp64_autograd(B, T, H, K, with_h0, with_dht, dtype):
    V = K
    q, k, v, g, beta, do, h0, dht = make(B, T, H, K, V, B, dtype=dtype)
    h0 = h0 if with_h0 else None
    dht = dht if with_dht else None
    scale = K ** -0.5
    out = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht)
    assert_grads_close(oracle_grads(q, k, v, g, beta, scale, h0, do, dht), out)


def test_state_grad_matches_autograd():
    """chunk_kda_state_grad = dh0 of <o, do> with dht = 0, independent of h0."""
    B, T, H, K = 2, 1000, 4, 128
    q, k, v, g, beta, do, h0, _ = make(B, T, H, K, K, B)
    scale = K ** -0.5
    G = backward.chunk_kda_state_grad(q, k, v, g, beta, scale=scale, do=do)
    ref = oracle_grads(q, k, v, g, beta, scale, h0, do, None)[5]
    assert_close("state_grad", ref, G, TOL["dh0"])
    full = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=None)[5]
    assert_close("state_grad vs bwd dh0", full, G, 1e-5)


def test_prepared_is_shared_by_state_grad_and_bwd():
    """How the CP backward runs the chunk-local kernel once: the state gradient (per packed sequence)
    and the backward given the forward's PreparedForward equal the calls that recompute it, bitwise;
    the backward consumes it, and a consumed or foreign one is refused."""
    lens = [300, 17, 500]
    H, K = 3, 128
    T = sum(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v, g, beta, do, h0, dht = make(1, T, H, K, K, len(lens))
    scale = K ** -0.5
    prep = kernels.chunk_kda_fwd_prepare(q, k, v, g, beta, scale=scale, cu_seqlens=cu)
    G1 = backward.chunk_kda_state_grad(q, k, v, g, beta, scale=scale, do=do, cu_seqlens=cu, prepared=prep)
    G2 = backward.chunk_kda_state_grad(q, k, v, g, beta, scale=scale, do=do, cu_seqlens=cu)
    assert torch.equal(G1, G2)
    ref = oracle_grads(q, k, v, g, beta, scale, h0, do, None, cu_seqlens=cu)[5]
    assert_close("state_grad per sequence", ref, G1, TOL["dh0"])
    with pytest.raises(ValueError, match="prepared"):
        backward.chunk_kda_state_grad(q, k, v, g, beta, scale=scale * 2, do=do, cu_seqlens=cu, prepared=prep)
    a = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht, cu_seqlens=cu,
                               prepared=prep)
    assert prep.tensors is None, "chunk_kda_bwd must consume the prepared tensors"
    b = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht, cu_seqlens=cu)
    for name, x, y in zip(NAMES, a, b):
        assert torch.equal(x, y), f"{name} differs with a shared PreparedForward"
    with pytest.raises(ValueError, match="consumed"):
        backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht, cu_seqlens=cu,
                               prepared=prep)


def test_forward_keeps_part_of_the_chunk_local_tensors():
    """chunk_kda's autograd keeps W, U, Aqk, eC from the forward and remakes Qg, Kd in the backward:
    the gradients equal those of the backward that recomputes everything, bitwise (packed sequences,
    h0 and dht), also on a second backward over the same graph; the remade Qg, Kd
    equal the chunk-local kernel's bitwise."""
    from kda_cp import chunk_kda

    lens = [300, 17, 500, 64, 29]
    H, K = 3, 128
    T = sum(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v, g, beta, do, h0, dht = make(1, T, H, K, K, len(lens))
    scale = K ** -0.5
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_kda(*leaves[:5], scale=scale, initial_state=leaves[5], output_final_state=True,
                      cu_seqlens=cu, backend="tilelang")
    ref = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht, cu_seqlens=cu)
    for attempt in range(2):
        got = torch.autograd.grad((o, ht), leaves, (do, dht), retain_graph=True)
        for name, x, y in zip(NAMES, got, ref):
            assert torch.equal(x, y.to(x.dtype)), f"{name} differs (backward {attempt}) with the kept tensors"
    full = kernels.chunk_kda_fwd_prepare(q, k, v, g, beta, scale=scale, cu_seqlens=cu)
    kept = kernels.keep_for_backward(full)
    assert len(kept) == 4
    thin = kernels.restore_prepared(q, k, v, g, beta, kept, scale=scale, cu_seqlens=cu)
    assert thin.tensors[2] is None and thin.tensors[3] is None
    backward.chunk_kda_state_grad(q, k, v, g, beta, scale=scale, do=do, cu_seqlens=cu, prepared=thin)
    for i, name in ((2, "Qg"), (3, "Kd")):
        assert torch.equal(thin.tensors[i], full.tensors[i]), f"remade {name} differs from the chunk-local kernel's"
    with pytest.raises(ValueError, match="backward keeps"):
        kernels.chunk_kda_summary_prepared(kernels.restore_prepared(q, k, v, g, beta, kept, scale=scale,
                                                                    cu_seqlens=cu))


def test_varlen_padding_zeros():
    """Packed sequences with per-sequence h0/dht and a padding tail past cu_seqlens[-1]."""
    lens = [15, 241, 0, 500, 64, 47]
    tail = 77
    H, K = 4, 128
    T = sum(lens) + tail
    n = len(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v, g, beta, do, h0, dht = make(1, T, H, K, K, n)
    scale = K ** -0.5
    out = backward.chunk_kda_bwd(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht,
                                 cu_seqlens=cu)
    P = sum(lens)
    for name, o in zip(NAMES[:5], out[:5]):
        assert torch.isfinite(o).all(), f"{name}: non-finite"
        assert torch.equal(o[:, P:], torch.zeros_like(o[:, P:])), f"{name}: padding tail is not exactly zero"
    ref = oracle_grads(*(x[:, :P] for x in (q, k, v, g, beta)), scale, h0, do[:, :P], dht, cu_seqlens=cu)
    assert_grads_close(ref, [x[:, :P] for x in out[:5]] + [out[5]])


def test_stages_match_mirror():
    """Each kernel stage vs the fp64 mirror's intermediates (B = 1, T = 200 with a partial chunk)."""
    from kda_cp.kernels import _common
    from kda_cp.kernels.launch import kernel_inputs
    from kda_cp.kernels.bwd_intra import build_bwd_dk_kernel, build_bwd_dv_kernel, build_bwd_ut_kernel
    from kda_cp.kernels.bwd_state import build_bwd_state_kernel

    B, T, H, K, V, C = 1, 200, 2, 64, 64, 64
    q, k, v, g, beta, do, h0, dht = make(B, T, H, K, V, B)
    scale = K ** -0.5
    st = {}
    d = lambda x: x.double()  # noqa: E731
    ref = chunk_kda_bwd_mirror(d(q), d(k), d(v), d(g), d(beta), scale=scale, initial_state=d(h0), do=d(do),
                               dht=d(dht), stages=st)
    tables = _common.build_chunk_tables(B, T, None, C, q.device)
    NC = tables.num_chunks
    qf, kf, vf, gf, bf = kernel_inputs(q, k, v, g, beta)
    dt = "bfloat16"
    W, U, Qg, Kd, Aqk, Ec = backward._recompute_intra(qf, kf, vf, gf, bf, tables, H, K, V, C, dt, scale,
                                                       q.dtype, q.device)
    Hs = torch.empty(NC, H, K, V, device="cuda", dtype=q.dtype)
    dHs = torch.empty_like(Hs)
    dh0 = torch.empty(B, H, K, V, device="cuda")
    for walk in ("forward", "reverse"):
        build_bwd_state_kernel(None, K, V, C, dt, walk=walk)(
            W, U, Qg, Kd, Aqk, Ec, do.view(T, H, V), tables.seq_table, h0, dht, Hs, dHs, dh0)
    f32 = dict(device="cuda", dtype=torch.float32)
    mid = dict(device="cuda", dtype=torch.bfloat16)  # dAqk, dQg, dKd, dB, dGk are stored in bf16
    dAqk = torch.empty(NC, H, C, C, **mid)
    dQg, dKd = torch.empty(NC, H, C, K, **mid), torch.empty(NC, H, C, K, **mid)
    dEc = torch.empty(NC, H, K, **f32)
    dW = torch.empty(NC, H, C, K, device="cuda", dtype=q.dtype)
    dU = torch.empty(NC, H, C, V, device="cuda", dtype=q.dtype)
    build_bwd_dv_kernel(None, K, V, C, dt)(W, U, Kd, Aqk, Hs, dHs, do.view(T, H, V), tables.chunk_table,
                                           dAqk, dQg, dKd, dEc, dW, dU)
    dv = torch.zeros(T, H, V, device="cuda", dtype=q.dtype)
    dbeta = torch.zeros(T, H, **f32)
    dB = torch.empty(NC, H, C, C, **mid)
    dGk = torch.empty(NC, H, C, K, **mid)
    build_bwd_ut_kernel(None, K, V, C, dt)(kf, vf, gf, bf, tables.chunk_table, W, U, dW, dU, dv, dbeta, dB, dGk)
    dq = torch.zeros(T, H, K, device="cuda", dtype=q.dtype)
    dk = torch.zeros_like(dq)
    dg = torch.zeros(T, H, K, **f32)
    build_bwd_dk_kernel(None, K, C, dt, scale=scale)(qf, kf, gf, tables.chunk_table, dAqk, dB, dQg, dKd, dGk,
                                                     dEc, dq, dk, dg)

    def mir(name):  # mirror [1, H, N, C, *] -> kernel layout [NC, H, C, *]
        x = st[name][0]
        return x.transpose(0, 1)

    got = dict(W=W, U=U, Qg=Qg, Kd=Kd, Aqk=Aqk, eC=Ec, Hs=Hs, dHs=dHs, dAqk=dAqk, dQg=dQg, dKd=dKd, deC=dEc,
               dW=dW, dU=dU, dB=dB, dGk=dGk)
    errs = {}
    for name, x in got.items():
        e = rel_rms(mir(name), x)
        print(f"stage {name}: rel_rms={e:.3e}")
        if not e <= 2e-2:
            errs[name] = e
    for name, r, o in zip(NAMES, ref, [dq[None], dk[None], dv[None], dg[None], dbeta[None], dh0]):
        e = rel_rms(r, o)
        print(f"final {name}: rel_rms={e:.3e}")
        if not e <= TOL[name]:
            errs[name] = e
    assert not errs, errs


def test_input_validation():
    q, k, v, g, beta, do, h0, dht = make(1, 64, 2, 128, 128, 1)
    with pytest.raises(ValueError, match="do"):
        backward.chunk_kda_bwd(q, k, v, g, beta, scale=0.1, do=do[..., :64].contiguous())
    with pytest.raises(ValueError, match="dht"):
        backward.chunk_kda_bwd(q, k, v, g, beta, scale=0.1, do=do, dht=dht.double())
