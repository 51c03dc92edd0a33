"""Compile the TileLang kernels ahead of time into TileLang's disk cache (TILELANG_CACHE_DIR).

Needs nvcc, not a GPU: kernels are built for sm_90a, so a cache filled on a CPU machine is hit on
the H200. Builds what chunk_kda (forward with initial/final state, backward, state gradient) and
the CP shard summary launch for the given head dim and dtype, the state + output pass in every
launch of _common.STATE_LAUNCHES, the chunk-local kernel with the gate inside (bf16, the layer's
path, g_min = -5), and the general-gate variants (g_min=None). chunk_kda's TileLang backend always
runs the forward with an initial and a final state; the other three variants serve direct callers
of kda_cp.kernels.chunk_kda_fwd.

    TILELANG_CACHE_DIR=$PWD/.devcarry/tilelang-cache python scripts/prebuild_kernels.py --head-dim 128 \
        --layer 2048 16 --layer 1024 8 --layer 2304 32 --output-gate-rank 128 --conv-tune --jobs 8
        # + the conv, gated RMSNorm and gate-backward kernels of bench_layer.py's shapes L1-L3, and the conv
        # kernels of tune_conv.py's launches

The layer GPU tests (tests/nn/test_layer_gpu.py) build their own conv and glue kernels, 13 s each on
the GPU host; `--layer 256 2 --conv-packed --only-layers`, once as is and once with
`--output-gate-rank 128`, puts them in the cache too, and the same with `--output-gate-rank 128
--v-heads 4` those of the GVA layers of tests/nn/test_interop_gpu.py. The kernel GPU tests (tests/kernels,
tests/ops, tests/cp) also build K = 64 and fp16 kernels: `--head-dim 64`, `--head-dim 64 --dtype float16` and
`--head-dim 128 --dtype float16` cache those (about 15 minutes with --jobs 2).

--jobs N splits the list over N processes (about one core each; most of a build is nvcc).
"""

import argparse
import re
import subprocess
import sys
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
    ap.add_argument("--layer", type=int, nargs=2, action="append", default=[], metavar=("D", "H"),
                    help="also the short conv kernels of a KDALayer(d_model=D, num_heads=H, head_dim=--head-dim) "
                         "(repeatable); the conv kernels are built per channel count and row stride")
    ap.add_argument("--output-gate-rank", type=int, default=None, help="the layers' output_gate_rank (default: full)")
    ap.add_argument("--v-heads", type=int, default=None, help="the layers' num_v_heads (GVA; default: H)")
    ap.add_argument("--conv-packed", action="store_true", help="the conv kernels for packed sequences too")
    ap.add_argument("--conv-tune", action="store_true", help="the conv kernels of every launch scripts/tune_conv.py times")
    ap.add_argument("--only-layers", action="store_true", help="only the --layer conv kernels")
    ap.add_argument("--match", default=None, help="only the kernels whose name (as printed) matches this regex")
    ap.add_argument("--jobs", type=int, default=1, help="build in this many processes (each compile is one nvcc run)")
    ap.add_argument("--shard", type=int, nargs=2, default=(0, 1), metavar=("I", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.jobs > 1 and tuple(args.shard) == (0, 1):  # this command once per shard of the list, in parallel
        procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--jobs", "1", "--shard", str(j),
                                   str(args.jobs)]) for j in range(args.jobs)]
        codes = [p.wait() for p in procs]
        sys.exit(0 if not any(codes) else 1)
    C, dt = args.chunk_size, args.dtype
    builds = {}
    for D, H in args.layer:
        builds.update(_conv_builds(D, H, args.head_dim[0], dt, args.output_gate_rank, args.conv_packed, args.conv_tune,
                                   args.v_heads))
        builds.update(_glue_builds(args.v_heads or H, args.head_dim[0], dt))  # the gate runs over the value heads
    for K in [] if args.only_layers else args.head_dim:
        builds.update(_op_builds(K, C, dt, not args.no_backward))
    if args.match:
        builds = {name: b for name, b in builds.items() if re.search(args.match, name)}
    shard, n = args.shard
    for name, build in list(builds.items())[shard::n]:
        t = time.time()
        build()
        print(f"{name}: {time.time() - t:.1f} s", flush=True)


def _op_builds(K, C, dt, backward):
    """{name: build} of the op's kernels for head dim K (module docstring)."""
    scale = float(K**-0.5)
    pre = f"K={K} {dt} "
    builds = {
        pre + "intra": lambda: build_intra_kernel(None, K, K, C, dt, scale=scale),
        pre + "intra, general gate": lambda: build_intra_kernel(None, K, K, C, dt, scale=scale, general=True),
        **({pre + f"intra, gate inside (beta_scale={bs})": (lambda bs=bs: build_intra_kernel(
            None, K, K, C, dt, scale=scale, gate_min=-5.0, beta_scale=bs)) for bs in (1.0, 2.0, None)}
           if dt == "bfloat16" else {}),
        **{pre + f"state+output h0={h0} ht={ht} block_v={bv} threads={th}": (
            lambda h0=h0, ht=ht, bv=bv, th=th: build_state_output_kernel(
                None, K, K, C, dt, with_h0=h0, store_ht=ht, block_v=bv, threads=th))
           for h0 in (True, False) for ht in (True, False) for bv, th in STATE_LAUNCHES},
        pre + "summary intra": lambda: build_intra_summary_kernel(None, K, K, C, dt),
        pre + "summary intra, general gate": lambda: build_intra_summary_kernel(None, K, K, C, dt, general=True),
        pre + "summary state": lambda: build_summary_kernel(None, K, K, C),
        pre + "CP summary state from prepared": lambda: build_summary_kernel(None, K, K, C, dtype=dt),
    }
    if backward:
        builds.update({
            **{pre + f"bwd state {w} block_v={bv}": (lambda w=w, bv=bv: build_bwd_state_kernel(
                None, K, K, C, dt, walk=w, block_v=bv)) for w in ("forward", "reverse", "state_grad")
               for bv in (16, 32)},
            pre + "bwd dv": lambda: build_bwd_dv_kernel(None, K, K, C, dt),
            pre + "bwd ut": lambda: build_bwd_ut_kernel(None, K, K, C, dt),
            pre + "bwd dk": lambda: build_bwd_dk_kernel(None, K, C, dt, scale=scale),
            pre + "bwd decay (Qg, Kd)": lambda: build_decay_kernel(None, K, C, dt, scale=scale),
            **{pre + f"bwd {n}, general gate": b for n, b in (
                ("ut", lambda: build_bwd_ut_kernel(None, K, K, C, dt, general=True)),
                ("dk", lambda: build_bwd_dk_kernel(None, K, C, dt, scale=scale, general=True)),
                ("decay (Qg, Kd)", lambda: build_decay_kernel(None, K, C, dt, scale=scale, general=True)))},
        })
    return builds


def _conv_builds(D, H, K, dt, output_gate_rank, packed, tune=False, v_heads=None):
    """{name: build} of the conv + SiLU + L2Norm kernels (forward, backward; q, k, v parts) that a
    KDALayer of this shape launches: x is the first (2 H + HV) K columns of the fused input projection, whose row
    holds W_qkv, W_g_down (rank K), W_beta (HV) and the output gate's first matrix."""
    from kda_cp.kernels.conv import build_conv_kernel
    from kda_cp.layers import KDAConfig

    c = KDAConfig(d_model=D, num_heads=H, num_v_heads=v_heads, head_dim=K, output_gate_rank=output_gate_rank)
    rank = K if c.gate_rank is None else c.gate_rank
    og = c.v_heads * c.v_dim if output_gate_rank is None else output_gate_rank
    C = 2 * H * K + c.v_heads * c.v_dim
    width = C + rank + c.v_heads + og
    if width * (2 if dt in ("bfloat16", "float16") else 4) % 16:
        width = C  # rows TMA cannot read in place: the conv reads a contiguous copy (conv._rows)
    parts = [(H, 0), (H, H * K), (c.v_heads * c.v_dim // K, 2 * H * K)]  # (heads of K columns, first column)
    pre = f"layer D={D} H={H}{'' if v_heads is None else f' HV={v_heads}'}: "
    builds = {}
    for pk in (False, True) if packed else (False,):
        for bwd in (False, True):
            for part, (nh, base) in enumerate(parts):
                builds[pre + f"conv {'bwd' if bwd else 'fwd'} part {part} packed={pk}"] = (
                    lambda pk=pk, bwd=bwd, part=part, nh=nh, base=base: build_conv_kernel(
                        C, width, nh, K, c.conv_size, part, dt, dt, float(c.norm_eps), backward=bwd, packed=pk,
                        base=base))
    if tune:  # the other launches of tune_conv.py (dense)
        from tune_conv import LAUNCHES

        for bwd in (False, True):
            for launch in LAUNCHES["bwd" if bwd else "fwd"][1:]:
                for part, (nh, base) in enumerate(parts):
                    builds[pre + f"conv {'bwd' if bwd else 'fwd'} part {part} launch {launch}"] = (
                        lambda bwd=bwd, part=part, launch=launch, nh=nh, base=base: build_conv_kernel(
                            C, width, nh, K, c.conv_size, part, dt, dt, float(c.norm_eps), backward=bwd,
                            packed=False, launch=launch, base=base))
    return builds


def _glue_builds(H, K, dt):
    """{name: build} of the gated RMSNorm (forward, backward) and the gate's backward of a KDALayer
    with H heads of K channels: weights in the activations' dtype (bf16 layers) or fp32 (autocast),
    both gate forms."""
    from kda_cp.kernels.norm import build_gate_bwd_kernel, build_rms_norm_gated_kernel

    eps = 1e-6  # KDAConfig.norm_eps
    builds = {}
    for wdt in (dt, "float32"):
        for bwd in (False, True):
            builds[f"layer H={H}: rms_norm_gated {'bwd' if bwd else 'fwd'} weight {wdt}"] = (
                lambda wdt=wdt, bwd=bwd: build_rms_norm_gated_kernel(K, dt, dt, wdt, dt, eps, backward=bwd))
    for g_min in (-5.0, None):
        builds[f"layer H={H}: gate bwd g_min={g_min}"] = lambda g_min=g_min: build_gate_bwd_kernel(H, K, dt, g_min)
    return builds


if __name__ == "__main__":
    main()
