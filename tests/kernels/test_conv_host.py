"""The host side of the conv + SiLU + L2Norm kernels (kda_cp.kernels.conv.conv_silu_norm_fwd/bwd) on
the CPU: each launch replaced by an fp64 stand-in that follows build_conv_kernel's documented
contract (which columns of x a part covers, the Y/dY layout, the partial weight-gradient rows), so
the wrappers' bookkeeping (the parts' head counts and first columns under GVA, the v output's
shape, the dv layout, the weight gradient's flip and transpose, dx and dhalo placement) is checked
against the eager glue without a GPU. The kernels' own numerics are tests/nn/test_glue_gpu.py's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tilelang")
from kda_cp import glue  # noqa: E402
from kda_cp.kernels import conv  # noqa: E402

EPS = 1e-6


def _part_forward(x, wt, halo, lags, nh, K, base, norm, packed, eps):
    """The kernel's math on x's columns base .. base + nh*K: fp64 [B*T, nh, K]."""
    B, T = halo.shape[0], x.shape[0] // halo.shape[0]
    W = wt.shape[0]
    cols = slice(base, base + nh * K)
    xs = torch.cat([halo[:, :, cols], x.view(B, T, -1)[:, :, cols]], dim=1)  # rows -(W-1) .. T-1
    pre = 0
    for lag in range(W):
        tap = wt[W - 1 - lag, cols] * xs[:, W - 1 - lag: W - 1 - lag + T]
        if packed:
            tap = tap * (lags >= lag).view(1, T, 1)
        pre = pre + tap
    y = torch.nn.functional.silu(pre).view(B, T, nh, K)
    if norm:
        y = y / y.norm(dim=-1, keepdim=True).clamp_min(eps)
    return y.reshape(B * T, nh, K)


def _stand_in(C, CS, H, K, W, part, dtype, halo_dtype, eps, *, backward, packed=True, launch=None,
              fast_math=True, base=None):
    base = part * H * K if base is None else base
    assert 0 <= base <= C - H * K

    def fwd(rows, wt, halo, lags, y, split):
        assert rows.shape[1] == CS and y.shape[1:] == (H, K)
        y.copy_(_part_forward(rows[:, :C], wt, halo, lags, H, K, base, part < 2, packed, eps))

    def bwd(rows, wt, halo, lags, dy, dx, dhalo, dwp):
        leaves = [t.detach().double().requires_grad_(True) for t in (rows[:, :C], wt, halo)]
        y = _part_forward(*leaves, lags, H, K, base, part < 2, packed, eps)
        gx, gw, gh = torch.autograd.grad(y, leaves, dy.double())
        cols = slice(base, base + H * K)
        dx[:, cols] = gx[:, cols].to(dx.dtype)
        dhalo[:, :, cols] = gh[:, :, cols].to(dhalo.dtype)
        # row u*4 + g holds tap W-1-u of row group g: the whole sum in (block 0, batch row 0, group 0)
        dwp[:, :, :, cols] = 0
        for u in range(W):
            dwp[0, 0, u * 4, cols] = gw[W - 1 - u, cols].to(dwp.dtype)

    return bwd if backward else fwd


@pytest.mark.parametrize("B,T,H,HV,K,halo,packed", [
    (2, 37, 2, 2, 8, False, False),   # q | k | v of equal widths
    (1, 50, 2, 4, 8, True, True),     # GVA: v of 4 heads from column 2 H K, a halo, packed sequences
    (2, 23, 1, 3, 16, True, False),   # GVA with HV / H = 3
])
def test_conv_wrappers_place_every_part(B, T, H, HV, K, halo, packed, monkeypatch):
    monkeypatch.setattr(conv, "build_conv_kernel", _stand_in)
    monkeypatch.setattr(conv, "_blocks", lambda ntile, heads, B, x, per_sm: 3)
    monkeypatch.setattr(conv, "tl_dtype", str)  # fp64 end to end (the kernels take bf16/fp16)
    gen = torch.Generator().manual_seed(T * 31 + HV)
    W, splits = 4, (H * K, H * K, HV * K)
    C = sum(splits)
    x = torch.randn(B, T, C + 8, generator=gen, dtype=torch.float64)[..., :C]  # rows inside a wider buffer
    weight = torch.randn(C, W, generator=gen).double()  # on the fp32 grid: the kernels take fp32 taps
    hx = torch.randn(B, W - 1, C, generator=gen, dtype=torch.float64) if halo else torch.zeros(B, W - 1, C,
                                                                                                dtype=torch.float64)
    lags = glue.lags_in_sequence([0, 11, 12, T + 5], 5, T, W - 1, "cpu") if packed else None
    dys = [torch.randn(B, T, H, s // H, generator=gen, dtype=torch.float64) for s in splits]

    leaves = [t.clone().requires_grad_(True) for t in (x, weight, hx)]
    ref = glue.conv_silu_norm(leaves[0], leaves[1], splits, K, EPS, halo=leaves[2], lags=lags, compiled=False)
    ref_grads = torch.autograd.grad(ref, leaves, dys)

    out = conv.conv_silu_norm_fwd(x, weight, hx, lags, K, EPS, splits=splits)
    grads = conv.conv_silu_norm_bwd(x, weight, hx, lags, *dys, K, EPS, splits=splits)
    for r, o in zip(ref, out):
        assert o.shape == r.shape and o.is_contiguous() and o._base is None
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    for name, r, o in zip(("dx", "dweight", "dhalo"), ref_grads, grads):
        assert o.shape == r.shape, name
        tol = 1e-6 if name == "dweight" else 1e-12  # the partial sums are an fp32 buffer
        torch.testing.assert_close(o, r, rtol=tol, atol=tol, msg=name)


def test_conv_wrappers_refuse_splits_that_do_not_fit():
    def call(C, splits):
        x = torch.randn(1, 5, C, dtype=torch.float64)
        w, h = torch.randn(C, 4, dtype=torch.float64), torch.zeros(1, 3, C, dtype=torch.float64)
        conv.conv_silu_norm_fwd(x, w, h, None, 8, EPS, splits=splits)

    with pytest.raises(ValueError, match="must sum to x's C=48"):
        call(48, (16, 16, 8))
    with pytest.raises(ValueError, match="do not split into the 3 heads"):
        call(56, (24, 24, 8))
