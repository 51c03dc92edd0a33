"""Time the short conv + SiLU + L2Norm kernels' launches at the layer shapes, each against the default.

A launch is (threads per block, resident blocks per SM): the token split keeps that many blocks on
every SM, and the backward's launch bounds ask ptxas for registers that fit them. At each layer
shape of bench_layer.py (x the q/k/v columns of the layer's fused projection output, bf16, dense),
forward and backward alone on the same random inputs, median of --repeats CUDA-event timings, and
the largest relative RMS difference of each launch's outputs to the default's, reported for the reader
to judge (q, k, v and dx should be bitwise equal; the weight gradient's partial sums are added in
another grouping, so it may differ at fp32 rounding). Prints a table and writes JSON. Build the
kernels first: prebuild_kernels.py --layer D H ... --only-layers --conv-tune.

    python scripts/tune_conv.py --out tune_conv.json [--shapes L1 L2 L3] [--repeats 20]
"""
import argparse
import json

import torch
from _bench import time_ms
from bench_backward import rel
from bench_layer import HEAD_DIM, LAYER_SHAPES

from kda_cp.kernels.conv import BWD_LAUNCH, FWD_LAUNCH, conv_silu_norm_bwd, conv_silu_norm_fwd

# the first listed launch is the default (conv.FWD_LAUNCH / BWD_LAUNCH)
# Each fits its blocks in an SM's 64 K registers (allocated per warp in units of 256): the forward
# at 128 threads as compiled (124 registers), the backward through its launch bounds.
LAUNCHES = {"fwd": [FWD_LAUNCH, (128, 4)], "bwd": [BWD_LAUNCH, (512, 1), (512, 2), (128, 2)]}
CONV = 4  # the layer's conv width
EPS = 1e-6


def tune_shape(name, repeats):
    s = LAYER_SHAPES[name]
    B, T, H, K = s["B"], s["T"], s["H"], HEAD_DIM
    C = 3 * H * K
    width = C + K + H + K  # + g_down (rank K), beta (H), the output gate's first matrix (rank K)
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *sh: torch.randn(*sh, generator=gen, device="cuda")  # noqa: E731
    x = r(B, T, width).bfloat16()[..., :C]
    weight = 0.5 * r(C, CONV)
    halo = r(B, CONV - 1, C).bfloat16()
    dq, dk, dv = (r(B, T, H, K).bfloat16() for _ in range(3))
    rows = {}
    ref = {}
    for direction in ("fwd", "bwd"):
        for launch in LAUNCHES[direction]:
            if direction == "fwd":
                fn = lambda: conv_silu_norm_fwd(x, weight, halo, None, K, EPS, launch=launch)  # noqa: E731
            else:
                fn = lambda: conv_silu_norm_bwd(x, weight, halo, None, dq, dk, dv, K, EPS, launch=launch)  # noqa: E731
            out = fn()
            names = ("q", "k", "v") if direction == "fwd" else ("dx", "dweight", "dhalo")
            if launch == LAUNCHES[direction][0]:
                ref[direction] = out
            diff = {n: rel(o, rf) for n, o, rf in zip(names, out, ref[direction])}
            rows[f"{direction} {launch[0]}x{launch[1]}"] = {"ms": time_ms(fn, repeats), "rel_rms_diff": diff}
    return {"shape": {"name": name, **s, "head_dim": K}, "launches": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["L1", "L2", "L3"], choices=[n for n in LAYER_SHAPES if n != "tiny"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="tune_conv.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_conv.py needs a Hopper GPU")
    res = [tune_shape(n, args.repeats) for n in args.shapes]
    print("\n| launch (threads x blocks/SM) | " + " | ".join(f"{r['shape']['name']} ms" for r in res)
          + " | largest rel. RMS diff to the default |")
    print("|---|" + "---|" * len(res) + "---|")
    for key in res[0]["launches"]:
        diffs = max(max(r["launches"][key]["rel_rms_diff"].values()) for r in res)
        print(f"| {key} | " + " | ".join(f"{r['launches'][key]['ms']:.3f}" for r in res) + f" | {diffs:.1e} |")
    with open(args.out, "w") as f:
        json.dump({"meta": {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                            "repeats": args.repeats}, "rows": res}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
