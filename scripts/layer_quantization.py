"""How far bf16 quantization of the inputs alone moves the KDA layer's output and gradients.

The fp64 layer (torch backend, CPU) with every parameter, x and dy rounded to bf16, against the
same layer unrounded: what rounding a bf16 layer's inputs costs before any kernel runs (kda_cp's
layer under autocast keeps A_log, dt_bias and the conv and norm weights in fp32, so it avoids part
of it). The cases and the weight perturbation are those of tests/nn/test_layer_gpu.py.

    python scripts/layer_quantization.py

Prints a Markdown table of relative RMS errors (one column per case).
"""

import torch

from kda_cp.layers import KDAConfig, KDALayer

CASES = {"dense-T333": (2, 333, None, None), "packed-T1000": (1, 1000, [0, 300, 301, 777, 1000], 128)}


def rel_rms(ref, out):
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def layer(og_rank, state=None):
    torch.manual_seed(1)
    m = KDALayer(KDAConfig(d_model=256, num_heads=2, head_dim=128, output_gate_rank=og_rank, backend="torch")).double()
    if state is None:  # every parameter off its init, as the tests' perturbed()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    else:
        m.load_state_dict(state)
    return m


def run(m, x, dy, cu):
    x = x.clone().requires_grad_(True)
    y = m(x, cu_seqlens=cu)
    return [y, *torch.autograd.grad(y, [x, *m.parameters()], dy)]


def main():
    cols = {}
    for name, (B, T, cu, og) in CASES.items():
        ref = layer(og)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(B, T, 256, generator=gen, dtype=torch.float64)
        dy = torch.randn(B, T, 256, generator=gen, dtype=torch.float64)
        cu = None if cu is None else torch.tensor(cu)
        bf = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
        rounded = layer(og, {k: bf(v) for k, v in ref.state_dict().items()})
        names = ["y", "grad x"] + [f"grad {n}" for n, _ in ref.named_parameters()]
        cols[name] = dict(zip(names, map(rel_rms, run(ref, x, dy, cu), run(rounded, bf(x), bf(dy), cu))))
    rows = list(dict.fromkeys(r for c in cols.values() for r in c))  # the cases' names, in order
    print("| relative RMS | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r} | " + " | ".join(f"{cols[c][r]:.2e}" if r in cols[c] else "-" for c in cols) + " |")


if __name__ == "__main__":
    main()
