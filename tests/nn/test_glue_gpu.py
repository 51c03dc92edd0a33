"""The TileLang short conv + SiLU + L2Norm kernels (kda_cp.kernels.conv), forward and backward,
against the fp64 glue on the same bf16 inputs: dense batches, packed sequences, a CP halo, shards
shorter than the conv, input rows that are the first columns of a wider projection output, and
GVA's v with more heads than q and k."""

from __future__ import annotations

import pytest
import torch

from kda_cp import glue

from tests._utils import assert_close

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# The kernels compute in fp32 from the bf16 inputs: q/k/v, dx and dhalo differ from fp64 by the
# final bf16 rounding (~2e-3 relative RMS); the weight gradient stays fp32.
TOL_BF16 = 4e-3
TOL_DW = 1e-4


def _case(B, T, H, K, W, *, halo, cu, extra_cols, seed, start=0, HV=None):
    gen = torch.Generator().manual_seed(seed)
    HV = HV or H
    C = (2 * H + HV) * K
    proj = torch.randn(B, T, C + extra_cols, generator=gen).to(torch.bfloat16)
    w = torch.randn(C, W, generator=gen) / W**0.5
    h = torch.randn(B, W - 1, C, generator=gen).to(torch.bfloat16) if halo else torch.zeros(B, W - 1, C).to(torch.bfloat16)
    lags = None if cu is None else glue.lags_in_sequence(torch.tensor(cu), start, T, W - 1, "cpu")
    dys = [torch.randn(B, T, H, n * K // H, generator=gen).to(torch.bfloat16) for n in (H, H, HV)]
    return proj, w, h, lags, dys


def _splits(H, K, HV=None):
    return (H * K, H * K, (HV or H) * K)


def _grads(proj, w, h, lags, dys, H, K, device, dtype, compiled, HV=None):
    C = sum(_splits(H, K, HV))
    p = proj.to(device=device, dtype=dtype).requires_grad_(True)
    wd = w.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype).requires_grad_(True)
    hd = h.to(device=device, dtype=dtype).requires_grad_(True)
    ld = None if lags is None else lags.to(device)
    q, k, v = glue.conv_silu_norm(p[..., :C], wd, _splits(H, K, HV), K, 1e-6, halo=hd, lags=ld, compiled=compiled)
    grads = torch.autograd.grad((q, k, v), (p, wd, hd), [d.to(device=device, dtype=dtype) for d in dys])
    return (q, k, v), (grads[0][..., :C], grads[1], grads[2])


# cu: global offsets of packed sequences; start: the shard's first global position
# HV: GVA's value heads (v has HV * K channels; None: H)
CASES = pytest.mark.parametrize("B,T,H,K,halo,cu,start,extra,HV", [
    (2, 333, 2, 128, False, None, 0, 0, None),             # T not a multiple of the 61/64-row tiles
    (1, 1000, 2, 128, False, [0, 300, 301, 302, 777, 1000], 0, 16, None),  # packed, one-token sequences
    (2, 200, 3, 64, True, None, 0, 0, None),               # a CP shard with its halo, K = 64
    (1, 250, 2, 128, True, [0, 42, 43, 290], 40, 8, None),  # a shard whose first sequence began before it
    (1, 2, 2, 128, True, None, 0, 0, None),                # shorter than the conv: rows from the halo
    (2, 10000, 4, 128, False, None, 0, 200, None),         # several tiles per block (odd counts), batch rows
    (1, 9000, 2, 128, True, [0, 70, 4000, 4001, 9050], 50, 0, None),  # packed over several tiles per block
    (1, 1000, 2, 128, True, [0, 300, 301, 1020], 20, 8, 4),  # GVA: v of 4 heads against q, k of 2, packed
    (2, 333, 1, 64, True, None, 0, 0, 3),                  # GVA with HV / H = 3, K = 64, a halo
], ids=["dense", "packed", "halo-K64", "halo-packed", "short", "long", "long-packed", "gva-packed", "gva-K64"])


@pytest.mark.parametrize("mode", ["bwd", "all"])
@CASES
def test_conv_kernel_matches_fp64(B, T, H, K, halo, cu, start, extra, HV, mode, monkeypatch):
    monkeypatch.setenv("KDA_CP_GLUE_KERNELS", mode)
    W = 4
    args = _case(B, T, H, K, W, halo=halo, cu=cu, extra_cols=extra, seed=T + 7 * H, start=start, HV=HV)
    (ref_out, ref_grads) = _grads(*args, H, K, "cpu", torch.float64, compiled=False, HV=HV)
    (out, grads) = _grads(*args, H, K, "cuda", torch.bfloat16, compiled=True, HV=HV)
    C = sum(_splits(H, K, HV))
    assert glue._use_kernel(args[0].cuda()[..., :C], args[1].cuda(), _splits(H, K, HV), K, "bwd"), \
        "the case must run on the TileLang kernels"
    for name, r, o in zip("qkv", ref_out, out):
        assert_close(name, r, o.cpu(), TOL_BF16)
    assert_close("dx", ref_grads[0], grads[0].cpu(), TOL_BF16)
    assert_close("dweight", ref_grads[1], grads[1].cpu(), TOL_DW)
    if halo:
        assert_close("dhalo", ref_grads[2], grads[2].cpu(), TOL_BF16)
    else:
        assert torch.isfinite(grads[2]).all()


@pytest.mark.parametrize("mode", ["bwd", "all"])
def test_conv_kernel_packed_does_not_mix_sequences(mode, monkeypatch):
    """A change to one packed sequence's inputs leaves every other sequence's outputs and input
    gradients bit-identical (no tap crosses a cu_seqlens boundary, forward or backward)."""
    monkeypatch.setenv("KDA_CP_GLUE_KERNELS", mode)
    H, K, W, T = 2, 128, 4, 500
    cu = [0, 130, 131, 400, 500]
    proj, w, h, lags, dys = _case(1, T, H, K, W, halo=False, cu=cu, extra_cols=0, seed=3)
    out_a, gr_a = _grads(proj, w, h, lags, dys, H, K, "cuda", torch.bfloat16, compiled=True)
    proj2 = proj.clone()
    proj2[:, 131:400] = torch.randn(1, 269, proj.shape[-1]).to(torch.bfloat16)
    dys2 = [d.clone() for d in dys]
    for d in dys2:
        d[:, 131:400] = torch.randn_like(d[:, 131:400].float()).to(torch.bfloat16)
    out_b, gr_b = _grads(proj2, w, h, lags, dys2, H, K, "cuda", torch.bfloat16, compiled=True)
    keep = torch.ones(T, dtype=torch.bool)
    keep[131:400] = False
    for a, b in zip(out_a, out_b):
        assert torch.equal(a[:, keep], b[:, keep])
    assert torch.equal(gr_a[0][:, keep], gr_b[0][:, keep])
    assert not torch.equal(gr_a[0][:, ~keep], gr_b[0][:, ~keep])


# The gated RMSNorm and the gate's backward (kda_cp.kernels.norm) against the fp64 glue on the same
# bf16 inputs. Outputs carry one bf16 rounding; the parameter gradients are fp32 sums.
NORM_CASES = pytest.mark.parametrize("B,T,H,V", [(2, 333, 3, 128), (1, 1001, 4, 64), (1, 7, 1, 128)],
                                     ids=["T333-V128", "T1001-V64", "T7"])


def _norm_run(x, w, gate, dy, device, dtype, wdtype):
    leaves = [x.to(device, dtype).requires_grad_(True), w.to(device, wdtype).requires_grad_(True),
              gate.to(device, dtype).requires_grad_(True)]
    y = glue.rms_norm_gated(*leaves, 1e-6, compiled=device == "cuda")
    return [y, *torch.autograd.grad(y, leaves, dy.to(device, y.dtype))]


@NORM_CASES
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w-fp32", "w-bf16"])
def test_rms_norm_gated_kernels_match_fp64(B, T, H, V, wdtype, monkeypatch):
    monkeypatch.setenv("KDA_CP_GLUE_KERNELS", "all")
    from kda_cp.kernels.norm import norm_supported

    gen = torch.Generator().manual_seed(T + H)
    x = (3 * torch.randn(B, T, H, V, generator=gen)).to(torch.bfloat16).double()
    w = (1 + 0.3 * torch.randn(V, generator=gen)).to(wdtype).double()
    gate = (2 * torch.randn(B, T, H * V, generator=gen)).to(torch.bfloat16).double()
    dy = torch.randn(B, T, H * V, generator=gen).to(torch.bfloat16).double()
    xc = x.to("cuda", torch.bfloat16)
    assert norm_supported(xc, w.to("cuda", wdtype), xc.view(B, T, H * V), torch.bfloat16)[0]
    want = _norm_run(x, w, gate, dy, "cpu", torch.float64, torch.float64)
    got = _norm_run(x, w, gate, dy, "cuda", torch.bfloat16, wdtype)
    # the weight gradient is an fp32 sum, returned in the weight's dtype (one bf16 rounding for a bf16 weight)
    tol_dw = TOL_DW if wdtype == torch.float32 else TOL_BF16
    for name, a, b, tol in zip(["y", "dx", "dweight", "dgate"], want, got, [TOL_BF16, TOL_BF16, tol_dw, TOL_BF16]):
        assert_close(name, a, b.cpu(), tol)


GATE_CASES = pytest.mark.parametrize("B,T,HV,K", [(2, 333, 3, 128), (1, 1001, 4, 64), (1, 5, 2, 128)],
                                     ids=["T333-K128", "T1001-K64", "T5"])


@GATE_CASES
@pytest.mark.parametrize("g_min", [-5.0, None], ids=["bounded", "softplus"])
def test_gate_backward_kernel_matches_fp64(B, T, HV, K, g_min, monkeypatch):
    monkeypatch.setenv("KDA_CP_GLUE_KERNELS", "all")
    gen = torch.Generator().manual_seed(T + HV)
    z = (3 * torch.randn(B, T, HV, K, generator=gen)).to(torch.bfloat16).double()
    A = 0.5 * torch.randn(HV, generator=gen, dtype=torch.float64)
    dt = torch.randn(HV * K, generator=gen, dtype=torch.float64)
    b = torch.randn(B, T, HV, generator=gen).to(torch.bfloat16).double()
    dg = torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64)
    dbeta = torch.randn(B, T, HV, generator=gen, dtype=torch.float64)

    def run(device, zdtype, pdtype):
        leaves = [z.to(device, zdtype), A.to(device, pdtype), dt.to(device, pdtype), b.to(device, zdtype)]
        leaves = [t.requires_grad_(True) for t in leaves]
        g, beta = glue.kda_gate(*leaves[:3], g_min, leaves[3], compiled=device == "cuda")
        return [g, beta, *torch.autograd.grad([g, beta], leaves, [dg.to(device, g.dtype), dbeta.to(device, beta.dtype)])]

    from kda_cp.kernels.norm import gate_supported

    assert gate_supported(z.to("cuda", torch.bfloat16), A.cuda().float(), dt.cuda().float())[0], \
        "the case must run on the kernel"
    want = run("cpu", torch.float64, torch.float64)
    got = run("cuda", torch.bfloat16, torch.float32)
    for name, a, b_, tol in zip(["g", "beta", "dz", "dA_log", "ddt_bias", "db"], want, got,
                                [1e-5, 1e-5, TOL_BF16, TOL_DW, TOL_DW, TOL_BF16]):
        assert_close(name, a, b_.cpu(), tol)


@pytest.mark.parametrize("blocks", [3, 1000], ids=["3-blocks-walk", "more-blocks-than-tiles"])
def test_glue_backward_kernels_walk_many_tiles(blocks, monkeypatch):
    """The walking backward kernels with a forced block count: 3 blocks over 32 tiles (each block
    sums its partials over 10-11 tiles), and more blocks than tiles (idle blocks write zeros)."""
    monkeypatch.setenv("KDA_CP_GLUE_KERNELS", "all")
    from kda_cp.kernels import norm

    monkeypatch.setattr(norm, "_walkers", lambda ntile, x, per_sm, per_tile_blocks=1: blocks)
    gen = torch.Generator().manual_seed(blocks)
    B, T, H, V = 1, 1013, 1, 128  # 32 tiles of 32 rows, the last one partial
    x = (3 * torch.randn(B, T, H, V, generator=gen)).to(torch.bfloat16).double()
    w = (1 + 0.3 * torch.randn(V, generator=gen)).double()
    gate = (2 * torch.randn(B, T, H * V, generator=gen)).to(torch.bfloat16).double()
    dy = torch.randn(B, T, H * V, generator=gen).to(torch.bfloat16).double()
    want = _norm_run(x, w, gate, dy, "cpu", torch.float64, torch.float64)
    got = _norm_run(x, w, gate, dy, "cuda", torch.bfloat16, torch.float32)
    for name, a, b, tol in zip(["y", "dx", "dweight", "dgate"], want, got, [TOL_BF16, TOL_BF16, TOL_DW, TOL_BF16]):
        assert_close(name, a, b.cpu(), tol)
    z = (3 * torch.randn(B, T, 2, 128, generator=gen)).to(torch.bfloat16).double()
    A, dt = 0.5 * torch.randn(2, generator=gen, dtype=torch.float64), torch.randn(256, generator=gen, dtype=torch.float64)
    dg = torch.randn(B, T, 2, 128, generator=gen, dtype=torch.float64)
    res = []
    for device, zdt, pdt in (("cpu", torch.float64, torch.float64), ("cuda", torch.bfloat16, torch.float32)):
        leaves = [t.to(device, d).requires_grad_(True) for t, d in ((z, zdt), (A, pdt), (dt, pdt))]
        g, _ = glue.kda_gate(*leaves, -5.0, compiled=device == "cuda")
        res.append(torch.autograd.grad(g, leaves, dg.to(device, g.dtype)))
    for name, a, b, tol in zip(["dz", "dA_log", "ddt_bias"], *res, [TOL_BF16, TOL_DW, TOL_DW]):
        assert_close(name, a, b.cpu(), tol)
