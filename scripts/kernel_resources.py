"""Registers, spills and shared memory of each TileLang kernel, from ptxas, without a GPU.

Compiles every kernel that chunk_kda's forward, backward and the CP summary launch (TileLang's disk
cache applies), recompiles its generated CUDA with `nvcc -Xptxas=-v` for sm_90a, and prints one line
per kernel: launch bounds (threads, min blocks per SM), registers per thread, spill bytes, dynamic
shared memory, and how many blocks fit an SM by registers and by shared memory (H100/H200: 64 K
registers, 227 KB of shared memory per SM). A kernel whose blocks per SM drop to one is usually
latency-bound: every serial phase of a block is then exposed (docs/kernels.md).

    python scripts/kernel_resources.py [--head-dim 128] [--dtype bfloat16] [--only dk ut ...]
"""
import argparse
import os
import re
import subprocess
import tempfile

REGS_PER_SM = 65536
SMEM_PER_SM = 227 * 1024


def ptxas(src: str) -> dict:
    """Registers and spill bytes of the generated CUDA `src` (nvcc -Xptxas=-v, sm_90a)."""
    from tilelang.contrib.nvcc import default_compile_options

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cu")
        with open(path, "w") as f:
            f.write(src)
        cmd = ["nvcc", "-cubin", "-arch=sm_90a", "-O3", "-Xptxas=-v", "-w", *default_compile_options([]),
               path, "-o", os.path.join(d, "kernel.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": (int(spill.group(1)) + int(spill.group(2))) if spill else None}


def resources(src: str) -> dict:
    threads, min_blocks = (int(x) for x in re.search(r"__launch_bounds__\((\d+), (\d+)\)", src).groups())
    # dynamic shared memory: the end of the last buffer TileLang placed (offset + size is not in the
    # source; the last offset is a lower bound, reported as such)
    offsets = [int(x) for x in re.findall(r"buf_dyn_shmem \+ (\d+)\)", src)]
    info = ptxas(src)
    regs = info["registers"] or 0
    return {"threads": threads, "min_blocks": min_blocks, **info, "smem_last_offset": max(offsets, default=0),
            "blocks_by_registers": REGS_PER_SM // max(regs * threads, 1)}


def kernels(K: int, dtype: str):
    from kda_cp.kernels.bwd_intra import build_bwd_dk_kernel, build_bwd_dv_kernel, build_bwd_ut_kernel
    from kda_cp.kernels.bwd_state import build_bwd_state_kernel
    from kda_cp.kernels.intra import build_decay_kernel, build_intra_kernel, build_intra_summary_kernel
    from kda_cp.kernels._common import STATE_LAUNCHES
    from kda_cp.kernels.state import build_state_output_kernel, build_summary_kernel

    scale = K ** -0.5
    yield "intra", lambda: build_intra_kernel(None, K, K, 64, dtype, scale=scale)
    for bv, th in STATE_LAUNCHES:
        yield f"state+output {bv}/{th}", (lambda bv=bv, th=th: build_state_output_kernel(
            None, K, K, 64, dtype, with_h0=True, store_ht=True, block_v=bv, threads=th))
    yield "cp summary", lambda: build_summary_kernel(None, K, K, 64, dtype=dtype)
    yield "decay", lambda: build_decay_kernel(None, K, 64, dtype, scale=scale)
    for walk in ("forward", "reverse", "state_grad"):
        yield f"walk {walk}", (lambda walk=walk: build_bwd_state_kernel(None, K, K, 64, dtype, walk=walk))
    yield "dv", lambda: build_bwd_dv_kernel(None, K, K, 64, dtype)
    yield "ut", lambda: build_bwd_ut_kernel(None, K, K, 64, dtype)
    yield "dk", lambda: build_bwd_dk_kernel(None, K, 64, dtype, scale=scale)
    # the general gate (g_min=None, any g <= 0)
    yield "general intra", lambda: build_intra_kernel(None, K, K, 64, dtype, scale=scale, general=True)
    yield "general summary intra", lambda: build_intra_summary_kernel(None, K, K, 64, dtype, general=True)
    yield "general decay", lambda: build_decay_kernel(None, K, 64, dtype, scale=scale, general=True)
    yield "general ut", lambda: build_bwd_ut_kernel(None, K, K, 64, dtype, general=True)
    yield "general dk", lambda: build_bwd_dk_kernel(None, K, 64, dtype, scale=scale, general=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--only", nargs="*", help="kernel names (prefixes) to report")
    args = ap.parse_args()
    print("| kernel | threads | min blocks/SM | registers | spill bytes | blocks/SM by registers | "
          "shared memory (last buffer offset) |")
    print("|---|---|---|---|---|---|---|")
    for name, build in kernels(args.head_dim, args.dtype):
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        r = resources(build().get_kernel_source())
        print(f"| {name} | {r['threads']} | {r['min_blocks']} | {r['registers']} | {r['spill_bytes']} | "
              f"{r['blocks_by_registers']} | >= {r['smem_last_offset'] / 1024:.1f} KB |", flush=True)


if __name__ == "__main__":
    main()
