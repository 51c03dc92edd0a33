"""chunk_kda's and cp_chunk_kda's input options (flash-linear-attention's names):
use_qk_l2norm_in_kernel, use_gate_in_kernel with A_log and dt_bias, use_beta_sigmoid_in_kernel
(2 * sigmoid with allow_neg_eigval, as flash-linear-attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kda_cp import chunk_kda, naive_recurrent_kda
from kda_cp.parallel import cp_chunk_kda

from tests._dist import run_ranks

OPTS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _raw(T, H, K, V, seed, B=1, HV=None):
    """Pre-activations drawn fresh: q, k unnormalized (H heads), v, z (gate), b (beta) with HV heads
    (GVA: a multiple of H, default H), A_log [HV], dt_bias [HV * K] (fp64)."""
    HV = H if HV is None else HV
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = 3 * r(B, T, H, K), 2 * r(B, T, H, K), r(B, T, HV, V)
    z = r(B, T, HV, K) + torch.linspace(-6, 3, K, dtype=torch.float64)  # slow and fast channels
    b = 2 * r(B, T, HV)
    A_log = 0.5 * r(HV)
    dt_bias = 0.3 * r(HV * K)
    return [x.requires_grad_(True) for x in (q, k, v, z, b, A_log, dt_bias)]


def _explicit(q, k, z, b, A_log, dt_bias, g_min, beta_scale=1.0):
    """The options' math written out independently of kda_cp.glue (the gate's parameters per value head)."""
    HV, K = z.shape[2:]
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    u = z + dt_bias.view(HV, K)
    a = A_log.exp()[:, None]
    g = -a * F.softplus(u) if g_min is None else g_min * torch.sigmoid(a * u)
    return q, k, g, beta_scale * torch.sigmoid(b)


@pytest.mark.parametrize("groups", [1, 2, 4], ids=["mha", "gva2", "gva4"])  # HV = groups * H value heads
@pytest.mark.parametrize("g_min,seed,neg", [(-5.0, 11, False), (-2.5, 12, False), (None, 13, False), (None, 14, True),
                                            (-5.0, 15, True)],
                         ids=["bound5", "bound2.5", "softplus", "softplus-neg-eigval", "bound5-neg-eigval"])
def test_options_equal_explicit_transforms_and_recurrence(g_min, seed, neg, groups):
    T, H, K, V = 45, 2, 8, 6
    cu = torch.tensor([0, 9, 10, 45])
    q, k, v, z, b, A_log, dt_bias = leaves = _raw(T, H, K, V, seed=seed + 100 * (groups - 1), HV=groups * H)
    o, ht = chunk_kda(q, k, v, z, b, A_log=A_log, dt_bias=dt_bias, g_min=g_min, cu_seqlens=cu, chunk_size=16,
                      output_final_state=True, allow_neg_eigval=neg, **OPTS)
    qn, kn, g, beta = _explicit(q, k, z, b, A_log, dt_bias, g_min, beta_scale=2.0 if neg else 1.0)
    qn, kn = (x.repeat_interleave(groups, dim=2) for x in (qn, kn))  # value head j reads key head j // groups
    o_ref, ht_ref = naive_recurrent_kda(qn, kn, v, g, beta, output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    got = torch.autograd.grad((o, ht), leaves, (do, dht))
    want = torch.autograd.grad((o_ref, ht_ref), leaves, (do, dht))
    for name, a, w in zip(["q", "k", "v", "g", "beta", "A_log", "dt_bias"], got, want):
        assert w.abs().max() > 0, name
        torch.testing.assert_close(a, w, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


def test_each_option_alone_and_dt_bias_as_matrix():
    T, H, K, V = 20, 2, 8, 8
    q, k, v, z, b, A_log, dt_bias = _raw(T, H, K, V, seed=3, B=2)
    qn, kn, g, beta = _explicit(q, k, z, b, A_log, dt_bias, -5.0)
    ref, _ = chunk_kda(qn, kn, v, g, beta)
    cases = [
        dict(q=q, k=k, g=g, beta=beta, use_qk_l2norm_in_kernel=True),
        dict(q=qn, k=kn, g=z, beta=beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias.view(H, K), g_min=-5.0),
        dict(q=qn, k=kn, g=g, beta=b, use_beta_sigmoid_in_kernel=True),
    ]
    for kw in cases:
        o, _ = chunk_kda(v=v, **kw)
        torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="allow_neg_eigval must be a bool, got 'yes'"):
        chunk_kda(qn, kn, v, g, beta, allow_neg_eigval="yes")
    o, _ = chunk_kda(qn, kn, v, g, b, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    torch.testing.assert_close(o, chunk_kda(qn, kn, v, g, 2 * beta, allow_neg_eigval=True)[0], rtol=1e-10, atol=1e-10)
    o, _ = chunk_kda(qn, kn, v, z + dt_bias.view(H, K), beta, use_gate_in_kernel=True, A_log=A_log, g_min=-5.0)
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)


def test_bad_gate_parameters():
    T, H, K, V = 12, 2, 4, 4
    q, k, v, z, b, A_log, dt_bias = (x.detach() for x in _raw(T, H, K, V, seed=1))
    gate = dict(use_gate_in_kernel=True, g_min=-5.0)
    with pytest.raises(ValueError, match=r"A_log must be a float tensor \[HV\] = \[2\]"):
        chunk_kda(q, k, v, z, b, A_log=A_log[:1], dt_bias=dt_bias, **gate)
    with pytest.raises(ValueError, match=r"A_log must be"):
        chunk_kda(q, k, v, z, b, dt_bias=dt_bias, **gate)
    with pytest.raises(ValueError, match=r"dt_bias must be a float tensor \[HV \* K\] = \[8\]"):
        chunk_kda(q, k, v, z, b, A_log=A_log, dt_bias=dt_bias[:-1], **gate)
    with pytest.raises(ValueError, match="use_gate_in_kernel=True"):
        chunk_kda(q, k, v, z, b, A_log=A_log)
    with pytest.raises(ValueError, match=r"g \(the gate's pre-activation\) must be \[B, T, H, K\]"):
        chunk_kda(q, k, v, z[..., 0], b, A_log=A_log, **gate)
    # flash-linear-attention's default gate is the softplus one: the form must be named, not assumed
    with pytest.raises(ValueError, match="pass g_min to name the gate's form"):
        chunk_kda(q, k, v, z, b, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    with pytest.raises(ValueError, match="g is a log decay"):  # without the option, z is taken as g
        chunk_kda(q, k, v, z, b)
    # the argument checks come before the value checks, which would read a list as a tensor
    with pytest.raises(ValueError, match=r"A_log must be a float tensor \[HV\] = \[2\].*got \[0.0, 0.0\]"):
        chunk_kda(q, k, v, z, b, A_log=[0.0, 0.0], **gate)
    with pytest.raises(ValueError, match=r"dt_bias must be a float tensor"):
        chunk_kda(q, k, v, z, b, A_log=A_log, dt_bias=dt_bias.tolist(), **gate)
    with pytest.raises(ValueError, match=r"g_min .* must be a number in \[-5, 0\) or None, got 'x'"):
        chunk_kda(q, k, v, z, b, A_log=A_log, use_gate_in_kernel=True, g_min="x")
    for flag in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "output_final_state",
                 "check_gate"):
        with pytest.raises(ValueError, match=f"{flag} must be a bool"):  # "no" would be truthy
            chunk_kda(q, k, v, z, b, **{flag: "no"})
    # GVA: the gate's parameters have one row per value head (HV = 4 here, H = 2)
    v4 = torch.cat([v, v], dim=2)
    z4, b4 = torch.cat([z, z], dim=2), torch.cat([b, b], dim=2)
    with pytest.raises(ValueError, match=r"A_log must be a float tensor \[HV\] = \[4\]"):
        chunk_kda(q, k, v4, z4, b4, A_log=A_log, **gate)


@pytest.mark.parametrize("g_min", [-5.0, None], ids=["bounded", "softplus"])
def test_non_finite_preactivations_are_refused(g_min):
    """A saturated gate is finite (sigmoid(inf) = 1) but its backward is NaN: with check_gate, an
    Inf or NaN in z, A_log, dt_bias or beta's pre-activation, or an A_log whose exp overflows the
    gate's fp32, is a ValueError naming it, from chunk_kda and cp_chunk_kda alike (which run their
    checks before any exchange; one rank here). check_gate=False skips them."""
    T, H, K, V = 12, 2, 4, 4
    q, k, v, z, b, A_log, dt_bias = (x.detach().float() for x in _raw(T, H, K, V, seed=2))
    opts = dict(A_log=A_log, dt_bias=dt_bias, g_min=g_min, **OPTS)

    def poisoned(name, value):
        t = {"z": z, "A_log": A_log, "dt_bias": dt_bias, "b": b}[name].clone()
        t.view(-1)[1] = value
        return t

    cases = [("z", float("inf"), r"g \(the gate's pre-activation\)"), ("A_log", float("nan"), "A_log"),
             ("A_log", 89.0, r"exp\(A_log\)"), ("dt_bias", float("-inf"), "dt_bias"),
             ("b", float("nan"), r"beta \(the pre-activation")]
    for name, value, match in cases:
        args = {"z": z, "b": b, **opts, name: poisoned(name, value)}
        zz, bb = args.pop("z"), args.pop("b")
        with pytest.raises(ValueError, match=match):
            chunk_kda(q, k, v, zz, bb, **args)
        with pytest.raises(ValueError, match=match):
            cp_chunk_kda(q, k, v, zz, bb, cp_group=None, **args)
    zz = poisoned("z", float("inf")).requires_grad_(True)
    o, _ = chunk_kda(q, k, v, zz, b, check_gate=False, **opts)  # refused only with the checks on
    assert torch.isfinite(o).all()


#: (g_min, allow_neg_eigval) of the CP check: the bounded gate, the softplus one, each with beta in (0, 2)
CP_GATES = [(-5.0, False), (None, False), (None, True), (-5.0, True)]


def _cp_body(rank, world_size, cases, lengths, cu):
    """Every (g_min, allow_neg_eigval) case of one world size on one set of ranks (a spawn costs
    seconds, a case of this size milliseconds)."""
    import torch.distributed as dist

    start = sum(lengths[:rank])
    sl = slice(start, start + lengths[rank])
    out = []
    for (g_min, neg), leaves, do in cases:
        q, k, v, z, b = (x[:, sl].clone().requires_grad_(True) for x in leaves[:5])
        A_log, dt_bias = (x.clone().requires_grad_(True) for x in leaves[5:])
        o, ht = cp_chunk_kda(q, k, v, z, b, cp_group=dist.group.WORLD, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
                             chunk_size=16, output_final_state=True, g_min=g_min, allow_neg_eigval=neg, **OPTS)
        grads = torch.autograd.grad((o, ht), [q, k, v, z, b, A_log, dt_bias],
                                    (do[:, sl], torch.ones_like(ht) / world_size))  # summed over ranks
        out.append({"o": o.detach(), "ht": ht.detach(), "grads": grads})
    return out


@pytest.mark.parametrize("lengths", [[30, 23], [17, 20, 16], [9, 15, 14, 15]], ids=["p2", "p3", "p4"])
def test_cp_options_equal_unsharded(lengths):
    """cp_chunk_kda with the options equals chunk_kda on the whole sequence, for each gate of
    CP_GATES (bounded and softplus, with and without negative eigenvalues)."""
    T, H, K, V = sum(lengths), 2, 8, 4
    cu = [0, 5, 26, 27, T]  # sequences crossing rank boundaries
    cases, wants = [], []
    for i, (g_min, neg) in enumerate(CP_GATES):
        leaves = _raw(T, H, K, V, seed=len(lengths) + 10 * i)
        o, ht = chunk_kda(*leaves[:5], A_log=leaves[5], dt_bias=leaves[6], cu_seqlens=cu, chunk_size=16,
                          output_final_state=True, g_min=g_min, allow_neg_eigval=neg, **OPTS)
        do = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(7 + i))
        grads = torch.autograd.grad((o, ht), leaves, (do, torch.ones_like(ht)))
        cases.append(((g_min, neg), [x.detach() for x in leaves], do))
        wants.append((o.detach(), ht.detach(), grads))
    res = run_ranks(_cp_body, len(lengths), cases, lengths, cu)
    for c, ((g_min, neg), _, _) in enumerate(cases):
        tag = f"g_min={g_min}, allow_neg_eigval={neg}"
        o, ht, want = wants[c]
        rc = [r[c] for r in res]
        torch.testing.assert_close(torch.cat([r["o"] for r in rc], 1), o, rtol=1e-10, atol=1e-10,
                                   msg=lambda m: f"o ({tag}): {m}")
        for r in rc:
            torch.testing.assert_close(r["ht"], ht, rtol=1e-10, atol=1e-10, msg=lambda m: f"ht ({tag}): {m}")
        for i, name in enumerate(["q", "k", "v", "g", "beta"]):
            got = torch.cat([r["grads"][i] for r in rc], 1)
            torch.testing.assert_close(got, want[i], rtol=1e-9, atol=1e-10,
                                       msg=lambda m: f"grad of {name} ({tag}): {m}")
        for i, name in ((5, "A_log"), (6, "dt_bias")):  # replicated parameters: the ranks' shares sum up
            got = sum(r["grads"][i] for r in rc)
            torch.testing.assert_close(got, want[i], rtol=1e-9, atol=1e-10,
                                       msg=lambda m: f"grad of {name} ({tag}): {m}")


def _disagree_rank(rank, world_size, case):
    import torch.distributed as dist

    q, k, v, z, b, A_log, dt_bias = (x.detach() for x in _raw(16, 2, 4, 4, seed=9))
    kw = dict(OPTS, g_min=-5.0, A_log=A_log, dt_bias=dt_bias)
    if case == "flag" and rank == 1:
        kw["use_qk_l2norm_in_kernel"] = False
    if case == "A_log" and rank == 1:
        kw["A_log"] = A_log + 1e-3
    try:
        cp_chunk_kda(q, k, v, z, b, cp_group=dist.group.WORLD, **kw)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case,name", [("flag", "use_qk_l2norm_in_kernel"), ("A_log", "A_log")])
def test_cp_ranks_disagreeing_on_options_raise_on_every_rank(case, name):
    for msg in run_ranks(_disagree_rank, 2, case, timeout=90):
        assert "ranks disagree on the options" in msg and name in msg, msg
