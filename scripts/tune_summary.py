"""Sweep the launch knobs of the CP summary state kernel (from the forward's prepared tensors).

Times kda_cp.kernels.state.build_summary_kernel(dtype=bf16, operand, block_v, threads) at one shape
(median of repeats, CUDA events) and checks each variant's [S~ | M] against the first one's. Prints a
table, writes JSON. Measured on an H200 at T=32768, H=32 (2026-11-29, after the conflict-free Kd
store): (tfloat32, block_v 64, 256 threads) 3.87 ms, (32, 128) 4.56, (32, 256) 5.29, (64, 128) 5.21,
all bitwise equal; mma.sync TF32 (operand "float32", 64, 256) 4.27 ms.

    python scripts/tune_summary.py --out tune_summary.json [--T 32768 --H 32 --K 128]
"""
import argparse
import json

import torch
from _bench import time_ms

from kda_cp.kernels import _tl_name, chunk_kda_fwd_prepare
from kda_cp.kernels.state import build_summary_kernel

# (operand, block_v, threads, num_stages)
VARIANTS = [("custom[tfloat32]", 64, 256, 1), ("custom[tfloat32]", 32, 128, 1), ("custom[tfloat32]", 32, 256, 1),
            ("custom[tfloat32]", 64, 128, 1), ("float32", 64, 256, 1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="tune_summary.json")
    a = ap.parse_args()
    T, H, K = a.T, a.H, a.K
    dev = "cuda"
    q = torch.randn(1, T, H, K, device=dev).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, H, K, device=dev).bfloat16()
    g = -5 * torch.sigmoid(torch.randn(1, T, H, K, device=dev) + torch.linspace(-8, 3, K, device=dev))
    beta = torch.rand(1, T, H, device=dev)
    W, U, _, Kd, _, Ec, tables = chunk_kda_fwd_prepare(q, k, v, g, beta, scale=K**-0.5).tensors
    rows, ref = [], None
    print(f"| operand | block_v | threads | stages | ms | rel diff vs {VARIANTS[0]} |\n|---|---|---|---|---|---|")
    for op, bv, th, ns in VARIANTS:
        ker = build_summary_kernel(None, K, K, 64, dtype=_tl_name(W.dtype), operand=op, block_v=bv, threads=th,
                                   num_stages=ns)
        SM = torch.empty(1, H, K, 2 * K, device=dev)
        run = lambda: ker(W, U, Kd, Ec, tables.seq_table, SM)  # noqa: E731
        ms = time_ms(run, a.repeats)
        run()
        ref = SM.clone() if ref is None else ref
        diff = ((SM - ref).norm() / ref.norm()).item()
        rows.append(dict(operand=op, block_v=bv, threads=th, num_stages=ns, ms=ms, rel_diff=diff))
        print(f"| {op} | {bv} | {th} | {ns} | {ms:.3f} | {diff:.1e} |", flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(T=T, H=H, K=K, device=torch.cuda.get_device_name(), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
