"""Shared test helpers: random KDA inputs drawn fresh per case, and one closeness check."""

from __future__ import annotations

import torch


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    ref, out = ref.double(), out.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
    """Fail unless ``out`` is finite, has ``ref``'s shape, and rel. RMS error <= ratio."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    assert ref.abs().max() > 0, f"{name}: the reference is all zeros: the case tests nothing"
    err = rel_rms(ref, out)
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e}"


def make_inputs(B, T, H, K, V, *, dtype=torch.float64, g_min=-5.0, seed=None, requires_grad=False,
                with_h0=False, device="cpu"):
    """q, k (L2-normalized), v, g = g_min * sigmoid(randn) per channel, beta ~ U(0, 1), optional h0."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, K)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, H, V)
    g = g_min * torch.sigmoid(rnd(B, T, H, K))
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = rnd(B, H, K, V) if with_h0 else None
    out = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    out += [x.to(device=device, dtype=dtype if dtype == torch.float64 else torch.float32) for x in (g, beta)]
    if h0 is not None:
        h0 = h0.to(device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    if requires_grad:
        out = [x.requires_grad_(True) for x in out]
        if h0 is not None:
            h0.requires_grad_(True)
    return (*out, h0)
