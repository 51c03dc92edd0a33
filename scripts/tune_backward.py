"""Time the backward's chunk-parallel kernels ("dv", "ut", "dk") over their launch variants.

At one benchmark shape (default S1), bf16, each kernel alone on the same inputs (random, with the
backward's structure: dAqk lower-triangular, dB strictly lower-triangular, the forward's W, U, Aqk
from the chunk-local kernel), median of --repeats CUDA-event timings, three times; and the largest
relative difference of each variant's outputs to the first (default) variant's, which should be
0 or at the level of fp32 reordering. Prints a table and writes JSON.

    python scripts/tune_backward.py --out tune_backward.json [--shape S1] [--repeats 10]
"""
import argparse
import json

import torch
from _bench import SHAPES, make_inputs, time_ms

from kda_cp.kernels import chunk_kda_fwd_prepare
from kda_cp.kernels.bwd_intra import build_bwd_dk_kernel, build_bwd_dv_kernel, build_bwd_ut_kernel

VARIANTS = {  # first = the default launch
    "dv": [dict(threads=256), dict(threads=128)],
    "ut": [dict(threads=256), dict(threads=128)],
    "dk": [dict(block_k=64), dict(block_k=32)],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="S1", choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="tune_backward.json")
    a = ap.parse_args()
    sh = SHAPES[a.shape]
    B, T, H, K, V = (sh[x] for x in "BTHKV")
    C, dt, scale = 64, "bfloat16", K ** -0.5
    q, k, v, g, beta = make_inputs(**sh)
    W, U, Qg, Kd, Aqk, Ec, tables = chunk_kda_fwd_prepare(q, k, v, g, beta, scale=scale).tensors
    NC = tables.num_chunks
    gen = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: 0.1 * torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    tril = torch.tril(torch.ones(C, C, device="cuda"))
    bf = torch.bfloat16
    Hs, dHs, do = r(NC, H, K, V).to(bf), r(NC, H, K, V).to(bf), r(B * T, H, V).to(bf)
    dAqk, dB = (r(NC, H, C, C) * tril).to(bf), (r(NC, H, C, C) * (tril - torch.eye(C, device="cuda"))).to(bf)
    dQg, dKd, dGk, dW = (r(NC, H, C, K).to(bf) for _ in range(4))
    dU = r(NC, H, C, V).to(bf)
    dEc = r(NC, H, K)
    qf, kf, vf, gf = (x.view(B * T, H, -1) for x in (q, k, v, g))
    betaf = beta.view(B * T, H)
    ct = tables.chunk_table

    def setup(name, kw):
        if name == "dv":
            ker = build_bwd_dv_kernel(None, K, V, C, dt, **kw)
            out = (torch.empty(NC, H, C, C, device="cuda", dtype=bf), torch.empty(NC, H, C, K, device="cuda", dtype=bf),
                   torch.empty(NC, H, C, K, device="cuda", dtype=bf), torch.empty(NC, H, K, device="cuda"),
                   torch.empty(NC, H, C, K, device="cuda", dtype=bf), torch.empty(NC, H, C, V, device="cuda", dtype=bf))
            return (lambda: ker(W, U, Kd, Aqk, Hs, dHs, do, ct, *out)), out
        if name == "ut":
            ker = build_bwd_ut_kernel(None, K, V, C, dt, **kw)
            out = (torch.zeros_like(vf), torch.zeros(B * T, H, device="cuda"),
                   torch.empty(NC, H, C, C, device="cuda", dtype=bf), torch.empty(NC, H, C, K, device="cuda", dtype=bf))
            return (lambda: ker(kf, vf, gf, betaf, ct, W, U, dW, dU, *out)), out
        ker = build_bwd_dk_kernel(None, K, C, dt, scale=scale, **kw)
        out = (torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(gf))
        return (lambda: ker(qf, kf, gf, ct, dAqk, dB, dQg, dKd, dGk, dEc, *out)), out

    rows = []
    for name, variants in VARIANTS.items():
        ref = None
        for kw in variants:
            fn, out = setup(name, kw)
            fn()
            torch.cuda.synchronize()
            ms = [time_ms(fn, a.repeats) for _ in range(3)]
            if ref is None:
                ref, diff = [o.clone() for o in out], 0.0
            else:
                diff = max(((o.double() - x.double()).norm() / x.double().norm().clamp_min(1e-30)).item()
                           for o, x in zip(out, ref))
            rows.append(dict(kernel=name, launch=kw, ms=ms, rel_diff_to_default=diff))
            print(f"| {name} | {kw} | {' / '.join(f'{t:.3f}' for t in ms)} | {diff:.2e} |", flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), shape=a.shape, rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
