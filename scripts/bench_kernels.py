"""Forward timing of the TileLang KDA kernels against flash-linear-attention and the torch backend.

Usage (on a Hopper GPU):
    python scripts/bench_kernels.py --out bench.json [--shapes S1 S2 S3] [--repeats 20]

For each shape: bf16 q, k (L2-normalised), v; g = -5 * sigmoid(randn) (bounded at -5); beta ~ U(0,1).
Times (median over --repeats, CUDA events around each call, after warm-up):
  kda_cp   kda_cp.kernels.chunk_kda_fwd (no initial state, no final state, like the peer's default)
  fla      fla.ops.kda.chunk_kda(..., safe_gate=True, lower_bound=-5) on the same tensors (optional)
  torch    kda_cp.ops.chunk_kda(..., backend="torch") (optional; skipped if it fails)
  summary  kda_cp.kernels.chunk_kda_summary (M, S~) alone
It also reports the relative RMS difference between kda_cp's and fla's outputs (a cross-check, not
a test). Prints a markdown table and writes JSON to --out.
"""
import argparse
import json
import statistics

import torch

SHAPES = {
    "S1": dict(B=1, T=32768, H=32, K=128, V=128),
    "S2": dict(B=8, T=4096, H=32, K=128, V=128),
    "S3": dict(B=1, T=131072, H=16, K=128, V=128),
}


def time_ms(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def make_inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q = r(B, T, H, K).bfloat16()
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1).bfloat16()
    v = r(B, T, H, V).bfloat16()
    g = (-5.0 * torch.sigmoid(r(B, T, H, K))).contiguous()
    beta = torch.rand(B, T, H, generator=gen, device="cuda")
    return q, k, v, g, beta


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--torch-repeats", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch backend")
    args = ap.parse_args()

    from kda_cp.kernels import chunk_kda_fwd, chunk_kda_summary

    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as e:
        fla_chunk_kda = None
        print(f"fla-core not importable ({type(e).__name__}: {e}); skipping the peer")
    torch_fwd = None
    if not args.no_torch:
        try:
            from kda_cp.ops import chunk_kda as ops_chunk_kda

            def torch_fwd(q, k, v, g, beta, scale):
                return ops_chunk_kda(q, k, v, g, beta, scale=scale, backend="torch", check_gate=False)
        except Exception as e:
            print(f"kda_cp.ops torch backend not importable ({type(e).__name__}: {e}); skipping")

    dev = torch.cuda.get_device_name()
    results = {"device": dev, "torch": torch.__version__, "shapes": {}}
    for name in args.shapes:
        s = SHAPES[name]
        q, k, v, g, beta = make_inputs(**s)
        scale = s["K"] ** -0.5
        row = dict(s)
        with torch.no_grad():
            ours = lambda: chunk_kda_fwd(q, k, v, g, beta, scale=scale)  # noqa: E731
            row["kda_cp_ms"] = time_ms(ours, args.repeats)
            row["summary_ms"] = time_ms(lambda: chunk_kda_summary(k, v, g, beta), args.repeats)
            if fla_chunk_kda is not None:
                peer = lambda: fla_chunk_kda(q, k, v, g, beta, scale=scale, safe_gate=True,  # noqa: E731
                                             lower_bound=-5.0)
                row["fla_ms"] = time_ms(peer, args.repeats)
                o1, o2 = ours()[0].double(), peer()[0].double()
                row["rel_rms_vs_fla"] = ((o1 - o2).norm() / o2.norm()).item()
            if torch_fwd is not None:
                try:
                    row["torch_ms"] = time_ms(lambda: torch_fwd(q, k, v, g, beta, scale),
                                              args.torch_repeats, warmup=1)
                except Exception as e:  # e.g. out of memory
                    row["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    torch.cuda.empty_cache()
        results["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
        del q, k, v, g, beta
        torch.cuda.empty_cache()

    print(f"\nForward, bf16, gates bounded at -5, {dev}, median of {args.repeats}\n")
    print("| shape | kda_cp ms | fla ms | fla / kda_cp | torch ms | summary ms | summary / fwd |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results["shapes"].items():
        shp = f"{name} B={r['B']} T={r['T']} H={r['H']} K=V={r['K']}"
        fla = f"{r['fla_ms']:.3f}" if "fla_ms" in r else "-"
        ratio = f"{r['fla_ms'] / r['kda_cp_ms']:.2f}x" if "fla_ms" in r else "-"
        tch = f"{r['torch_ms']:.2f}" if "torch_ms" in r else "-"
        print(f"| {shp} | {r['kda_cp_ms']:.3f} | {fla} | {ratio} | {tch} | {r['summary_ms']:.3f} | "
              f"{r['summary_ms'] / r['kda_cp_ms']:.2f} |")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
