"""Forward+backward time and peak memory of the TileLang KDA kernels, side by side with fla-core.

Usage (on a Hopper GPU):
    python scripts/bench_backward.py --out bench_backward.json [--shapes S1 S2 S3] [--repeats 10]
        [--profile] [--no-fla]

For each shape: bf16 q, k (L2-normalised), v; g = -5 * sigmoid(randn) (bounded at -5); beta ~ U(0, 1);
do ~ N(0, 1). Measured (median over --repeats of CUDA-event timings, after warm-up):

  kda_cp  kda_cp.chunk_kda(..., backend="tilelang", check_gate=False) under autograd, as a user calls it:
          fwd_ms        the forward without autograd (no_grad: nothing kept)
          fwd_bwd_ms    forward, then torch.autograd.grad of <o, do> (a training step's work)
          bwd_ms        the backward alone (autograd.grad on a kept graph)
          state_grad_ms kda_cp.kernels.backward.chunk_kda_state_grad (the CP reverse pass, dht = 0,
                        from the inputs)
          held_MiB      memory held between forward and backward: allocated after the forward minus
                        before, o and the tensors autograd keeps included
          peak_MiB      allocator peak during fwd+bwd above the memory in use before it
  fla     the same for fla.ops.kda.chunk_kda(..., safe_gate=True, lower_bound=-5) under autograd

fla's Triton autotuning (and its TileLang kernel's compile) run once, in an untimed warm-up step per
shape, before anything of fla is timed (reported as fla.warmup_s). With --profile, a torch.profiler
table of CUDA time per kernel (averaged over 3 calls) is printed for kda_cp's backward, its state
gradient and fla's forward+backward, and stored in the JSON under "profile".

Also the relative RMS difference of kda_cp's gradients vs fla's (a cross-check, not a test).
Prints a markdown table and writes JSON to --out.
"""
import argparse
import json
import time

import torch
from _bench import SHAPES, kernel_launches, make_inputs, time_ms

MiB = 2.0 ** 20


def peak_above_base(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / MiB


def kernel_table(fn, calls=3):
    """{kernel name: CUDA ms per call} from torch.profiler over ``calls`` calls of fn (after one warm-up)."""
    return {name: ms for name, (ms, _) in kernel_launches(fn, calls).items()}


def print_table(title, table, top=14):
    total = sum(table.values())
    print(f"\n{title}: {total:.3f} ms of kernel time per call")
    for name, ms in list(table.items())[:top]:
        print(f"  {ms:8.3f} ms  {100 * ms / max(total, 1e-9):5.1f}%  {name[:90]}")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def bench_shape(s, repeats, fla_chunk_kda, profile=False):
    from kda_cp import chunk_kda
    from kda_cp.kernels.backward import chunk_kda_state_grad

    q, k, v, g, beta, do = make_inputs(**s, with_do=True)
    scale = s["K"] ** -0.5
    row = dict(s)
    mine = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]

    def kda_fwd(*xs):  # the public op on the TileLang backend; the gate check off, as fla has none
        return chunk_kda(*xs, scale=scale, backend="tilelang", check_gate=False)[0]

    def step():
        o = kda_fwd(*mine)
        return o, torch.autograd.grad(o, mine, do)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o = kda_fwd(*mine)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - before) / MiB
    with torch.no_grad():
        f_ms = time_ms(lambda: kda_fwd(q, k, v, g, beta), repeats)

    def bwd():  # the backward alone, on the graph of the forward above
        return torch.autograd.grad(o, mine, do, retain_graph=True)

    row["kda_cp"] = dict(
        fwd_ms=f_ms, bwd_ms=time_ms(bwd, repeats), fwd_bwd_ms=time_ms(step, repeats),
        state_grad_ms=time_ms(lambda: chunk_kda_state_grad(q, k, v, g, beta, scale=scale, do=do), repeats),
        held_MiB=held)
    if profile:
        row["profile"] = {"kda_cp_bwd": kernel_table(bwd),
                          "kda_cp_state_grad": kernel_table(
                              lambda: chunk_kda_state_grad(q, k, v, g, beta, scale=scale, do=do))}
        print_table("kda_cp backward", row["profile"]["kda_cp_bwd"])
        print_table("kda_cp state gradient", row["profile"]["kda_cp_state_grad"])
    ours = bwd()
    del o
    row["kda_cp"]["peak_MiB"] = peak_above_base(step)
    print("kda_cp", json.dumps(row["kda_cp"]), flush=True)
    if fla_chunk_kda is not None:
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]

        def fla_fwd():
            return fla_chunk_kda(*leaves, scale=scale, safe_gate=True, lower_bound=-5.0)[0]

        def fla_step():
            for x in leaves:
                x.grad = None
            o = fla_fwd()
            o.backward(do)
            return o

        t0 = time.time()  # untimed warm-up: Triton autotune and compiles, once per shape
        fla_step()
        torch.cuda.synchronize()
        warmup_s = time.time() - t0
        print(f"fla warm-up {warmup_s:.1f} s", flush=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        o = fla_fwd()
        torch.cuda.synchronize()
        held = (torch.cuda.memory_allocated() - before) / MiB
        del o
        with torch.no_grad():
            f_ms = time_ms(lambda: fla_chunk_kda(q, k, v, g, beta, scale=scale, safe_gate=True,
                                                 lower_bound=-5.0), repeats)
        fb_ms = time_ms(fla_step, repeats)
        for x in leaves:  # free the last step's .grad first, so the peak counts fla's gradients as ours counts its outputs
            x.grad = None
        row["fla"] = dict(fwd_ms=f_ms, fwd_bwd_ms=fb_ms, held_MiB=held, peak_MiB=peak_above_base(fla_step),
                          warmup_s=warmup_s)
        if profile:
            row["profile"]["fla_fwd_bwd"] = kernel_table(fla_step)
            print_table("fla forward+backward", row["profile"]["fla_fwd_bwd"])
        fla_step()
        row["rel_rms_vs_fla"] = {n: rel(a, x.grad) for n, a, x in zip(("dq", "dk", "dv", "dg", "dbeta"),
                                                                       ours[:5], leaves)}
    return row


def bench_shapes(names, repeats, fla_chunk_kda, profile=False):
    """bench_shape at each named shape ({name: row}); a shape that fails (e.g. out of memory) gets a
    row with its error and the others still run."""
    rows = {}
    for name in names:
        try:
            rows[name] = bench_shape(SHAPES[name], repeats, fla_chunk_kda, profile)
        except Exception as e:  # e.g. out of memory: report and go on
            rows[name] = dict(SHAPES[name], error=f"{type(e).__name__}: {str(e)[:300]}")
        print(name, json.dumps(rows[name]), flush=True)
        torch.cuda.empty_cache()
    return rows


def print_table_fwd_bwd(rows, dev, repeats):
    """The markdown table of bench_shape's rows ({shape name: row})."""
    print(f"\nForward+backward, bf16, gates bounded at -5, {dev}, median of {repeats}\n")
    print("| shape | kda_cp fwd+bwd ms | fla fwd+bwd ms | fla / kda_cp | kda_cp fwd ms | fla fwd ms "
          "| kda_cp bwd ms | state_grad ms | kda_cp held / peak MiB | fla held / peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | error: {r['error'][:80]} |")
            continue
        a, f = r["kda_cp"], r.get("fla")
        fl = lambda key, fmt="{:.3f}": fmt.format(f[key]) if f else "-"  # noqa: E731
        ratio = f"{f['fwd_bwd_ms'] / a['fwd_bwd_ms']:.2f}x" if f else "-"
        print(f"| {name} | {a['fwd_bwd_ms']:.3f} | {fl('fwd_bwd_ms')} | {ratio} | {a['fwd_ms']:.3f} | "
              f"{fl('fwd_ms')} | {a['bwd_ms']:.3f} | {a['state_grad_ms']:.3f} | "
              f"{a['held_MiB']:.0f} / {a['peak_MiB']:.0f} | "
              f"{fl('held_MiB', '{:.0f}')} / {fl('peak_MiB', '{:.0f}')} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_backward.json")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-fla", action="store_true", help="skip the fla-core peer")
    ap.add_argument("--profile", action="store_true", help="per-kernel CUDA time (torch.profiler)")
    args = ap.parse_args()
    fla_chunk_kda = None
    if not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda
        except Exception as e:
            print(f"fla-core not importable ({type(e).__name__}: {e}); skipping the peer")
    dev = torch.cuda.get_device_name()
    results = {"device": dev, "torch": torch.__version__,
               "shapes": bench_shapes(args.shapes, args.repeats, fla_chunk_kda, args.profile)}

    print_table_fwd_bwd(results["shapes"], dev, args.repeats)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
