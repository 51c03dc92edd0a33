"""One KDA layer, forward and forward+backward, side by side with flash-linear-attention's layer.

Usage (on a Hopper GPU):
    python scripts/bench_layer.py --out bench_layer.json [--shapes L1 L2 L3] [--repeats 10]
        [--profile] [--gaps] [--no-fla] [--compiled-glue] [--gate-in-kernel]

Shapes (head_dim 128, bf16 weights and input): L1 = (B=1, T=32768, D=2048, H=16),
L2 = (B=1, T=65536, D=1024, H=8), L3 = (B=2, T=16384, D=2304, H=32); "tiny" runs anywhere.

Both layers have the same parameterization: kda_cp.layers.KDALayer with output_gate_rank =
head_dim (a low-rank output gate with a bias, as the peer's g_proj) and g_min = -5, against
fla.layers.kda.KimiDeltaAttention(safe_gate=True, lower_bound=-5) built by kda_cp.peer.FlaKDALayer.
The peer's weights are copied into kda_cp's layer, so the outputs and input gradients of the two
are compared too (a cross-check, not a test). The peer's backward runs its TileLang kernel where
tilelang and nvcc are installed (FLA_TILELANG=0: Triton only); meta.fla_kernels records whether
that backend is enabled (scripts/_bench.py peer_backends).

Measured per layer (median over --repeats of CUDA-event timings, after an untimed warm-up call
that runs torch.compile's and the peer's autotuning, reported as warmup_s):
    fwd_ms      forward under no_grad
    fwd_bwd_ms  forward, then torch.autograd.grad of <y, dy> for x and every parameter
    peak_MiB    allocator peak during forward+backward above the memory in use before it
    fwd_stream_ms, fwd_bwd_stream_ms, fwd_host_ms, fwd_bwd_host_ms (CUDA)
                --repeats calls issued back to back with no sync between them (as a training
                loop issues its layers): device ms per call, and the host's ms to issue one
With --compiled-glue, kda_cp's layer is timed a second time with KDA_CP_GLUE_KERNELS=0 (its
glue through torch.compile instead of the TileLang glue kernels: conv + SiLU + L2Norm, the gated
RMSNorm, the gate's backward), row "kda_cp compiled glue". With --gate-in-kernel, it is timed again with KDA_CP_GATE_IN_KERNEL=1 (the gate and
beta's sigmoid inside the chunk-local kernel), row "kda_cp gate in kernel". With --profile, CUDA
time per kernel (torch.profiler, mean of 3 calls) of each layer's forward and forward+backward,
printed and stored under "profile_fwd" and "profile". With --gaps (CUDA), where the GPU idles in
each layer's forward and forward+backward (scripts/_bench.py idle_gaps: three calls, each traced
alone; the host time to the first kernel, busy time against span, the largest idle gaps with the
CPU ops that launched the kernel after them, the longest CUDA API calls), printed and stored under "gaps_fwd" and "gaps".
Prints a markdown table, writes JSON to --out.
"""

import argparse
import json
import os
import time

import torch

from _bench import idle_gaps, run_meta, stream_ms, time_ms
from bench_backward import kernel_table, peak_above_base, print_table, rel

from kda_cp.interop import import_kda_state_dict
from kda_cp.layers import KDAConfig, KDALayer

LAYER_SHAPES = {
    "L1": dict(B=1, T=32768, D=2048, H=16),
    "L2": dict(B=1, T=65536, D=1024, H=8),
    "L3": dict(B=2, T=16384, D=2304, H=32),
    "tiny": dict(B=1, T=300, D=256, H=2),
}
HEAD_DIM = 128
IMPLS = ("kda_cp", "kda_cp compiled glue", "kda_cp gate in kernel", "fla")
# kda_cp's variants: the row name, the environment variable kda_cp reads per call, its value
VARIANTS = {"compiled_glue": ("kda_cp compiled glue", "KDA_CP_GLUE_KERNELS", "0"),
            "gate_in_kernel": ("kda_cp gate in kernel", "KDA_CP_GATE_IN_KERNEL", "1")}


def layer_config(D, H, backend):
    return KDAConfig(d_model=D, num_heads=H, head_dim=HEAD_DIM, output_gate_rank=HEAD_DIM, g_min=-5.0,
                     chunk_size=64, backend=backend)


def measure(layer, x, dy, repeats, profile, gaps=False):
    params = [p for p in layer.parameters() if p.requires_grad]

    def fwd():
        with torch.no_grad():
            return layer(x)

    def fwd_bwd():
        y = layer(x)
        return torch.autograd.grad(y, [x, *params], dy)

    t0 = time.time()
    fwd_bwd()
    fwd()
    torch.cuda.synchronize() if x.is_cuda else None
    row = {"warmup_s": time.time() - t0}
    dev = x.device.type
    row["fwd_ms"] = time_ms(fwd, repeats, device=dev)
    row["fwd_bwd_ms"] = time_ms(fwd_bwd, repeats, device=dev)
    if x.is_cuda:
        # the calls issued back to back (no sync between them, as in a training loop): device and host
        # time per call; a call whose host time exceeds its device time leaves the GPU idle
        for key, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            row[f"{key}_stream_ms"], row[f"{key}_host_ms"] = stream_ms(fn, repeats)
        row["peak_MiB"] = peak_above_base(fwd_bwd)
        if profile:
            row["profile_fwd"] = kernel_table(fwd)
            row["profile"] = kernel_table(fwd_bwd)
        if gaps:
            row["gaps_fwd"] = idle_gaps(fwd)
            row["gaps"] = idle_gaps(fwd_bwd)
    return row


def measure_with_env(layer, x, dy, repeats, profile, gaps, var, value):
    saved = os.environ.get(var)
    os.environ[var] = value
    try:
        return measure(layer, x, dy, repeats, profile, gaps)
    finally:
        if saved is None:
            del os.environ[var]
        else:
            os.environ[var] = saved


def bench_shape(name, repeats, profile, with_fla, variants=(), gaps=False):
    s = LAYER_SHAPES[name]
    B, T, D, H = s["B"], s["T"], s["D"], s["H"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, T, D, generator=gen, device=dev).to(dt).requires_grad_(True)
    dy = torch.randn(B, T, D, generator=gen, device=dev).to(dt)
    torch.manual_seed(0)
    ours = KDALayer(layer_config(D, H, "tilelang" if dev == "cuda" else "torch")).to(dev, dt)
    out = {"shape": {"name": name, **s, "head_dim": HEAD_DIM}}
    peer = None
    if with_fla:
        from kda_cp.peer import FlaKDALayer

        torch.manual_seed(0)
        peer = FlaKDALayer(layer_config(D, H, "auto")).to(dev, dt)
        with torch.no_grad():  # move the peer's parameters off their init (norm weights 1, A_log 0)
            for prm in peer.parameters():
                prm.mul_(1 + 0.1 * torch.randn_like(prm))
        # the peer's weights through the converter users call (kda_cp.interop)
        ours.load_state_dict(import_kda_state_dict(peer.inner.state_dict(), ours.config, "fla"))
    out["kda_cp"] = measure(ours, x, dy, repeats, profile, gaps)
    for v in variants:
        row, var, value = VARIANTS[v]
        out[row] = measure_with_env(ours, x, dy, repeats, profile, gaps, var, value)
    if peer is not None:
        out["fla"] = measure(peer, x, dy, repeats, profile, gaps)
        y_a, dx_a = ours(x), None
        (dx_a,) = torch.autograd.grad(y_a, x, dy)
        y_b = peer(x)
        (dx_b,) = torch.autograd.grad(y_b, x, dy)
        out["cross_check"] = {"y_rel_rms": rel(y_a.float(), y_b.float()), "dx_rel_rms": rel(dx_a.float(), dx_b.float())}
        for key in ("fwd_ms", "fwd_bwd_ms"):
            out[f"speedup_{key}"] = out["fla"][key] / out["kda_cp"][key]
        out["peak_ratio"] = out["kda_cp"]["peak_MiB"] / out["fla"]["peak_MiB"]
    del ours, peer, x, dy
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def print_gaps(title, r):
    print(f"\n{title}: first kernel {r['first_kernel_us']:.0f} us after the call, busy {r['kernel_busy_us']:.0f} us "
          f"of a {r['kernel_span_us']:.0f} us span, idle gaps {r['gaps_total_us']:.0f} us, {r['n_kernels']} kernels")
    for gap, kernel, ops in r["top_gaps"]:
        print(f"  {gap:8.1f} us before {kernel}  [{ops}]")
    for us, api, ops in r.get("host_calls", []):
        print(f"  host {us:8.1f} us in {api}  [{ops}]")


def print_rows(rows):
    print("\n| shape | layer | forward ms | fwd+bwd ms | peak MiB | fwd speedup | fwd+bwd speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["shape"]["name"]
        for impl in IMPLS:
            if impl not in r:
                continue
            m = r[impl]
            sp = (f"{r['speedup_fwd_ms']:.2f}x", f"{r['speedup_fwd_bwd_ms']:.2f}x") if impl == "kda_cp" and "fla" in r else ("", "")
            print(f"| {n} | {impl} | {m['fwd_ms']:.2f} | {m['fwd_bwd_ms']:.2f} | {m.get('peak_MiB', float('nan')):.0f} "
                  f"| {sp[0]} | {sp[1]} |")
    if any("fwd_stream_ms" in r.get(impl, {}) for r in rows for impl in IMPLS):
        print("\n| shape | layer | fwd stream ms (host) | fwd+bwd stream ms (host) |")
        print("|---|---|---|---|")
        for r in rows:
            for impl in IMPLS:
                m = r.get(impl, {})
                if "fwd_stream_ms" in m:
                    print(f"| {r['shape']['name']} | {impl} | {m['fwd_stream_ms']:.2f} ({m['fwd_host_ms']:.2f}) "
                          f"| {m['fwd_bwd_stream_ms']:.2f} ({m['fwd_bwd_host_ms']:.2f}) |")
    for r in rows:
        if "cross_check" in r:
            c = r["cross_check"]
            print(f"{r['shape']['name']}: kda_cp vs fla with the same weights: y rel RMS {c['y_rel_rms']:.2e}, "
                  f"dx rel RMS {c['dx_rel_rms']:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["L1", "L2", "L3"], choices=list(LAYER_SHAPES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--gaps", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--compiled-glue", action="store_true")
    ap.add_argument("--gate-in-kernel", action="store_true")
    ap.add_argument("--out", default="bench_layer.json")
    args = ap.parse_args()
    with_fla = not args.no_fla
    if with_fla:
        try:
            import fla  # noqa: F401
        except ImportError:
            print("flash-linear-attention is not installed: timing kda_cp alone (pip install flash-linear-attention)")
            with_fla = False
    if with_fla and not torch.cuda.is_available():
        print("no CUDA device: timing kda_cp alone (the peer needs a GPU)")
        with_fla = False
    meta = {**run_meta("bench_layer.py", with_fla), "repeats": args.repeats}
    if with_fla:
        print(f"flash-linear-attention {meta['fla']}, KDA kernels: {meta['fla_kernels']}")
    rows = []
    for name in args.shapes:
        variants = [v for v in VARIANTS if getattr(args, v)]
        rows.append(bench_shape(name, args.repeats, args.profile, with_fla, variants, args.gaps))
        for impl in IMPLS if args.gaps else ():
            for key, what in (("gaps_fwd", "forward"), ("gaps", "forward+backward")):
                if key in rows[-1].get(impl, {}):
                    print_gaps(f"{name} {impl} {what}", rows[-1][impl][key][-1])
        if args.profile:
            for impl in IMPLS:
                for key, what in (("profile_fwd", "forward"), ("profile", "forward+backward")):
                    if key in rows[-1].get(impl, {}):
                        print_table(f"{name} {impl} {what}", rows[-1][impl][key])
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in IMPLS}), flush=True)
        with open(args.out, "w") as f:  # after every shape: a run cut short keeps what it measured
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print_rows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
