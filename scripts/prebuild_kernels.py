"""Compile the TileLang kernels ahead of time into TileLang's disk cache (TILELANG_CACHE_DIR).

Needs nvcc, not a GPU: kernels are built for sm_90a, so a cache filled on a CPU machine is hit on
the H200. Builds what chunk_kda (forward with initial/final state, backward, state gradient) and
the CP shard summary launch for the given head dim and dtype, the state + output pass in every
launch of _common.STATE_LAUNCHES. chunk_kda's TileLang backend always runs the forward with an
initial and a final state; the other three variants serve direct callers of
kda_cp.kernels.chunk_kda_fwd.

    TILELANG_CACHE_DIR=$PWD/.devcarry/tilelang-cache python scripts/prebuild_kernels.py --head-dim 128
"""

import argparse
import time

from kda_cp.kernels.bwd_intra import build_bwd_dk_kernel, build_bwd_dv_kernel, build_bwd_ut_kernel
from kda_cp.kernels.bwd_state import build_bwd_state_kernel
from kda_cp.kernels.intra import build_decay_kernel, build_intra_kernel, build_intra_summary_kernel
from kda_cp.kernels._common import STATE_LAUNCHES
from kda_cp.kernels.state import build_state_output_kernel, build_summary_kernel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--no-backward", action="store_true")
    args = ap.parse_args()
    C, dt = args.chunk_size, args.dtype
    for K in args.head_dim:
        scale = float(K**-0.5)
        builds = {
            "intra": lambda: build_intra_kernel(None, K, K, C, dt, scale=scale),
            **{f"state+output h0={h0} ht={ht} block_v={bv} threads={th}": (
                lambda h0=h0, ht=ht, bv=bv, th=th: build_state_output_kernel(
                    None, K, K, C, dt, with_h0=h0, store_ht=ht, block_v=bv, threads=th))
               for h0 in (True, False) for ht in (True, False) for bv, th in STATE_LAUNCHES},
            "summary intra": lambda: build_intra_summary_kernel(None, K, K, C, dt),
            "summary state": lambda: build_summary_kernel(None, K, K, C),
            "CP summary state from prepared": lambda: build_summary_kernel(None, K, K, C, dtype=dt),
        }
        if not args.no_backward:
            builds.update({
                **{f"bwd state {w} block_v={bv}": (lambda w=w, bv=bv: build_bwd_state_kernel(
                    None, K, K, C, dt, walk=w, block_v=bv)) for w in ("forward", "reverse", "state_grad")
                   for bv in (16, 32)},
                "bwd dv": lambda: build_bwd_dv_kernel(None, K, K, C, dt),
                "bwd ut": lambda: build_bwd_ut_kernel(None, K, K, C, dt),
                "bwd dk": lambda: build_bwd_dk_kernel(None, K, C, dt, scale=scale),
                "bwd decay (Qg, Kd)": lambda: build_decay_kernel(None, K, C, dt, scale=scale),
            })
        for name, build in builds.items():
            t = time.time()
            build()
            print(f"K={K} {dt} {name}: {time.time() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main()
