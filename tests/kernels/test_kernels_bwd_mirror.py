"""The torch mirror of the TileLang backward (tests/_bwd_mirror.py) vs torch autograd, in fp64 on CPU.

The mirror is the specification of the backward kernels: explicit per-chunk gradients, recomputed
chunk-start states, the reverse state-gradient pass and the sub-chunk factorisations. Here it must
agree with autograd of the chunked reference (kda_cp.reference.chunk_kda_torch) and of the per-token
recurrence (naive_recurrent_kda) to ~1e-10 relative. Inputs are drawn fresh per case (no seed).
"""
import pytest
import torch

from tests._bwd_mirror import chunk_kda_bwd_mirror, chunk_kda_state_grad_mirror
from kda_cp.reference import chunk_kda_torch, naive_recurrent_kda
from tests._utils import make_inputs, rel_rms

TOL = 1e-10
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(B, T, H, K, V, n_states, g_min=-5.0):
    """make_inputs (fast gates: every channel decays within a sub-chunk or two), then fp64 h0,
    do and dht for ``n_states`` sequences."""
    q, k, v, g, beta, _ = make_inputs(B, T, H, K, V, g_min=g_min, gates="fast")
    h0, dht = (torch.randn(n_states, H, K, V, dtype=torch.float64) for _ in range(2))
    do = torch.randn(B, T, H, V, dtype=torch.float64)
    return q, k, v, g, beta, h0, do, dht


def _autograd(fn, q, k, v, g, beta, h0, do, dht, scale, cu_seqlens=None):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = fn(*leaves[:5], scale=scale, initial_state=leaves[5], output_final_state=True,
               cu_seqlens=cu_seqlens)
    outs, grads = [o], [do]
    if dht is not None:
        outs.append(ht)
        grads.append(dht)
    return torch.autograd.grad(outs, leaves, grads)


def _check(ref, out, tol=TOL):
    for name, r, o in zip(NAMES, ref, out):
        assert o.shape == r.shape, f"{name}: shape {tuple(o.shape)} != {tuple(r.shape)}"
        assert torch.isfinite(o).all(), f"{name}: non-finite"
        err = rel_rms(r, o)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


CASES = [  # (B, T, H, K, V, g_min)
    (1, 37, 1, 16, 8, -5.0),  # T < chunk
    (2, 100, 2, 32, 16, -5.0),  # T % 64 != 0
    (1, 192, 1, 16, 24, -0.3),  # several whole chunks, slow gates
    (1, 130, 2, 8, 8, -5.0),
]


@pytest.mark.parametrize("B,T,H,K,V,g_min", CASES, ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}-g{c[5]}" for c in CASES])
@pytest.mark.parametrize("with_dht", [True, False])
def test_mirror_matches_autograd(B, T, H, K, V, g_min, with_dht):
    q, k, v, g, beta, h0, do, dht = _inputs(B, T, H, K, V, B, g_min)
    dht = dht if with_dht else None
    scale = K ** -0.5
    ref = _autograd(lambda *a, **kw: chunk_kda_torch(*a[:5], kw["scale"], kw["initial_state"], True,
                                                     cu_seqlens=kw["cu_seqlens"]),
                    q, k, v, g, beta, h0, do, dht, scale)
    out = chunk_kda_bwd_mirror(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht)
    _check(ref, out)


def test_mirror_matches_recurrence():
    """Against autograd of the per-token recurrence itself (the oracle), T not a multiple of 64."""
    B, T, H, K, V = 1, 83, 2, 16, 16
    q, k, v, g, beta, h0, do, dht = _inputs(B, T, H, K, V, B)
    scale = 0.37
    ref = _autograd(naive_recurrent_kda, q, k, v, g, beta, h0, do, dht, scale)
    out = chunk_kda_bwd_mirror(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht)
    _check(ref, out)


def test_mirror_packed_sequences():
    """cu_seqlens: per-sequence h0/dht, boundaries inside chunks, an empty sequence, a tail past the last."""
    lens = [5, 70, 0, 64, 33]
    tail = 7
    T = sum(lens) + tail
    H, K, V = 2, 16, 8
    n = len(lens)
    q, k, v, g, beta, h0, do, dht = _inputs(1, T, H, K, V, n)
    cu = torch.tensor([0] + lens).cumsum(0)
    scale = K ** -0.5
    out = chunk_kda_bwd_mirror(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht, cu_seqlens=cu)
    # reference: the recurrence on the packed part (autograd); the tail must get exact zeros
    P = sum(lens)
    ref = _autograd(naive_recurrent_kda, *(x[:, :P] for x in (q, k, v, g, beta)), h0, do[:, :P], dht, scale,
                    cu_seqlens=cu)
    _check(ref[:5], [o[:, :P] for o in out[:5]])
    _check(ref[5:], out[5:])
    for name, o in zip(NAMES, out[:5]):
        assert torch.equal(o[:, P:], torch.zeros_like(o[:, P:])), f"{name}: padding tail not zero"


def test_state_grad_mirror():
    """dh0 with dht = 0, from the reverse walk alone, equals autograd's dh0 of <o, do>."""
    B, T, H, K, V = 2, 150, 2, 16, 16
    q, k, v, g, beta, h0, do, _ = _inputs(B, T, H, K, V, B)
    scale = K ** -0.5
    ref = _autograd(naive_recurrent_kda, q, k, v, g, beta, h0, do, None, scale)[5]
    out = chunk_kda_state_grad_mirror(q, k, v, g, beta, scale=scale, do=do)
    assert rel_rms(ref, out) <= TOL, f"dh0: relative error {rel_rms(ref, out):.3e}"


def test_dk_operand_split_keeps_dg_accurate():
    """The "dk" kernel's operands: dAqk, dB in bf16 and each decayed factor as two bf16 pieces.

    dg is a reverse cumsum in which the row- and column-side terms of each pair cancel, so the
    factors' rounding does not average out: one bf16 piece leaves dg ~6e-2 from fp64 (as measured
    the same way on an H200 before the split), two pieces (16 significant bits) stay at the level
    that rounding dM alone gives. fp64 mirror with bf16-rounded inputs, g down to -5, T % 64 != 0.
    """
    B, T, H, K, V = 1, 300, 2, 64, 32
    q, k, v, g, beta, _, do, _ = _inputs(B, T, H, K, V, B)
    q, k, v, do = (x.to(torch.bfloat16).double() for x in (q, k, v, do))
    kw = dict(scale=K ** -0.5, do=do)
    exact = chunk_kda_bwd_mirror(q, k, v, g, beta, **kw)
    err = {p: rel_rms(exact[3], chunk_kda_bwd_mirror(q, k, v, g, beta, dk_pieces=p, **kw)[3]) for p in (1, 2)}
    dq_two = rel_rms(exact[0], chunk_kda_bwd_mirror(q, k, v, g, beta, dk_pieces=2, **kw)[0])
    assert err[2] <= 4e-3 and dq_two <= 4e-3, (err, dq_two)  # dM's own bf16 rounding: ~1.6e-3
    assert err[1] >= 4 * err[2], err  # why the second piece is there


def _softplus_gates(B, T, H, K):
    """Kimi Linear's gate g = -exp(A_log) * softplus(f + dt_bias), A_log = log U(1, 16), with
    per-channel biases over [-6, 6]: channels that keep the state over many chunks next to channels
    with steps below -20 and chunk cumsums below -1000."""
    a = torch.empty(H, 1, dtype=torch.float64).uniform_(1, 16)
    bias = torch.stack([torch.linspace(-6.0, 6.0, K, dtype=torch.float64)[torch.randperm(K)] for _ in range(H)])
    f = torch.randn(B, T, H, K, dtype=torch.float64) + bias
    return -a * torch.nn.functional.softplus(f)


@pytest.mark.parametrize("cu_lens", [None, [5, 70, 0, 64, 33]], ids=["dense", "packed"])
def test_mirror_general_gates(cu_lens):
    """general=True (the general-gate kernels' factorisation: anchored sums with factors <= 1,
    pairwise own sub-chunk blocks, steps floored at fp32's decay_floor) equals autograd of the
    recurrence for unbounded gates, T % 64 != 0, with initial and final states; in fp32 the bounded
    factorisation overflows on the same inputs and the general one stays finite."""
    lens = cu_lens or [150]
    T, H, K, V = sum(lens), 2, 32, 16
    q, k, v, _, beta, h0, do, dht = _inputs(1, T, H, K, V, len(lens))
    g = _softplus_gates(1, T, H, K)
    assert g.min() < -20 and g[0, :64].sum(0).min() < -1000
    cu = None if cu_lens is None else torch.tensor([0] + lens).cumsum(0)
    scale = K ** -0.5
    ref = _autograd(naive_recurrent_kda, q, k, v, g, beta, h0, do, dht, scale, cu_seqlens=cu)
    out = chunk_kda_bwd_mirror(q, k, v, g, beta, scale=scale, initial_state=h0, do=do, dht=dht,
                               cu_seqlens=cu, general=True)
    _check(ref, out)
    if cu is None:  # the CP state gradient (dense inputs only)
        state_ref = _autograd(naive_recurrent_kda, q, k, v, g, beta, h0, do, None, scale)[5]
        state = chunk_kda_state_grad_mirror(q, k, v, g, beta, scale=scale, do=do, general=True)
        assert rel_rms(state_ref, state) <= TOL
    f32 = [x.float() for x in (q, k, v, g, beta)]  # the kernels' exponent range
    bounded = chunk_kda_bwd_mirror(*f32, scale=scale, do=do.float(), cu_seqlens=cu)
    assert not all(torch.isfinite(x).all() for x in bounded)
    general = chunk_kda_bwd_mirror(*f32, scale=scale, do=do.float(), cu_seqlens=cu, general=True)
    assert all(torch.isfinite(x).all() for x in general)


def test_mirror_general_gates_dk_pieces():
    """The general path with the "dk" kernel's operands (dM in bf16, tables in two bf16 pieces, the
    pairwise blocks exact) keeps dq, dk, dg at the level of dM's own rounding, as the bounded path."""
    B, T, H, K, V = 1, 300, 2, 64, 32
    q, k, v, _, beta, _, do, _ = _inputs(B, T, H, K, V, B)
    g = _softplus_gates(B, T, H, K)
    q, k, v, do = (x.to(torch.bfloat16).double() for x in (q, k, v, do))
    kw = dict(scale=K ** -0.5, do=do, general=True)
    exact = chunk_kda_bwd_mirror(q, k, v, g, beta, **kw)
    two = chunk_kda_bwd_mirror(q, k, v, g, beta, dk_pieces=2, **kw)
    errs = {n: rel_rms(exact[i], two[i]) for i, n in ((0, "dq"), (1, "dk"), (3, "dg"))}
    assert all(torch.isfinite(x).all() for x in two)
    assert max(errs.values()) <= 4e-3, errs
