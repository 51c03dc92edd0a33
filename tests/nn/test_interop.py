"""Weight interop (kda_cp.interop): a layer's weights in flash-linear-attention's and Kimi Linear's
layouts give kda_cp's KDALayer the same function, for both gate forms and with GVA (num_v_heads =
2 H), in fp64 on CPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kda_cp.glue import l2_norm
from kda_cp.interop import export_kda_state_dict, import_kda_state_dict
from kda_cp.layers import KDAConfig, KDALayer
from kda_cp.reference import naive_recurrent_kda

from tests._utils import assert_close

D, H, K = 48, 2, 16


def _config(g_min, HV=H, neg_eigval=False):
    return KDAConfig(d_model=D, num_heads=H, num_v_heads=HV, head_dim=K, output_gate_rank=K, g_min=g_min,
                     chunk_size=16, backend="torch", allow_neg_eigval=neg_eigval)


def _fla_weights(seed, HV=H):
    """Random weights in the peer's layout with HV value heads (every tensor drawn, A_log spread
    as log U(1, 16))."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)

    n = {"q": H * K, "k": H * K, "v": HV * K}
    sd = {f"{p}_proj.weight": rnd(n[p], D) for p in "qkv"}
    sd.update({f"{p}_conv1d.weight": rnd(n[p], 1, 4, scale=0.5) for p in "qkv"})
    sd.update({"f_proj.0.weight": rnd(K, D), "f_proj.1.weight": rnd(HV * K, K), "dt_bias": rnd(HV * K, scale=1.0),
               "A_log": torch.log(1 + 15 * torch.rand(HV, generator=gen, dtype=torch.float64)),
               "b_proj.weight": rnd(HV, D), "g_proj.0.weight": rnd(K, D), "g_proj.1.weight": rnd(HV * K, K),
               "g_proj.1.bias": rnd(HV * K), "o_norm.weight": 1 + rnd(K), "o_proj.weight": rnd(D, HV * K)})
    return sd


def _l2_kda_cp(t, eps):
    """kda_cp's L2 norm, t / max(||t||_2, eps): the equality checks use it so that they test the rest
    of the math at fp64 rounding (fla's own t * rsqrt(sum t^2 + eps) is :func:`_l2_fla`)."""
    return t / torch.linalg.vector_norm(t, dim=-1, keepdim=True).clamp_min(eps)


def _l2_fla(t, eps):
    """flash-linear-attention's l2norm: t * rsqrt(sum t^2 + eps)."""
    return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + eps)


def _fla_layer_reference(sd, x, g_min, eps=1e-6, neg_eigval=False, cu_seqlens=None):
    """The peer's layer computed from its own weights: per-part short conv + SiLU, q/k L2-normalized
    (kda_cp's x / max(||x||, eps), see _l2_kda_cp), the safe gate (g_min set) or the softplus gate,
    sigmoid beta, the recurrence (value head j reading key head j // (HV / H)), RMSNorm times
    sigmoid of the output gate, the output projection; beta = 2 sigmoid(.) with neg_eigval (its
    allow_neg_eigval). With cu_seqlens (B = 1) each packed sequence runs on its own slice of x."""
    if cu_seqlens is not None:
        cu = [int(c) for c in cu_seqlens]
        return torch.cat([_fla_layer_reference(sd, x[:, s:e], g_min, eps, neg_eigval) for s, e in zip(cu, cu[1:])],
                         dim=1)
    B, T, _ = x.shape
    HV = sd["A_log"].numel()

    def conv(p):
        w = sd[f"{p}_conv1d.weight"]
        y = F.conv1d(F.linear(x, sd[f"{p}_proj.weight"]).transpose(1, 2), w, padding=3, groups=w.shape[0])[..., :T]
        return F.silu(y.transpose(1, 2)).reshape(B, T, -1, K)

    q, k, v = conv("q"), conv("k"), conv("v")
    q, k = (_l2_kda_cp(t, eps) for t in (q, k))
    q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
    f = F.linear(F.linear(x, sd["f_proj.0.weight"]), sd["f_proj.1.weight"]).reshape(B, T, HV, K)
    f = f + sd["dt_bias"].reshape(HV, K)
    a = sd["A_log"].exp()[:, None]
    g = g_min * torch.sigmoid(a * f) if g_min is not None else -a * F.softplus(f)
    beta = (2 if neg_eigval else 1) * torch.sigmoid(F.linear(x, sd["b_proj.weight"]))
    o, _ = naive_recurrent_kda(q, k, v, g, beta)
    og = F.linear(F.linear(x, sd["g_proj.0.weight"]), sd["g_proj.1.weight"], sd["g_proj.1.bias"]).reshape(B, T, HV, K)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * sd["o_norm.weight"] * torch.sigmoid(og)
    return F.linear(o.reshape(B, T, HV * K), sd["o_proj.weight"])


def _kimi_from_fla(sd):
    """The same layer in the Kimi Linear layout (its output gate has no bias: the fla one is zeroed)."""
    names = {"f_proj.0.weight": "f_a_proj.weight", "f_proj.1.weight": "f_b_proj.weight",
             "g_proj.0.weight": "g_a_proj.weight", "g_proj.1.weight": "g_b_proj.weight"}
    out = {names.get(k, k): v for k, v in sd.items() if k != "g_proj.1.bias"}
    out["A_log"] = sd["A_log"].reshape(1, 1, -1, 1)
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("HV,neg_eigval", [(H, False), (2 * H, False), (2 * H, True)],
                         ids=["mha", "gva", "gva-neg-eigval"])
@pytest.mark.parametrize("g_min", [-5.0, None], ids=["bounded-gate", "softplus-gate"])
@pytest.mark.parametrize("layout", ["fla", "kimi"])
def test_imported_layer_equals_the_peer_layout(layout, g_min, HV, neg_eigval, packed):
    """The imported layer equals the peer's layer (with kda_cp's L2 norm) in fp64 to 1e-10: y, dx
    and every parameter's gradient, the reference's gradients mapped to kda_cp's names by the
    converter; packed: B = 1 with sequences of 37, 1, 103 and 161 tokens, each run on its own by
    the reference."""
    seed = 3 + (g_min is None) + 2 * HV + 5 * neg_eigval + 11 * packed + 23 * (layout == "kimi")
    sd = _fla_weights(seed=seed, HV=HV)
    if layout == "kimi":
        sd["g_proj.1.bias"].zero_()
    for t in sd.values():
        t.requires_grad_(True)
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 37, 38, 141, 302]) if packed else None  # lengths not multiples of 16 (or 64)
    B, T = (1, 302) if packed else (2, 77)  # T not a multiple of the chunk size
    x = torch.randn(B, T, D, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(B, T, D, dtype=torch.float64, generator=gen)
    want = _fla_layer_reference(sd, x, g_min, neg_eigval=neg_eigval, cu_seqlens=cu)
    cfg = _config(g_min, HV, neg_eigval)
    layer = KDALayer(cfg).double()
    theirs = {k: v.detach() for k, v in sd.items()}
    layer.load_state_dict(import_kda_state_dict(theirs if layout == "fla" else _kimi_from_fla(theirs), cfg, layout))
    got = layer(x, cu_seqlens=cu)
    assert_close("y", want, got, 1e-10)
    names = list(sd)
    ref = torch.autograd.grad(want, [x, *sd.values()], dy)
    ours = dict(layer.named_parameters())
    out = torch.autograd.grad(got, [x, *ours.values()], dy)
    assert_close("dx", ref[0], out[0], 1e-10)
    ref_grads = import_kda_state_dict(dict(zip(names, ref[1:])), cfg, "fla")  # the converter's key mapping
    assert ref_grads.keys() == ours.keys()
    for name, d in zip(ours, out[1:]):
        assert_close(f"d {name}", ref_grads[name], d, 1e-10)


@pytest.mark.parametrize("norm", [1e1, 1.0, 1e-1, 1e-2])
def test_fla_l2norm_differs_by_eps_over_twice_the_squared_norm(norm):
    """flash-linear-attention's l2norm x * rsqrt(sum x^2 + eps) and kda_cp's x / max(||x||, eps)
    (eps = 1e-6 in both) differ by the factor 1 - 1 / sqrt(1 + eps / ||x||^2) ~ eps / (2 ||x||^2):
    5e-7 at ||x|| = 1, about bf16's resolution at ||x|| = 1e-2, and O(1) at ||x|| <~ 1e-3
    (docs/design.md §9)."""
    eps = 1e-6
    gen = torch.Generator().manual_seed(int(-math.log10(norm)) + 5)
    x = torch.randn(64, K, dtype=torch.float64, generator=gen)
    x = x / x.norm(dim=-1, keepdim=True) * norm * (1 + 0.1 * torch.rand(64, 1, dtype=torch.float64, generator=gen))
    ours, fla = l2_norm(x, eps), _l2_fla(x, eps)  # kda_cp's own L2 norm
    rel = ((ours - fla).norm(dim=-1) / ours.norm(dim=-1))
    r2 = x.pow(2).sum(-1)
    torch.testing.assert_close(rel, 1 - (1 + eps / r2).rsqrt(), rtol=1e-6, atol=1e-14)  # the exact factor, to fp64 rounding
    tiny = 1e-4 * x / norm  # rows of norm ~1e-4: kda_cp still gives unit rows, fla's shrink by ~10x
    assert (l2_norm(tiny, eps).norm(dim=-1) - 1).abs().max() < 1e-12
    assert _l2_fla(tiny, eps).norm(dim=-1).max() < 0.2


@pytest.mark.parametrize("layout", ["fla", "kimi"])
def test_export_then_import_is_the_identity(layout):
    torch.manual_seed(0)
    cfg = _config(-5.0)
    layer = KDALayer(cfg).double()
    if layout == "kimi":
        with torch.no_grad():
            layer.og_proj[1].bias.zero_()
    theirs = export_kda_state_dict(layer.state_dict(), cfg, layout)
    back = import_kda_state_dict(theirs, cfg, layout)
    assert back.keys() == layer.state_dict().keys()
    for name, t in layer.state_dict().items():
        assert torch.equal(back[name], t), name


def test_bad_state_dicts_raise():
    cfg = _config(-5.0)
    sd = _fla_weights(seed=1)
    with pytest.raises(ValueError, match="layout must be one of"):
        import_kda_state_dict(sd, cfg, "hf")
    with pytest.raises(ValueError, match="missing 'dt_bias'"):
        import_kda_state_dict({k: v for k, v in sd.items() if k != "dt_bias"}, cfg)
    with pytest.raises(ValueError, match=r"'A_log' has shape \(3,\), expected \(2,\)"):
        import_kda_state_dict({**sd, "A_log": torch.zeros(3)}, cfg)
    with pytest.raises(ValueError, match="q_conv1d.bias"):
        import_kda_state_dict({**sd, "q_conv1d.bias": torch.zeros(H * K)}, cfg)
    with pytest.raises(ValueError, match="keys this layer does not have"):
        import_kda_state_dict({**sd, "extra.weight": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError, match="output_gate_rank"):
        import_kda_state_dict(sd, KDAConfig(d_model=D, num_heads=H, head_dim=K))
    with pytest.raises(ValueError, match="not all zeros"):
        export_kda_state_dict(import_kda_state_dict(sd, cfg), cfg, "kimi")
    ours = import_kda_state_dict(sd, cfg)
    with pytest.raises(ValueError, match="not all zeros"):  # NaN is not a zero bias either
        export_kda_state_dict({**ours, "og_proj.1.bias": torch.full_like(ours["og_proj.1.bias"], float("nan"))},
                              cfg, "kimi")
    with pytest.raises(ValueError, match="'A_log' is a list, expected a tensor"):
        import_kda_state_dict({**sd, "A_log": [0.0, 0.0]}, cfg)
    for bad_t in (sd["o_proj.weight"] > 0, sd["o_proj.weight"].to(torch.int8)):  # load_state_dict would cast them
        with pytest.raises(ValueError, match=rf"'o_proj.weight' is {bad_t.dtype}, expected a floating-point tensor"):
            import_kda_state_dict({**sd, "o_proj.weight": bad_t}, cfg)
    with pytest.raises(ValueError, match=r"'A_log' is torch.int64, expected a floating-point"):
        export_kda_state_dict({**import_kda_state_dict(sd, cfg), "A_log": torch.zeros(H, dtype=torch.int64)}, cfg)
    f0 = sd["f_proj.0.weight"]  # a decay gate of another rank: the error names the config field
    with pytest.raises(ValueError, match=r"'f_proj.0.weight' has shape .* \(its rank is KDAConfig.gate_rank, None: "
                                         r"head_dim\)"):
        import_kda_state_dict({**sd, "f_proj.0.weight": torch.cat([f0, f0])}, cfg)
    with pytest.raises(ValueError, match=r"'v_proj.weight' has shape \(64, 48\), expected \(32, 48\)"):
        import_kda_state_dict(_fla_weights(seed=1, HV=2 * H), cfg)  # a GVA checkpoint needs num_v_heads
    # every problem in one message, both ways
    bad = {k: v for k, v in sd.items() if k not in ("dt_bias", "b_proj.weight")}
    bad.update({"A_log": torch.zeros(3), "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"missing 'dt_bias'; 'A_log' has shape \(3,\), expected \(2,\); missing 'b_proj.weight'; "
                                         r"keys this layer does not have: \['extra.weight'\]"):
        import_kda_state_dict(bad, cfg)
    ours = import_kda_state_dict(sd, cfg)
    with pytest.raises(ValueError, match=r"keys the layer does not have: \['extra'\]"):
        export_kda_state_dict({**ours, "extra": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError, match="q/k/v_proj weights differ in dtype"):
        import_kda_state_dict({**sd, "q_proj.weight": sd["q_proj.weight"].float()}, cfg)
    for fn in (import_kda_state_dict, export_kda_state_dict):
        with pytest.raises(TypeError, match="sd must be a state dict .* got NoneType"):
            fn(None, cfg)
        with pytest.raises(TypeError, match="sd must be a state dict .* got list"):
            fn(list(sd.items()), cfg)
        with pytest.raises(TypeError, match="config must be a kda_cp.layers.KDAConfig, got str"):
            fn(sd, "fla")
