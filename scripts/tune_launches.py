"""Time the chunk kernels' launch variants: the forward's state + output pass and the backward's
state walks, "dv", "ut" and "dk".

At each benchmark shape (default S1 S2 S3), bf16, each kernel alone on the same inputs (random, with
the backward's structure: dAqk lower-triangular, dB strictly lower-triangular, the forward's W, U,
Aqk from the chunk-local kernel), median of --repeats CUDA-event timings, three times; and the
largest relative difference of each variant's outputs to the first listed variant's, which must
be 0 or at the level of fp32 reordering (a launch that computes something else shows here). Prints
a table and writes JSON.

    python scripts/tune_launches.py --out tune_launches.json [--shapes S1 S2 S3] [--repeats 10]
        [--kernels state+output ...]
"""
import argparse
import json

import torch
from _bench import SHAPES, make_inputs, time_ms

from kda_cp.kernels import chunk_kda_fwd_prepare
from kda_cp.kernels.bwd_intra import build_bwd_dk_kernel, build_bwd_dv_kernel, build_bwd_ut_kernel
from kda_cp.kernels.bwd_state import build_bwd_state_kernel
from kda_cp.kernels.state import build_state_output_kernel

VARIANTS = {  # the first listed launch is the reference the others are compared with
    "state+output": [dict(block_v=16, threads=128), dict(block_v=32, threads=256), dict(block_v=32, threads=128),
                     dict(block_v=64, threads=128)],
    "walk forward": [dict(block_v=32, threads=128), dict(block_v=32, threads=256), dict(block_v=16, threads=128)],
    "walk reverse": [dict(block_v=32, threads=128), dict(block_v=32, threads=256), dict(block_v=16, threads=128)],
    "dv": [dict(threads=256), dict(threads=128)],
    "ut": [dict(threads=256), dict(threads=128)],
    "dk": [dict(block_k=64)],
}


def tune_shape(shape, repeats, kernels=tuple(VARIANTS)):
    sh = SHAPES[shape]
    B, T, H, K, V = (sh[x] for x in "BTHKV")
    C, dt, scale = 64, "bfloat16", K ** -0.5
    q, k, v, g, beta = make_inputs(**sh)
    W, U, Qg, Kd, Aqk, Ec, tables = chunk_kda_fwd_prepare(q, k, v, g, beta, scale=scale).tensors
    NC, N = tables.num_chunks, B
    gen = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: 0.1 * torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    tril = torch.tril(torch.ones(C, C, device="cuda"))
    bf = torch.bfloat16
    Hs, dHs, do = r(NC, H, K, V).to(bf), r(NC, H, K, V).to(bf), r(B * T, H, V).to(bf)
    dAqk, dB = (r(NC, H, C, C) * tril).to(bf), (r(NC, H, C, C) * (tril - torch.eye(C, device="cuda"))).to(bf)
    dQg, dKd, dGk, dW = (r(NC, H, C, K).to(bf) for _ in range(4))
    dU = r(NC, H, C, V).to(bf)
    dEc = r(NC, H, K)
    h0, dht = r(N, H, K, V), r(N, H, K, V)
    qf, kf, vf, gf = (x.view(B * T, H, -1) for x in (q, k, v, g))
    betaf = beta.view(B * T, H)
    ct, st = tables.chunk_table, tables.seq_table
    e = lambda *s, dtype=bf: torch.empty(*s, device="cuda", dtype=dtype)  # noqa: E731

    def setup(name, kw):
        if name == "state+output":
            ker = build_state_output_kernel(None, K, V, C, dt, with_h0=True, store_ht=True, **kw)
            out = (e(B * T, H, V), e(N, H, K, V, dtype=torch.float32))
            return (lambda: ker(W, U, Qg, Kd, Aqk, Ec, st, h0, *out)), out
        if name.startswith("walk"):
            walk = name.split()[1]
            ker = build_bwd_state_kernel(None, K, V, C, dt, walk=walk, **kw)
            out = (e(NC, H, K, V), e(NC, H, K, V), e(N, H, K, V, dtype=torch.float32))
            keep = out[:1] if walk == "forward" else out[1:]
            return (lambda: ker(W, U, Qg, Kd, Aqk, Ec, do, st, h0, dht, *out)), keep
        if name == "dv":
            ker = build_bwd_dv_kernel(None, K, V, C, dt, **kw)
            out = (e(NC, H, C, C), e(NC, H, C, K), e(NC, H, C, K), e(NC, H, K, dtype=torch.float32),
                   e(NC, H, C, K), e(NC, H, C, V))
            return (lambda: ker(W, U, Kd, Aqk, Hs, dHs, do, ct, *out)), out
        if name == "ut":
            ker = build_bwd_ut_kernel(None, K, V, C, dt, **kw)
            out = (torch.zeros_like(vf), torch.zeros(B * T, H, device="cuda"), e(NC, H, C, C), e(NC, H, C, K))
            return (lambda: ker(kf, vf, gf, betaf, ct, W, U, dW, dU, *out)), out
        ker = build_bwd_dk_kernel(None, K, C, dt, scale=scale, **kw)
        out = (torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(gf))
        return (lambda: ker(qf, kf, gf, ct, dAqk, dB, dQg, dKd, dGk, dEc, *out)), out

    rows = []
    for name, variants in VARIANTS.items():
        if name not in kernels:
            continue
        ref = None
        for kw in variants:
            fn, out = setup(name, kw)
            fn()
            torch.cuda.synchronize()
            ms = [time_ms(fn, repeats) for _ in range(3)]
            if ref is None:
                ref, diff = [o.clone() for o in out], 0.0
            else:
                diff = max(((o.double() - x.double()).norm() / x.double().norm().clamp_min(1e-30)).item()
                           for o, x in zip(out, ref))
            rows.append(dict(shape=shape, kernel=name, launch=kw, ms=ms, rel_diff_to_first=diff))
            print(f"| {shape} | {name} | {kw} | {' / '.join(f'{t:.3f}' for t in ms)} | {diff:.2e} |", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["S1", "S2", "S3"], choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="tune_launches.json")
    ap.add_argument("--kernels", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="which kernels' launches to time (default: all)")
    a = ap.parse_args()
    print("| shape | kernel | launch | ms (3 medians) | rel. diff to first |\n|---|---|---|---|---|")
    rows = [row for s in a.shapes for row in tune_shape(s, a.repeats, a.kernels)]
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
