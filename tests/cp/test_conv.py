"""Causal short conv: plain form vs nn.functional, packed sequences, and the CP halo over gloo."""

from __future__ import annotations

import re

import pytest
import torch

from kda_cp.parallel.layers.conv import causal_conv1d

from tests._dist import run_ranks


def _reference(x, weight, bias=None):
    """Unsharded causal depthwise conv written independently: y[t] = sum_j w[:, j] x[t-(W-1)+j]."""
    B, T, D = x.shape
    W = weight.shape[1]
    y = torch.zeros_like(x) if bias is None else bias.expand(B, T, D).clone()
    for t in range(T):
        for j in range(W):
            s = t - (W - 1) + j
            if s >= 0:
                y[:, t] = y[:, t] + weight[:, j] * x[:, s]
    return y


@pytest.mark.parametrize("W", [1, 2, 4])
def test_plain_matches_reference(W):
    x = torch.randn(2, 11, 5, dtype=torch.float64)
    w = torch.randn(5, W, dtype=torch.float64)
    b = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(causal_conv1d(x, w, b), _reference(x, w, b), rtol=1e-12, atol=1e-12)


def test_causal():
    x = torch.randn(1, 20, 3, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)
    y = causal_conv1d(x, w)
    x2 = x.clone()
    x2[:, 12:] = torch.randn(1, 8, 3, dtype=torch.float64)
    torch.testing.assert_close(causal_conv1d(x2, w)[:, :12], y[:, :12], rtol=0, atol=0)
    assert not torch.allclose(causal_conv1d(x2, w)[:, 12:], y[:, 12:])


def test_varlen_no_leak_across_sequences():
    cu = torch.tensor([0, 3, 10, 17])
    x = torch.randn(1, 17, 4, dtype=torch.float64)
    w = torch.randn(4, 4, dtype=torch.float64)
    b = torch.randn(4, dtype=torch.float64)
    y = causal_conv1d(x, w, b, cu_seqlens=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(y[:, s:e], _reference(x[:, s:e], w, b), rtol=1e-12, atol=1e-12)


def test_bad_input():
    x = torch.randn(2, 8, 5)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(4, 4))
    with pytest.raises(ValueError, match="x must be"):
        causal_conv1d(torch.randn(8, 5), torch.randn(5, 4))
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d(x, torch.randn(5, 4), torch.randn(3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x[:1], torch.randn(5, 4), cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match=r"cu_seqlens needs B == 1 \(sequences packed along T\), got B = 2"):
        causal_conv1d(x, torch.randn(5, 4), cu_seqlens=torch.tensor([0, 3, 8]))


def _cp_body(rank, world_size, x, w, b, lengths, dy, cu_seqlens):
    import torch.distributed as dist

    from kda_cp.parallel.layers.conv import causal_conv1d

    group = dist.group.WORLD
    start = sum(lengths[:rank])
    sl = slice(start, start + lengths[rank])
    x_r = x[:, sl].clone().requires_grad_(True)
    w_r = w.clone().requires_grad_(True)
    b_r = b.clone().requires_grad_(True)
    y_r = causal_conv1d(x_r, w_r, b_r, cp_group=group, cu_seqlens=cu_seqlens)
    (y_r * dy[:, sl]).sum().backward()
    return {"y": y_r.detach(), "dx": x_r.grad, "dw": w_r.grad, "db": b_r.grad}


# Named scenarios: even shards, uneven shards, shards shorter than the halo (W - 1 = 3), an empty one.
CASES = {
    "p2-even": (4, [16, 16]),
    "p2-uneven": (4, [13, 6]),
    "p3-uneven": (4, [7, 12, 5]),
    "p3-short-shards": (4, [2, 1, 9]),
    "p3-empty-middle": (4, [5, 0, 6]),
    "p2-width2": (2, [9, 4]),
}


# Packed sequences (global cu_seqlens, B = 1): starts inside the halo, on a shard boundary, in a
# shard shorter than the halo.
VARLEN_CASES = {
    "p3-starts-in-halo": (4, [7, 12, 5], [0, 5, 8, 9, 16, 24]),
    "p3-start-on-boundary": (4, [7, 12, 5], [0, 7, 19, 24]),
    "p3-short-shard": (4, [9, 2, 8], [0, 10, 11, 19]),
}


def _reference_varlen(x, w, b, cu):
    return torch.cat([_reference(x[:, s:e], w, b) for s, e in zip(cu[:-1], cu[1:])], dim=1)


@pytest.mark.parametrize("name", list(CASES) + list(VARLEN_CASES))
def test_cp_matches_unsharded(name):
    if name in CASES:
        (W, lengths), cu = CASES[name], None
    else:
        W, lengths, cu = VARLEN_CASES[name]
    P = len(lengths)
    T = sum(lengths)
    B, D = (2, 6) if cu is None else (1, 6)
    x = torch.randn(B, T, D, dtype=torch.float64)
    w = torch.randn(D, W, dtype=torch.float64)
    b = torch.randn(D, dtype=torch.float64)
    dy = torch.randn(B, T, D, dtype=torch.float64)

    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
    y_ref = _reference(xr, wr, br) if cu is None else _reference_varlen(xr, wr, br, cu)
    (y_ref * dy).sum().backward()
    if cu is not None:  # the packing matters: the plain conv differs somewhere
        assert not torch.allclose(y_ref, _reference(x, w, b))

    cu_t = None if cu is None else torch.tensor(cu)
    res = run_ranks(_cp_body, P, x, w, b, lengths, dy, cu_t, timeout=60)
    y = torch.cat([r["y"] for r in res], dim=1)
    dx = torch.cat([r["dx"] for r in res], dim=1)
    torch.testing.assert_close(y, y_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-12, atol=1e-12)
    # Parameter grads: each rank holds its shard's part; the sum over ranks is the full gradient.
    torch.testing.assert_close(sum(r["dw"] for r in res), wr.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum(r["db"] for r in res), br.grad, rtol=1e-12, atol=1e-12)


def _bad_cp_body(rank, world_size, case):
    import torch.distributed as dist

    x, w = torch.randn(1, 10, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    cu = torch.tensor([0, 7, 20])
    if case == "cu_seqlens-on-rank-1" and rank == 1:
        cu = torch.tensor([0, 9, 20])
    if case == "width-on-rank-1" and rank == 1:
        w = torch.randn(5, 3, dtype=torch.float64)
    if case == "bad-bias-on-rank-1" and rank == 1:
        cu = None
    try:
        causal_conv1d(x, w, torch.randn(3) if case == "bad-bias-on-rank-1" and rank == 1 else None,
                      cp_group=dist.group.WORLD, cu_seqlens=cu)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case,expect", [
    ("cu_seqlens-on-rank-1", ["ranks disagree", "ranks disagree"]),
    ("width-on-rank-1", ["ranks disagree", "ranks disagree"]),
    ("bad-bias-on-rank-1", [r"rank\(s\) \[1\]", "bias"]),
])
def test_bad_input_under_cp_raises_on_every_rank(case, expect):
    """Checked before the halo exchange: one rank's bad input must not leave the other blocked."""
    for rank, (msg, pattern) in enumerate(zip(run_ranks(_bad_cp_body, 2, case, timeout=60), expect)):
        assert re.search(pattern, msg), f"rank {rank}: {msg!r}"
