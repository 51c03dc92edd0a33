"""The fused layer glue (kda_cp.glue): its math equals the unfused layer in fp64, its compiled form
equals its eager form, and packed sequences do not mix in the short convolution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kda_cp.parallel import CPContext, parallelize
from kda_cp import glue
from kda_cp.layers import KDAConfig, KDALayer
from kda_cp.ops import chunk_kda

from tests._utils import perturbed


def _causal_conv(x: torch.Tensor, w: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """Depthwise causal conv of x [B, T, C] with w [C, W] (y[t] = sum_j w[:, j] x[t - (W-1) + j]),
    by F.conv1d, each packed sequence on its own."""
    T, W = x.shape[1], w.shape[1]
    if cu_seqlens is not None:
        cu = [int(c) for c in cu_seqlens]
        return torch.cat([_causal_conv(x[:, s:e], w, None) for s, e in zip(cu, cu[1:])], dim=1)
    return F.conv1d(x.transpose(1, 2), w[:, None, :], padding=W - 1, groups=w.shape[0])[..., :T].transpose(1, 2)


def unfused_forward(layer: KDALayer, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """The KDA layer written op by op from its weights with plain torch (F.linear, F.conv1d per
    packed sequence, SiLU, F.normalize, the gate, beta, RMSNorm, sigmoid), none of the layer's
    modules or kda_cp's glue: the reference for the fused glue. Both gate forms (g_min set:
    g_min * sigmoid(exp(A_log) * (z + dt_bias)); None: -exp(A_log) * softplus(z + dt_bias)), GVA
    (value head j reads key head j // (HV / H): q, k repeated here, the op sees HV heads
    throughout) and allow_neg_eigval (beta = 2 sigmoid(.))."""
    c = layer.config
    B, T, _ = x.shape
    H, HV, K, V = c.num_heads, c.v_heads, c.head_dim, c.v_dim
    qkv = F.linear(x, layer.qkv_proj.weight)
    if c.conv_size > 0:
        qkv = _causal_conv(qkv, layer.qkv_conv.weight, cu_seqlens)
    q, k, v = F.silu(qkv).split([H * K, H * K, HV * V], dim=-1)
    q = F.normalize(q.view(B, T, H, K), dim=-1, eps=c.norm_eps).repeat_interleave(HV // H, dim=2)
    k = F.normalize(k.view(B, T, H, K), dim=-1, eps=c.norm_eps).repeat_interleave(HV // H, dim=2)
    v = v.view(B, T, HV, V)
    z = F.linear(F.linear(x, layer.g_down.weight), layer.g_up.weight, layer.g_up.bias).view(B, T, HV, K)
    a = layer.A_log.exp()[:, None]
    g = c.g_min * torch.sigmoid(a * z) if c.g_min is not None else -a * F.softplus(z)
    beta = (2.0 if c.allow_neg_eigval else 1.0) * torch.sigmoid(F.linear(x, layer.b_proj.weight))
    o, _ = chunk_kda(q, k, v, g, beta, chunk_size=c.chunk_size, g_min=c.g_min, cu_seqlens=cu_seqlens,
                     allow_neg_eigval=c.allow_neg_eigval, backend="torch")
    og = F.linear(x, layer.og_proj[0].weight)
    if len(layer.og_proj) > 1:
        og = F.linear(og, layer.og_proj[1].weight, layer.og_proj[1].bias)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.norm_eps) * layer.o_norm.weight
    o = o * torch.sigmoid(og.view(B, T, HV, V))
    return F.linear(o.reshape(B, T, HV * V), layer.o_proj.weight)


def _grads(layer, x, y, dy):
    return torch.autograd.grad(y, [x, *layer.parameters()], dy)


@pytest.mark.parametrize("g_min,HV,neg_eigval", [(-5.0, 2, False), (None, 2, False), (-5.0, 4, True),
                                                 (None, 4, False), (None, 4, True)],
                         ids=["bounded", "softplus", "bounded-gva-neg", "softplus-gva", "softplus-gva-neg"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("conv_size,og_rank", [(4, None), (3, 8), (0, None)])
def test_fused_layer_equals_unfused_fp64(packed, conv_size, og_rank, g_min, HV, neg_eigval):
    seed = 11 + 3 * conv_size + packed + 7 * (g_min is None) + 13 * HV + 29 * neg_eigval
    torch.manual_seed(seed)
    cfg = KDAConfig(d_model=24, num_heads=2, num_v_heads=HV, head_dim=8, value_dim=12, conv_size=conv_size,
                    output_gate_rank=og_rank, chunk_size=16, g_min=g_min, allow_neg_eigval=neg_eigval)
    layer = perturbed(KDALayer(cfg), seed)
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, 53) if packed else (2, 37)  # T not a multiple of the chunk size
    cu = torch.tensor([0, 2, 19, 20, 41, 53]) if packed else None  # sequences of 2 and 1 tokens too
    x = torch.randn(B, T, 24, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(B, T, 24, dtype=torch.float64, generator=gen)
    y = layer(x, cu_seqlens=cu)
    y_ref = unfused_forward(layer, x, cu)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, _grads(layer, x, y, dy), _grads(layer, x, y_ref, dy)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


def test_conv_does_not_mix_packed_sequences():
    """Changing one packed sequence changes no output of the others (conv taps and recurrence)."""
    torch.manual_seed(3)
    layer = perturbed(KDALayer(KDAConfig(d_model=16, num_heads=2, head_dim=8, chunk_size=16)), 2)
    cu = torch.tensor([0, 13, 14, 30])
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    y = layer(x, cu_seqlens=cu)
    x2 = x.clone()
    x2[:, 13:14] += torch.randn(1, 1, 16, dtype=torch.float64)  # the one-token sequence
    y2 = layer(x2, cu_seqlens=cu)
    torch.testing.assert_close(y2[:, :13], y[:, :13], rtol=0, atol=0)
    torch.testing.assert_close(y2[:, 14:], y[:, 14:], rtol=0, atol=0)
    assert (y2[:, 13] - y[:, 13]).abs().max() > 1e-3


@pytest.mark.parametrize("used", [(0, 1, 2, 3), (0, 2), (1, 3)], ids=["all", "some", "not-the-first"])
def test_linear_split_equals_linear_then_split(used):
    """glue.linear_split's outputs and gradients equal F.linear(...).split(...) in fp64 (1e-12),
    also when some blocks get no gradient."""
    gen = torch.Generator().manual_seed(len(used))
    widths = (40, 8, 3, 16)
    x = torch.randn(2, 37, 24, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(sum(widths), 24, dtype=torch.float64, generator=gen, requires_grad=True)
    dys = [torch.randn(2, 37, n, dtype=torch.float64, generator=gen) for n in widths]
    res = []
    for outs in (glue.linear_split(x, w, widths), F.linear(x, w).split(widths, dim=-1)):
        loss = sum((outs[i] * dys[i]).sum() for i in used)
        res.append((outs, torch.autograd.grad(loss, (x, w))))
    for a, b in zip(res[0][0], res[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(o.dtype == torch.bfloat16 for o in glue.linear_split(x.float(), w.float(), widths))
    with pytest.raises(ValueError, match="widths"):
        glue.linear_split(x, w, (40, 8, 3))


def test_linear_split_without_grad_and_on_strided_x(monkeypatch):
    """Without a gradient asked for (no_grad, or no input requiring one) linear_split skips its
    autograd Function; the outputs still equal F.linear(...).split(...) in fp64, also for an x whose
    rows are not contiguous, and carry no graph. A feature width of 0 passes as in F.linear."""
    def no_function(*args):
        raise AssertionError("the autograd Function ran with no gradient asked for")

    monkeypatch.setattr(glue._LinearSplit, "apply", no_function)
    gen = torch.Generator().manual_seed(7)
    widths = (40, 8, 3, 16)
    w = torch.randn(sum(widths), 24, dtype=torch.float64, generator=gen)
    x = torch.randn(37, 2, 24, dtype=torch.float64, generator=gen).transpose(0, 1)  # [2, 37, 24], strided
    assert not x.is_contiguous()
    ref = F.linear(x, w).split(widths, dim=-1)
    with torch.no_grad():
        xg = x.clone().requires_grad_(True)
        outs_nograd = glue.linear_split(xg, w, widths)
    for outs in (glue.linear_split(x, w, widths), outs_nograd):
        assert [tuple(o.shape) for o in outs] == [(2, 37, n) for n in widths]
        for a, b in zip(outs, ref):
            assert a.grad_fn is None
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    empty = glue.linear_split(torch.randn(2, 3, 0, dtype=torch.float64), torch.randn(8, 0, dtype=torch.float64), (5, 3))
    assert [tuple(o.shape) for o in empty] == [(2, 3, 5), (2, 3, 3)] and all((o == 0).all() for o in empty)


@pytest.mark.parametrize("g_min,bias,beta_scale", [(-5.0, True, 1.0), (-2.5, False, 2.0), (None, True, 1.0),
                                                    (None, False, None)], ids=["bounded", "bounded-nobias-neg",
                                                                               "softplus", "softplus-nobeta"])
def test_gate_backward_by_hand_equals_autograd_fp64(g_min, bias, beta_scale):
    """kda_gate's hand-written backward (the math of the TileLang kernel) equals autograd of its
    forward formula in fp64 (1e-12): dz, dA_log, ddt_bias and beta's pre-activation gradient,
    for both gate forms, on pre-activations spread wide enough to saturate some sigmoids."""
    gen = torch.Generator().manual_seed(int(-10 * (g_min or 0)) + 3 * bias + int(4 * (beta_scale or 0)))
    B, T, H, K = 2, 37, 3, 8
    z = (4 * torch.randn(B, T, H, K, dtype=torch.float64, generator=gen)).requires_grad_(True)
    A = torch.randn(H, dtype=torch.float64, generator=gen).requires_grad_(True)
    dt = torch.randn(H * K, dtype=torch.float64, generator=gen).requires_grad_(True) if bias else None
    b = torch.randn(B, T, H, dtype=torch.float64, generator=gen).requires_grad_(True) if beta_scale else None
    dg = torch.randn(B, T, H, K, dtype=torch.float64, generator=gen)
    dbeta = torch.randn(B, T, H, dtype=torch.float64, generator=gen)
    leaves = [t for t in (z, A, dt, b) if t is not None]
    g, beta = glue.kda_gate(z, A, dt, g_min, b, beta_scale=beta_scale or 1.0, compiled=False)
    g_ref, beta_ref = glue._kda_gate(z, A, dt, g_min, b, beta_scale or 1.0)
    assert g.grad_fn is not None and "KDAGate" in type(g.grad_fn).__name__  # the hand-written backward runs
    torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
    outs, cots = ([g, beta], [dg, dbeta]) if b is not None else ([g], [dg])
    refs = [g_ref, beta_ref] if b is not None else [g_ref]
    for name, a, r in zip(["z", "A_log", "dt_bias", "b"], torch.autograd.grad(outs, leaves, cots),
                          torch.autograd.grad(refs, leaves, cots)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=lambda m: f"grad of {name}: {m}")
    # only beta used: its gradient alone (no gate backward runs)
    if b is not None:
        g2, beta2 = glue.kda_gate(z, A, dt, g_min, b, beta_scale=beta_scale, compiled=False)
        (db,) = torch.autograd.grad(beta2, [b], dbeta)
        beta_ref2 = glue._kda_gate(z, A, dt, g_min, b, beta_scale)[1]
        torch.testing.assert_close(db, torch.autograd.grad(beta_ref2, [b], dbeta)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("V,H,out_dtype", [(8, 3, None), (5, 1, torch.float32)])
def test_rms_norm_gated_backward_by_hand_equals_autograd_fp64(V, H, out_dtype):
    """rms_norm_gated's hand-written backward (the TileLang kernel's math) equals autograd of its
    forward formula in fp64 (1e-12), dx, dweight and dgate; a gate given as [B, T, H * V]."""
    gen = torch.Generator().manual_seed(V * H)
    B, T = 2, 29
    x = (3 * torch.randn(B, T, H, V, dtype=torch.float64, generator=gen)).requires_grad_(True)
    w = torch.randn(V, dtype=torch.float64, generator=gen).requires_grad_(True)
    gate = (3 * torch.randn(B, T, H * V, dtype=torch.float64, generator=gen)).requires_grad_(True)
    dy = torch.randn(B, T, H * V, dtype=torch.float64, generator=gen)
    y = glue.rms_norm_gated(x, w, gate, 1e-6, out_dtype, compiled=False)
    y_ref = glue._rms_norm_gated(x, w, gate, 1e-6, out_dtype or x.dtype)
    assert "RMSNormGated" in type(y.grad_fn).__name__
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for name, a, r in zip(["x", "weight", "gate"], torch.autograd.grad(y, [x, w, gate], dy),
                          torch.autograd.grad(y_ref, [x, w, gate], dy)):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=lambda m: f"grad of {name}: {m}")


def test_glue_bad_input():
    layer = KDALayer(KDAConfig(d_model=16, num_heads=2, head_dim=8, chunk_size=16))
    with pytest.raises(NotImplementedError, match="ulysses"):
        parallelize(layer, CPContext(strategy="ulysses"))(torch.randn(1, 8, 16), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="CPContext.strategy"):
        CPContext(strategy="ring")
    with pytest.raises(ValueError, match="CPContext.ulysses_impl"):
        CPContext(strategy="ulysses", ulysses_impl="mpi")
    with pytest.raises(TypeError, match="CPContext"):
        parallelize(layer, "scan")


@pytest.mark.slow
def test_compiled_glue_matches_eager():
    """Each glue function compiled by torch.compile (Inductor, here its CPU backend) equals its
    eager form, forward and backward, on random fp32 inputs with packed-sequence lags and a halo."""
    torch.manual_seed(0)
    B, T, H, K, V, W = 1, 45, 2, 8, 8, 4
    C = H * (2 * K + V)
    x = torch.randn(B, T, C, requires_grad=True)
    w = torch.randn(C, W, requires_grad=True)
    halo = torch.randn(B, W - 1, C, requires_grad=True)
    lags = glue.lags_in_sequence(torch.tensor([0, 7, 8, 45]), 5, T, W - 1, "cpu")
    z = torch.randn(B, T, H, K, requires_grad=True)
    A = torch.randn(H, requires_grad=True)
    dt = torch.randn(H * K, requires_grad=True)
    b = torch.randn(B, T, H, requires_grad=True)
    o = torch.randn(B, T, H, V, requires_grad=True)
    nw = torch.randn(V, requires_grad=True)
    og = torch.randn(B, T, H * V, requires_grad=True)
    cases = [
        (lambda cm: glue.conv_silu_norm(x, w, (H * K, H * K, H * V), K, 1e-6, halo=halo, lags=lags, compiled=cm),
         [x, w, halo]),
        (lambda cm: glue.kda_gate(z, A, dt, -5.0, b, compiled=cm), [z, A, dt, b]),
        (lambda cm: (glue.kda_gate(z, A, dt, None, None, compiled=cm)[0],), [z, A, dt]),
        (lambda cm: (glue.rms_norm_gated(o, nw, og, 1e-6, compiled=cm),), [o, nw, og]),
    ]
    for fn, leaves in cases:
        outs = {}
        for cm in (False, True):
            res = [r for r in fn(cm) if r is not None]
            cot = [torch.randn(r.shape, generator=torch.Generator().manual_seed(i)) for i, r in enumerate(res)]
            outs[cm] = (res, torch.autograd.grad(res, leaves, cot))
        for a, b_ in zip(outs[False][0] + list(outs[False][1]), outs[True][0] + list(outs[True][1])):
            torch.testing.assert_close(b_, a, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_glue_takes_many_lengths():
    """One process calling the compiled glue at many sequence lengths: no recompile-limit error,
    and each result equals the eager one."""
    torch.manual_seed(1)
    H, K, W = 2, 8, 4
    C = 3 * H * K
    w = torch.randn(C, W)
    for T in range(3, 15):
        x = torch.randn(1, T, C)
        got = glue.conv_silu_norm(x, w, (H * K, H * K, H * K), K, 1e-6, compiled=True)
        want = glue.conv_silu_norm(x, w, (H * K, H * K, H * K), K, 1e-6, compiled=False)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _scaled(x):
    return x * 3 + 1


def test_compiled_glue_runs_eagerly_past_the_recompile_limit(monkeypatch):
    """A process with more glue layouts than the recompile limit keeps running (eagerly, with one
    warning) instead of failing in torch.compile's fullgraph mode, and its compiled graphs stay."""
    monkeypatch.setattr(glue, "_RECOMPILE_LIMIT", 2)
    fn = glue._compiled(_scaled)
    x = torch.randn(5, generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(RuntimeWarning, match="run eagerly") as record:
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32):  # a graph per dtype
            xd = x.to(dtype)
            torch.testing.assert_close(fn(xd), xd * 3 + 1)
    assert len([w for w in record if "run eagerly" in str(w.message)]) == 1
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # the user's choice stands
            fn(x.to(torch.float16))


def test_gate_and_norm_are_first_order_only():
    """A second-order backward through the hand-written backwards is a clear error, not a wrong 0."""
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(1, 7, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    A = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    g, _ = glue.kda_gate(z, A, None, -5.0)
    with pytest.raises(NotImplementedError, match="kda_gate"):
        torch.autograd.grad(g.sum(), z, create_graph=True)
    x = torch.randn(1, 7, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(1, 7, 16, generator=gen, dtype=torch.float64)
    y = glue.rms_norm_gated(x, torch.ones(8, dtype=torch.float64), gate, 1e-6)
    with pytest.raises(NotImplementedError, match="rms_norm_gated"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.parametrize("splits,C", [((32, 32, 48), 120), ((32, 16, 32), 80), ((48, 48, 16), 112), ((8, 8, 16), 32)],
                         ids=["not-C", "q-k-differ", "v-not-multiple-of-H", "q-narrower-than-head"])
def test_conv_silu_norm_bad_splits_are_a_value_error(splits, C):
    """splits that are not (H*K, H*K, HV*V) of x's C channels with HV*V a multiple of H name themselves."""
    x = torch.randn(1, 5, C, dtype=torch.float64)
    w = torch.randn(C, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"splits must be \(H\*K, H\*K, HV\*V\)"):
        glue.conv_silu_norm(x, w, splits, 16, 1e-6, compiled=False)
