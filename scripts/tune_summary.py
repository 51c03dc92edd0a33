"""Sweep the operand type and the number of pieces of the CP summary (from the forward's prepared tensors).

Times kda_cp.kernels.launch.summary_run (the summary state kernel over each sequence cut into `pieces`
parts, plus their composition) at the benchmark shapes S1 (T=32768, H=32) and S3 (T=131072,
H=16), bf16, median of repeats with CUDA events, and checks each result against the first one's.
Prints a table, writes JSON. With --only P it runs pieces=P once per shape (for ncu). Measured on
an H200 (2026-11-30, docs/results/h200_tune_summary.json), ms for 1 / 2 / 4 pieces: bf16x2 (the
register-operand kernel) S1 0.70 / 0.91 / 1.05, S3 2.73 / 1.76 / 1.79; tf32x2 S1 2.56 / 2.76 / 2.63,
S3 10.13 / 5.57 / 5.51.

    python scripts/tune_summary.py --out tune_summary.json [--shapes S1 S3] [--only 2]
"""
import argparse
import json

import torch
from _bench import SHAPES, make_inputs, time_ms

from kda_cp.kernels import chunk_kda_fwd_prepare
from kda_cp.kernels.launch import summary_pieces, summary_run

PIECES = [1, 2, 4]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["S1", "S3"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--only", type=int, default=None)
    ap.add_argument("--out", default="tune_summary.json")
    a = ap.parse_args()
    rows = []
    for name in a.shapes:
        sh = SHAPES[name]
        q, k, v, g, beta = make_inputs(**sh)
        prep = chunk_kda_fwd_prepare(q, k, v, g, beta, scale=sh["K"] ** -0.5)
        W, U, _, Kd, _, Ec, tables = prep.tensors
        run = lambda p, ops="bf16x2": summary_run(W, U, Kd, Ec, tables.seq_table, tables.num_chunks, p, ops)  # noqa: E731
        if a.only is not None:
            run(a.only)
            torch.cuda.synchronize()
            continue
        auto = summary_pieces(W.device, sh["B"], sh["H"], sh["K"], sh["V"], tables.num_chunks)
        print(f"\n{name} {sh} (default pieces: {auto})\n| operands | pieces | ms | rel diff of [M, S~] vs TF32, "
              f"1 piece |\n|---|---|---|---|")
        ref = None
        for ops in ("tf32x2", "bf16x2"):
            for p in PIECES:
                ms = time_ms(lambda: run(p, ops), a.repeats)
                M, S = run(p, ops)
                out = torch.cat([M, S], -1)
                ref = out if ref is None else ref
                diff = ((out - ref).norm() / ref.norm()).item()
                rows.append(dict(shape=name, operands=ops, pieces=p, default=ops == "bf16x2" and p == auto, ms=ms,
                                 rel_diff=diff))
                print(f"| {ops} | {p} | {ms:.3f} | {diff:.1e} |", flush=True)
    if a.only is None:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
