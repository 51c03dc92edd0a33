"""The TileLang short conv + SiLU + L2Norm kernels (kda_cp.kernels.conv), forward and backward,
against the fp64 glue on the same bf16 inputs: dense batches, packed sequences, a CP halo, shards
shorter than the conv, and input rows that are the first columns of a wider projection output."""

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


def _case(B, T, H, K, W, *, halo, cu, extra_cols, seed, start=0):
    gen = torch.Generator().manual_seed(seed)
    C = 3 * H * K
    proj = torch.randn(B, T, C + extra_cols, generator=gen).to(torch.bfloat16)
    w = torch.randn(C, W, generator=gen) / W**0.5
    h = torch.randn(B, W - 1, C, generator=gen).to(torch.bfloat16) if halo else torch.zeros(B, W - 1, C).to(torch.bfloat16)
    lags = None if cu is None else glue.lags_in_sequence(torch.tensor(cu), start, T, W - 1, "cpu")
    dys = [torch.randn(B, T, H, K, generator=gen).to(torch.bfloat16) for _ in range(3)]
    return proj, w, h, lags, dys


def _grads(proj, w, h, lags, dys, H, K, device, dtype, compiled):
    C = 3 * H * K
    p = proj.to(device=device, dtype=dtype).requires_grad_(True)
    wd = w.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype).requires_grad_(True)
    hd = h.to(device=device, dtype=dtype).requires_grad_(True)
    ld = None if lags is None else lags.to(device)
    q, k, v = glue.conv_silu_norm(p[..., :C], wd, (H * K,) * 3, K, 1e-6, halo=hd, lags=ld, compiled=compiled)
    grads = torch.autograd.grad((q, k, v), (p, wd, hd), [d.to(device=device, dtype=dtype) for d in dys])
    return (q, k, v), (grads[0][..., :C], grads[1], grads[2])


# cu: global offsets of packed sequences; start: the shard's first global position
CASES = pytest.mark.parametrize("B,T,H,K,halo,cu,start,extra", [
    (2, 333, 2, 128, False, None, 0, 0),                   # T not a multiple of the 61/64-row tiles
    (1, 1000, 2, 128, False, [0, 300, 301, 302, 777, 1000], 0, 16),  # packed, one-token sequences
    (2, 200, 3, 64, True, None, 0, 0),                     # a CP shard with its halo, K = 64
    (1, 250, 2, 128, True, [0, 42, 43, 290], 40, 8),       # a shard whose first sequence began before it
    (1, 2, 2, 128, True, None, 0, 0),                      # shorter than the conv: rows from the halo
    (2, 10000, 4, 128, False, None, 0, 200),               # several tiles per block (odd counts), batch rows
    (1, 9000, 2, 128, True, [0, 70, 4000, 4001, 9050], 50, 0),  # packed over several tiles per block
], ids=["dense", "packed", "halo-K64", "halo-packed", "short", "long", "long-packed"])


@pytest.mark.parametrize("mode", ["bwd", "all"])
@CASES
def test_conv_kernel_matches_fp64(B, T, H, K, halo, cu, start, extra, mode, monkeypatch):
    monkeypatch.setenv("KDA_CP_GLUE_KERNELS", mode)
    W = 4
    args = _case(B, T, H, K, W, halo=halo, cu=cu, extra_cols=extra, seed=T + 7 * H, start=start)
    (ref_out, ref_grads) = _grads(*args, H, K, "cpu", torch.float64, compiled=False)
    (out, grads) = _grads(*args, H, K, "cuda", torch.bfloat16, compiled=True)
    assert glue._use_kernel(args[0].cuda()[..., : 3 * H * K], args[1].cuda(), (H * K,) * 3, K, "bwd"), \
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
