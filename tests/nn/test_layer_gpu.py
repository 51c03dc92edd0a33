"""The KDA layer on CUDA (TileLang kernels, bf16 autocast; the conv glue on its TileLang kernels
and through torch.compile) against the fp64 layer on CPU and an fp32 reference on the torch
backend, and chunk_kda's input options through the kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kda_cp import chunk_kda
from kda_cp.layers import KDAConfig, KDALayer

from tests._utils import assert_close, perturbed, rel_rms

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

TOL = 1e-2  # relative RMS, bf16 activations


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


# Parameters the layer reads in fp32 under autocast (the gate's A_log and dt_bias, the conv's and
# the norm's weights): left off the bf16 grid, so a path that cast them to bf16 would show.
FP32_PARAMS = ("A_log", "g_up.bias", "qkv_conv.weight", "o_norm.weight")


def _layer_pair(seed, **cfg):
    """(fp64 CPU layer, CUDA layer) with the same weights, those that autocast casts to bf16 (the
    GEMMs') on the bf16 grid: the casts are then exact, and the comparison measures the
    implementation, not the quantization of its inputs (rounding the weights and x to bf16 alone
    moves the gate-path gradients by 0.6-1.25e-2 relative RMS at these sizes, with everything
    else in fp64: scripts/layer_quantization.py)."""
    torch.manual_seed(seed)
    ref = perturbed(KDALayer(KDAConfig(backend="torch", **cfg)), seed)  # fp64, CPU
    with torch.no_grad():
        for name, prm in ref.named_parameters():
            if name not in FP32_PARAMS:
                prm.copy_(_bf16(prm))
    gpu = KDALayer(KDAConfig(backend="tilelang", **cfg)).cuda()
    gpu.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    return ref, gpu


def _run(layer, x, dy, cu, autocast):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x, cu_seqlens=cu)
    grads = torch.autograd.grad(y, [x, *layer.parameters()], dy.to(y.dtype))
    return y, grads


# KNOWN_GAP: entries that exceed TOL today, each with why. The test xfails on them alone (the
# others still checked) and fails once they are within TOL, so the entry is then removed.
KNOWN_GAP = {"grad A_log": "A_log's gradient is one number per head (here 2), a sum over T x K of the kernels' "
                           "dg (held to 2e-2 at the op level) with cancellation: 1.47-1.53e-2 from fp64 on an "
                           "H100, where on CPU the fp32 reference with the same bf16 activations is within 1.6e-3"}
CASES = pytest.mark.parametrize("B,T,cu,og_rank,gaps", [
    (2, 333, None, None, ()),
    (1, 1000, [0, 300, 301, 777, 1000], 128, ("grad A_log",)),
], ids=["dense-T333", "packed-T1000"])


def _outputs(B, T, cu, og_rank, glue, monkeypatch):
    """(name, fp64 CPU layer, CUDA layer on the TileLang kernels, fp32 reference) for the output
    and every gradient. The fp32 reference is the same CUDA layer and autocast on the torch backend
    with eager glue: its activations are rounded to bf16 at the same points (GEMM and conv
    outputs) while the op and the glue compute in fp32. Same weights, x and dy; glue sets
    KDA_CP_GLUE_KERNELS for the kernels' layer."""
    ref, gpu = _layer_pair(1, d_model=256, num_heads=2, head_dim=128, output_gate_rank=og_rank)
    fp32 = KDALayer(dataclasses.replace(gpu.config, backend="torch")).cuda()
    fp32.load_state_dict(gpu.state_dict())
    gen = torch.Generator().manual_seed(2)
    x = _bf16(torch.randn(B, T, 256, generator=gen, dtype=torch.float64))
    dy = _bf16(torch.randn(B, T, 256, generator=gen, dtype=torch.float64))
    cu_t = None if cu is None else torch.tensor(cu)
    xc, dyc, cuc = x.float().cuda(), dy.float().cuda(), None if cu is None else cu_t.cuda()
    y_ref, g_ref = _run(ref, x, dy, cu_t, autocast=False)
    with monkeypatch.context() as m:
        m.setenv("KDA_CP_GLUE_KERNELS", glue)
        y, g = _run(gpu, xc, dyc, cuc, autocast=True)
    with monkeypatch.context() as m:
        m.setenv("KDA_CP_GLUE_KERNELS", "0")
        m.setenv("KDA_CP_EAGER_GLUE", "1")
        y32, g32 = _run(fp32, xc, dyc, cuc, autocast=True)
    names = ["y", "grad x"] + [f"grad {n}" for n, _ in ref.named_parameters()]
    for name, a, b, c in zip(names, [y_ref, *g_ref], [y, *g], [y32, *g32], strict=True):
        assert torch.isfinite(b).all() and a.abs().max() > 0, name
        yield name, a, b.cpu().double(), c.cpu().double()


@CASES
@pytest.mark.parametrize("glue", ["all", "0"], ids=["glue-kernels", "compiled-glue"])
def test_layer_matches_fp64_and_fp32_reference(B, T, cu, og_rank, gaps, glue, monkeypatch):
    """Output, input gradient and every parameter's gradient (the gate path's A_log, g_down, g_up
    included) within 1e-2 relative RMS of the fp64 layer and of the fp32 reference, but the
    case's KNOWN_GAP entries (an xfail while they exceed it, a failure once they do not)."""
    lines, bad = [], {}
    for name, a, b, c in _outputs(B, T, cu, og_rank, glue, monkeypatch):
        e64, e32 = rel_rms(a, b), rel_rms(c, b)
        lines.append(f"{name}: vs fp64 {e64:.2e}, vs fp32 reference {e32:.2e}, reference vs fp64 {rel_rms(a, c):.2e}")
        if not max(e64, e32) <= TOL:
            bad[name] = (e64, e32)
    print("\n".join(lines))
    msg = f"relative RMS (vs fp64, vs fp32 reference) above {TOL}: {bad}"
    assert set(bad) <= set(gaps), msg
    missing = set(gaps) - set(bad)
    assert not missing, f"{sorted(missing)} now within {TOL}: remove them from the case's gaps"
    if bad:
        pytest.xfail(f"{msg}; {'; '.join(KNOWN_GAP[n] for n in bad)}")


def test_padding_after_last_packed_token_gets_zero_gradient():
    """Packed sequences and a tail of padding (its own segment): the real tokens' outputs do not
    depend on the padding, and with the loss on real tokens the padding's input gradient is 0."""
    _, gpu = _layer_pair(3, d_model=256, num_heads=2, head_dim=128)
    cu = torch.tensor([0, 200, 517, 640], device="cuda")  # rows 517..639: padding
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(1, 640, 256, generator=gen, device="cuda")
    dy = torch.randn(1, 640, 256, generator=gen, device="cuda")
    dy[:, 517:] = 0
    y, grads = _run(gpu, x, dy, cu, autocast=True)
    x2 = x.clone()
    x2[:, 517:] = 100 * torch.randn(1, 123, 256, generator=gen, device="cuda")
    y2, _ = _run(gpu, x2, dy, cu, autocast=True)
    assert torch.equal(y[:, :517], y2[:, :517])
    assert all(torch.isfinite(gr).all() for gr in grads)
    assert torch.count_nonzero(grads[0][:, 517:]) == 0
    assert torch.count_nonzero(grads[0][:, :517]) > 0


@pytest.mark.parametrize("T", [1000, 64])
def test_op_options_through_kernels(T):
    H, K = 3, 128
    gen = torch.Generator().manual_seed(T)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = 3 * r(1, T, H, K), 2 * r(1, T, H, K), r(1, T, H, K)
    z = r(1, T, H, K) + torch.linspace(-6, 3, K, dtype=torch.float64)
    b, A_log, dt_bias = 2 * r(1, T, H), 0.5 * r(H), 0.3 * r(H * K)
    do = r(1, T, H, K)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)

    def run(device, dtype, backend):
        leaves = [x.to(device, dtype).requires_grad_(True) for x in (q, k, v)]
        leaves += [x.to(device, torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(True)
                   for x in (z, b, A_log, dt_bias)]
        o, _ = chunk_kda(*leaves[:5], A_log=leaves[5], dt_bias=leaves[6], backend=backend, g_min=-5.0, **opts)
        return [o] + list(torch.autograd.grad(o, leaves, do.to(device, o.dtype)))

    want = run("cpu", torch.float64, "torch")
    got = run("cuda", torch.bfloat16, "tilelang")
    for name, a, b_ in zip(["o", "q", "k", "v", "g", "beta", "A_log", "dt_bias"], want, got):
        assert_close(name, a, b_.cpu(), TOL)
