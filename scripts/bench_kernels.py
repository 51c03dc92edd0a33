"""Forward (--backward: also forward+backward) timing of the TileLang KDA kernels vs fla-core, torch.

Usage (on a Hopper GPU):
    python scripts/bench_kernels.py --out bench.json [--shapes S1 S2 S3] [--repeats 20] [--backward]
    python scripts/bench_kernels.py --segments [SHAPE ...] [--segment-len 4096 8192] --out seg.json
    python scripts/bench_kernels.py --options [gva neg-eigval general-gate] --out options.json

For each shape: bf16 q, k (L2-normalised), v; g = -5 * sigmoid(randn) (bounded at -5); beta ~ U(0,1).
Times (median over --repeats, CUDA events around each call, after warm-up):
  kda_cp   kda_cp.kernels.chunk_kda_fwd (no initial state, no final state, like the peer's default)
  fla      fla.ops.kda.chunk_kda(..., safe_gate=True, lower_bound=-5) on the same tensors (optional)
  torch    kda_cp.ops.chunk_kda(..., backend="torch") (optional; skipped if it fails)
  summary  kda_cp.kernels.chunk_kda_summary (M, S~) alone, from q/k/v/g/beta (fp32 chunk-local pass)
  CP summary  kda_cp.kernels.chunk_kda_summary_prepared: what context parallelism adds to the
           forward (the summary from the forward's chunk-local tensors, which it computes anyway)
It also reports the relative RMS difference between kda_cp's and fla's outputs (a cross-check, not
a test). With --backward, also forward+backward time and the memory held between forward and
backward and the allocator peak, kda_cp and fla side by side through autograd, at the same shapes
(scripts/bench_backward.py's measurement, under "backward" in the JSON; fla's first step per shape
autotunes, 30 s to minutes). With --segments, chunk_kda through autograd at B = 1 and few heads
(SEGMENT_SHAPES) without and with segment_len, and the peer, forward and forward+backward, in place
of the forward table. With --options, GVA (H = 16, HV = 32), negative eigenvalues and the general
(softplus) gate at S1-shaped inputs, kda_cp and the peer with the same options; the general gate's
row also times kda_cp's bounded kernels at the same shape. Prints markdown tables and writes JSON to --out.
"""
import argparse
import json

import torch
from _bench import SHAPES, kernel_launches, make_inputs, peer_backends, time_ms


def profile(shape, fwd, summary, calls=5):
    """CUDA time per kernel, averaged over `calls` calls (torch.profiler)."""
    q, k, v, g, beta = make_inputs(**shape)
    scale = shape["K"] ** -0.5
    for name, fn in (("fwd", lambda: fwd(q, k, v, g, beta, scale=scale)),
                     ("summary", lambda: summary(k, v, g, beta))):
        print(f"--- {name} {shape}: CUDA time per call")
        for key, (ms, _) in list(kernel_launches(fn, calls).items())[:8]:
            print(f"  {key[:60]:60s} {ms:8.3f} ms")


def sweep(shape, repeats):
    """Each stage kernel alone, over the tile configs compiled into the cache (tuning aid)."""
    from kda_cp.kernels._common import build_chunk_tables
    from kda_cp.kernels.intra import build_intra_kernel
    from kda_cp.kernels.state import build_state_output_kernel

    B, T, H, K, V = (shape[x] for x in "BTHKV")
    q, k, v, g, beta = make_inputs(**shape)
    C = 64
    tab = build_chunk_tables(B, T, None, C, q.device)
    NC = tab.num_chunks
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, device="cuda", dtype=dt)  # noqa: E731
    W, U, Qg, Kd, Aqk = e(NC, H, C, K), e(NC, H, C, V), e(NC, H, C, K), e(NC, H, C, K), e(NC, H, C, C)
    Ec = e(NC, H, K, dt=torch.float32)
    args = (q.view(-1, H, K), k.view(-1, H, K), v.view(-1, H, V), g.view(-1, H, K), beta.view(-1, H),
            tab.chunk_table, W, U, Qg, Kd, Aqk, Ec)
    for threads in (128, 256):
        try:
            ker = build_intra_kernel(None, K, V, C, "bfloat16", scale=K ** -0.5, threads=threads)
            print(f"intra threads={threads}: {time_ms(lambda: ker(*args), repeats):.3f} ms", flush=True)
        except Exception as ex:
            print(f"intra threads={threads}: failed {type(ex).__name__}: {str(ex)[:200]}")
    o = torch.empty_like(v)
    h = torch.empty(B, H, K, V, device="cuda")
    for bv in (16, 32, 64):
        for st in (1, 2, 3):
            try:
                ker = build_state_output_kernel(None, K, V, C, "bfloat16", with_h0=False, store_ht=False,
                                                block_v=bv, num_stages=st)
                t = time_ms(lambda: ker(W, U, Qg, Kd, Aqk, Ec, tab.seq_table, h, o.view(-1, H, V), h),
                            repeats)
                print(f"state block_v={bv} num_stages={st}: {t:.3f} ms", flush=True)
            except Exception as ex:
                print(f"state block_v={bv} num_stages={st}: failed {type(ex).__name__}: {str(ex)[:200]}")


#: Few heads at B = 1 (--segments): the same head x token work at several head counts, and the
#: reference with enough heads to fill the GPU.
SEGMENT_SHAPES = {f"H{H}-T{T // 1024}k": dict(B=1, T=T, H=H, K=128, V=128)
                  for H in (4, 8, 16) for T in (32768, 65536, 131072)}
SEGMENT_SHAPES["H32-T16k"] = dict(B=1, T=16384, H=32, K=128, V=128)


def bench_segments(shapes, segment_lens, repeats, fla_chunk_kda):
    """chunk_kda (autograd, TileLang backend) forward and forward+backward without and with the
    intra-device split (segment_len), and the peer's chunk_kda, at SEGMENT_SHAPES."""
    from kda_cp.ops import chunk_kda
    from kda_cp.parallel.segments import auto_segment_len

    rows = {}
    for name in shapes:
        s = SEGMENT_SHAPES[name]
        q, k, v, g, beta, do = make_inputs(**s, with_do=True)
        leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta)]
        row = dict(s)

        def run(fn, name_):
            def fwd():
                with torch.no_grad():
                    return fn(*leaves)

            def fwd_bwd():
                return torch.autograd.grad(fn(*leaves)[0], leaves, do)

            row[f"{name_}_fwd_ms"] = time_ms(fwd, repeats)
            row[f"{name_}_fwd_bwd_ms"] = time_ms(fwd_bwd, repeats)

        for L in [None, "auto", *segment_lens]:  # "auto": the default, what the rule picks here
            run(lambda *x, L=L: chunk_kda(*x, backend="tilelang", check_gate=False, segment_len=L),
                {None: "plain", "auto": "auto"}.get(L, f"split{L}"))
        row["auto_segment_len"] = auto_segment_len((0, s["T"]), s["H"], s["V"])
        if fla_chunk_kda is not None:
            run(lambda *x: fla_chunk_kda(*x, safe_gate=True, lower_bound=-5.0), "fla")
        rows[name] = row
        print(name, json.dumps(row), flush=True)
        del q, k, v, g, beta, do, leaves
        torch.cuda.empty_cache()
    print("\n| shape | plain (None) fwd / fwd+bwd ms | " + " | ".join(f"segment_len {L} fwd / fwd+bwd ms" for L in segment_lens)
          + " | auto picks | auto fwd / fwd+bwd ms | fla fwd / fwd+bwd ms | fla / auto fwd+bwd |")
    print("|---" * (4 + len(segment_lens)) + "|---|---|")
    for name, r in rows.items():
        keys = ["plain", *(f"split{L}" for L in segment_lens), "auto"]
        cells = [f"{r[f'{k}_fwd_ms']:.3f} / {r[f'{k}_fwd_bwd_ms']:.3f}" for k in keys]
        cells.insert(-1, str(r["auto_segment_len"] or "no split"))
        fla = f"{r['fla_fwd_ms']:.3f} / {r['fla_fwd_bwd_ms']:.3f}" if "fla_fwd_ms" in r else "-"
        ratio = f"{r['fla_fwd_bwd_ms'] / r['auto_fwd_bwd_ms']:.2f}x" if "fla_fwd_ms" in r else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {fla} | {ratio} |")
    return rows


#: The peer's options at S1-shaped inputs (--options): B = 1, T = 32768, K = V = 128.
OPTION_CASES = {
    "gva": dict(H=16, HV=32, neg=False, bounded=True),  # grouped value attention, 2 value heads per key head
    "neg-eigval": dict(H=32, HV=32, neg=True, bounded=True),  # beta = 2 sigmoid(b) in [0, 2]
    "general-gate": dict(H=32, HV=32, neg=False, bounded=False),  # g = -exp(A_log) softplus(.), no bound
}


def bench_options(cases, repeats, fla_chunk_kda, T=32768, K=128, save=None):
    """chunk_kda and the peer's chunk_kda through autograd, forward and forward+backward, with the
    options of OPTION_CASES; both take the gate and beta pre-activations (use_gate_in_kernel,
    use_beta_sigmoid_in_kernel) so that each applies its own gate form. ``save(rows)`` runs after
    each case, so a run cut short keeps the cases it finished."""
    from kda_cp.ops import chunk_kda

    rows = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    for name in cases:
        c = OPTION_CASES[name]
        H, HV = c["H"], c["HV"]
        q = r(1, T, H, K).bfloat16()
        k = torch.nn.functional.normalize(r(1, T, H, K), dim=-1).bfloat16()
        v = r(1, T, HV, K).bfloat16()
        z, b = r(1, T, HV, K), r(1, T, HV)
        A_log = torch.log(torch.empty(HV, device="cuda").uniform_(1, 16))
        dt_bias = r(HV * K)
        do = r(1, T, HV, K).bfloat16()
        leaves = [x.requires_grad_(True) for x in (q, k, v, z, b)]
        g_min = -5.0 if c["bounded"] else None
        opts = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                    allow_neg_eigval=c["neg"])
        impls = {"kda_cp": lambda *x: chunk_kda(*x, g_min=g_min, check_gate=False, **opts)}
        if fla_chunk_kda is not None:
            impls["fla"] = lambda *x: fla_chunk_kda(*x, safe_gate=c["bounded"], lower_bound=g_min, **opts)
        if not c["bounded"]:  # what declaring no bound costs: the bounded kernels (sigmoid gate) at the same shape
            impls["kda_cp_bounded"] = lambda *x: chunk_kda(*x, g_min=-5.0, check_gate=False, **opts)
        row = dict(c, T=T, K=K)
        for impl, fn in impls.items():
            try:
                with torch.no_grad():
                    row[f"{impl}_fwd_ms"] = time_ms(lambda: fn(*leaves), repeats)
                row[f"{impl}_fwd_bwd_ms"] = time_ms(lambda: torch.autograd.grad(fn(*leaves)[0], leaves, do), repeats)
            except Exception as e:  # e.g. out of memory on a torch fallback
                row[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.empty_cache()
        if all(f"{i}_fwd_ms" in row for i in ("kda_cp", "fla")):
            with torch.no_grad():
                o1, o2 = (impls[i](*leaves)[0].double() for i in ("fla", "kda_cp"))
            row["rel_rms_vs_fla"] = ((o2 - o1).norm() / o1.norm()).item()
        rows[name] = row
        print(name, json.dumps(row), flush=True)
        if save is not None:
            save(rows)
        del q, k, v, z, b, do, leaves
        torch.cuda.empty_cache()
    print("\n| case | kda_cp fwd / fwd+bwd ms | fla fwd / fwd+bwd ms | fla / kda_cp fwd | fla / kda_cp fwd+bwd |")
    print("|---|---|---|---|---|")
    for name, r_ in rows.items():
        if "kda_cp_fwd_bwd_ms" not in r_:
            print(f"| {name} H={r_['H']} HV={r_['HV']} | {r_.get('kda_cp_error', '-')} | | | |")
            continue
        ours = f"{r_['kda_cp_fwd_ms']:.3f} / {r_['kda_cp_fwd_bwd_ms']:.3f}"
        if "fla_fwd_bwd_ms" in r_:
            peer = f"{r_['fla_fwd_ms']:.3f} / {r_['fla_fwd_bwd_ms']:.3f}"
            ratios = (f"{r_['fla_fwd_ms'] / r_['kda_cp_fwd_ms']:.2f}x", f"{r_['fla_fwd_bwd_ms'] / r_['kda_cp_fwd_bwd_ms']:.2f}x")
        else:
            peer, ratios = "-", ("-", "-")
        print(f"| {name} H={r_['H']} HV={r_['HV']} | {ours} | {peer} | {ratios[0]} | {ratios[1]} |")
    for name, r_ in rows.items():
        if "kda_cp_bounded_fwd_bwd_ms" in r_ and "kda_cp_fwd_bwd_ms" in r_:
            print(f"{name}: kda_cp with a declared bound (g_min=-5) at the same shape "
                  f"{r_['kda_cp_bounded_fwd_ms']:.3f} / {r_['kda_cp_bounded_fwd_bwd_ms']:.3f} ms; the general gate costs "
                  f"{r_['kda_cp_fwd_ms'] / r_['kda_cp_bounded_fwd_ms']:.2f}x / "
                  f"{r_['kda_cp_fwd_bwd_ms'] / r_['kda_cp_bounded_fwd_bwd_ms']:.2f}x")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--torch-repeats", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch backend")
    ap.add_argument("--sweep", action="store_true",
                    help="time the stage kernels alone over tile configs at the first shape")
    ap.add_argument("--backward", action="store_true",
                    help="also forward+backward time and memory, with fla (scripts/bench_backward.py)")
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler CUDA time per kernel (kda_cp fwd and summary, first shape)")
    ap.add_argument("--segments", nargs="*", metavar="SHAPE", default=None,
                    help=f"time chunk_kda with and without segment_len at these of {list(SEGMENT_SHAPES)} "
                         "(all when none is named) instead of the forward table")
    ap.add_argument("--segment-len", type=int, nargs="*", default=[4096, 8192],
                    help="the segment lengths --segments compares with no split and with auto (none: those two alone)")
    ap.add_argument("--options", nargs="*", metavar="CASE", default=None,
                    help=f"time the peer's options {list(OPTION_CASES)} (all when none is named) at S1-shaped "
                         "inputs instead of the forward table")
    args = ap.parse_args()

    from kda_cp.kernels import chunk_kda_fwd, chunk_kda_fwd_prepare, chunk_kda_summary, chunk_kda_summary_prepared

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

    if args.options is not None:
        def save(rows):
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "fla_kernels": peer_backends(), "options": rows}, f, indent=1)

        bench_options(args.options or list(OPTION_CASES), args.repeats, fla_chunk_kda, save=save)
        return
    if args.segments is not None:
        rows = bench_segments(args.segments or list(SEGMENT_SHAPES), args.segment_len, args.repeats, fla_chunk_kda)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "fla_kernels": peer_backends(), "segments": rows}, f, indent=1)
        return
    if args.profile:
        profile(SHAPES[args.shapes[0]], chunk_kda_fwd, chunk_kda_summary)
    if args.sweep:
        sweep(SHAPES[args.shapes[0]], args.repeats)
    dev = torch.cuda.get_device_name()
    results = {"device": dev, "torch": torch.__version__, "fla_kernels": peer_backends(), "shapes": {}}
    for name in args.shapes:
        s = SHAPES[name]
        q, k, v, g, beta = make_inputs(**s)
        scale = s["K"] ** -0.5
        row = dict(s)
        with torch.no_grad():
            ours = lambda: chunk_kda_fwd(q, k, v, g, beta, scale=scale)  # noqa: E731
            row["kda_cp_ms"] = time_ms(ours, args.repeats)
            row["summary_ms"] = time_ms(lambda: chunk_kda_summary(k, v, g, beta), args.repeats)
            prep = chunk_kda_fwd_prepare(q, k, v, g, beta, scale=scale)
            row["cp_summary_ms"] = time_ms(lambda: chunk_kda_summary_prepared(prep), args.repeats)
            del prep
            if fla_chunk_kda is not None:
                peer = lambda: fla_chunk_kda(q, k, v, g, beta, scale=scale, safe_gate=True,  # noqa: E731
                                             lower_bound=-5.0)
                row["fla_ms"] = time_ms(peer, args.repeats)
                o1, o2 = ours()[0].double(), peer()[0].double()
                row["rel_rms_vs_fla"] = ((o1 - o2).norm() / o2.norm()).item()
                del o1, o2
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
    print("| shape | kda_cp ms | fla ms | fla / kda_cp | torch ms | summary ms | summary / fwd | CP summary ms "
          "| CP summary / fwd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results["shapes"].items():
        shp = f"{name} B={r['B']} T={r['T']} H={r['H']} K=V={r['K']}"
        fla = f"{r['fla_ms']:.3f}" if "fla_ms" in r else "-"
        ratio = f"{r['fla_ms'] / r['kda_cp_ms']:.2f}x" if "fla_ms" in r else "-"
        tch = f"{r['torch_ms']:.2f}" if "torch_ms" in r else "-"
        print(f"| {shp} | {r['kda_cp_ms']:.3f} | {fla} | {ratio} | {tch} | {r['summary_ms']:.3f} | "
              f"{r['summary_ms'] / r['kda_cp_ms']:.2f} | {r['cp_summary_ms']:.3f} | "
              f"{r['cp_summary_ms'] / r['kda_cp_ms']:.2f} |")
    if args.backward:
        from bench_backward import bench_shapes, print_table_fwd_bwd

        results["backward"] = bench_shapes(args.shapes, args.repeats, fla_chunk_kda)
        print_table_fwd_bwd(results["backward"], dev, args.repeats)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
