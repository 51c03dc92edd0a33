"""Where one KDA layer's wall time exceeds its kernel time: the host time before the first kernel,
and the idle gaps between kernels, each named by the kernel after it and the CPU op that launched it.

Usage (on a Hopper GPU):
    python scripts/layer_gaps.py [--shapes L1 L3] [--no-fla] [--out layer_gaps.json]

For each shape (scripts/bench_layer.py's) and layer (kda_cp's, then the peer's where installed),
the forward under no_grad and the forward+backward are each traced three times with
torch.profiler after two untimed calls. Per trace: first_kernel_us (from the call to the first
kernel), kernel_busy_us (summed kernel time), kernel_span_us (first kernel start to last kernel
end), gaps_total_us (idle gaps over 2 us between kernels) and the 12 largest gaps. Prints the last
trace of each and writes all of them to --out as JSON, with the device, torch and the peer's
kernels under "meta". The profiler's own overhead lengthens host time, so the gaps are upper
bounds of those of an untraced call.
"""

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kda_cp.layers import KDALayer

from _bench import peer_backends
from bench_layer import LAYER_SHAPES, layer_config


def trace(fn):
    """One traced call of fn: its first-kernel delay, busy time, span and gaps (dict)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        with record_function("STEP"):
            fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            ev = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    return summarize(ev)


def summarize(ev):
    """The trace's numbers from its chrome-trace events (one "STEP" range around the call)."""
    step = next(e for e in ev if e.get("name") == "STEP" and e.get("ph") == "X" and e.get("cat") == "user_annotation")
    kern = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and e.get("ph") == "X"),
                  key=lambda e: e["ts"])
    # TileLang and cuBLAS launch through the runtime API, Triton (torch.compile, the peer) the driver API
    launches = {e["args"].get("correlation"): e for e in ev
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    ops = [e for e in ev if e.get("cat") == "cpu_op" and e.get("ph") == "X"]

    def op_at(launch):  # the innermost three CPU ops open on the launching thread at the launch
        ts, tid = launch["ts"], launch.get("tid")
        inside = sorted((o for o in ops if o.get("tid") == tid and o["ts"] <= ts <= o["ts"] + o["dur"]),
                        key=lambda o: o["ts"])
        return " > ".join(o["name"] for o in inside[-3:])

    gaps, end = [], kern[0]["ts"]
    for b in kern:  # idle time before each kernel, after every earlier one ended (any stream)
        gap = b["ts"] - end
        if gap > 2:
            launch = launches.get(b["args"].get("correlation"))
            gaps.append((gap, b["name"][:60], op_at(launch) if launch else "?"))
        end = max(end, b["ts"] + b["dur"])
    return dict(first_kernel_us=kern[0]["ts"] - step["ts"], kernel_busy_us=sum(k["dur"] for k in kern),
                kernel_span_us=end - kern[0]["ts"], gaps_total_us=sum(g[0] for g in gaps), n_kernels=len(kern),
                top_gaps=sorted(gaps, reverse=True)[:12])


def analyse(fn, label, out):
    fn()
    fn()
    torch.cuda.synchronize()
    out[label] = [trace(fn) for _ in range(3)]
    r = out[label][-1]
    print(f"\n== {label}: first kernel {r['first_kernel_us']:.0f} us after the call, busy {r['kernel_busy_us']:.0f} us, "
          f"span {r['kernel_span_us']:.0f} us, gaps {r['gaps_total_us']:.0f} us, {r['n_kernels']} kernels")
    for gap, name, op in r["top_gaps"]:
        print(f"   {gap:7.1f} us before {name}  [{op}]")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["L1", "L3"], choices=[n for n in LAYER_SHAPES if n != "tiny"])
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--out", default="layer_gaps.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layer_gaps.py traces CUDA kernels: it needs a CUDA GPU")
    out = {"meta": dict(device=torch.cuda.get_device_name(), torch=torch.__version__, fla_kernels=peer_backends())}
    for name in args.shapes:
        s = LAYER_SHAPES[name]
        B, T, D, H = s["B"], s["T"], s["D"], s["H"]
        x = torch.randn(B, T, D, device="cuda").bfloat16().requires_grad_(True)
        dy = torch.randn(B, T, D, device="cuda").bfloat16()
        for impl in ("kda_cp",) if args.no_fla else ("kda_cp", "fla"):
            if impl == "kda_cp":
                layer = KDALayer(layer_config(D, H, "tilelang")).cuda().bfloat16()
            else:
                try:
                    from kda_cp.peer import FlaKDALayer
                    layer = FlaKDALayer(layer_config(D, H, "auto")).cuda().bfloat16()
                except ImportError as e:
                    print(f"flash-linear-attention not available ({e}): the peer's layer is skipped")
                    continue
            params = [p for p in layer.parameters() if p.requires_grad]

            def fwd():
                with torch.no_grad():
                    return layer(x)

            def fwd_bwd():
                return torch.autograd.grad(layer(x), [x, *params], dy)

            analyse(fwd, f"{name} {impl} fwd", out)
            analyse(fwd_bwd, f"{name} {impl} fwd+bwd", out)
            del layer
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
