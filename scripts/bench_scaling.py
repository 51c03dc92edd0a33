"""Multi-GPU scaling of one KDA op under context parallelism, over NCCL (one process per GPU).

    torchrun --nproc_per_node=8 scripts/bench_scaling.py --out bench_scaling.json

Weak scaling (--weak T_local ...): every GPU of a group of P holds T_local tokens (B=1, H, K=V);
forward and forward+backward of ``cp_chunk_kda`` (TileLang kernels; summary, exchange, scan,
local run from the true state) at P = 1, 2, 4, ... up to the world size.
efficiency = time(P=1) / time(P); P=1 is the plain single-GPU op on one shard.

Strong scaling (--strong T_total ...): T_total tokens split over P GPUs, side by side in one run:
  scan     kda_cp.parallel.cp_chunk_kda (affine scan over ranks)
  ulysses  kda_cp.parallel.ulysses_kda (all-to-all to heads, the single-GPU op on H/P heads)
  fla      fla.ops.kda.chunk_kda(..., safe_gate=True, lower_bound=-5, cp_context=build_cp_context(...))
           (fla-core's KDA CP; skipped with a message when fla-core is absent)
speedup = time(P=1 of the same method) / time(P).

Timing: per repeat, the ranks of the group start together (barrier + synchronize), each times its
step with CUDA events, and the step's time is the slowest rank's (all-reduce MAX); the table gives
the median over --repeats after warm-up. Ranks outside a group of size P wait at the barrier.
Forward+backward: backward of sum(o * do) into q, k, v, g, beta.

Writes Markdown tables to stdout and JSON to --out (rank 0), rewritten after each measurement so a
run cut short keeps what it measured. --deadline stops starting new measurements after that many
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from kda_cp.parallel import cp_chunk_kda
from kda_cp.parallel.ulysses import ulysses_kda

G_MIN = -5.0


def inputs(T, H, K, seed, requires_grad):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q = r(1, T, H, K).bfloat16()
    k = torch.nn.functional.normalize(r(1, T, H, K), dim=-1).bfloat16()
    v = r(1, T, H, K).bfloat16()
    g = (G_MIN * torch.sigmoid(r(1, T, H, K))).contiguous()
    beta = torch.rand(1, T, H, generator=gen, device="cuda")
    do = r(1, T, H, K).bfloat16()
    leaves = [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]
    return leaves, do


def make_op(method, group, P, T_total):
    if method == "scan":
        return lambda q, k, v, g, beta: cp_chunk_kda(q, k, v, g, beta, cp_group=group, backend="tilelang",
                                                     g_min=G_MIN)[0]
    if method == "ulysses":
        return lambda q, k, v, g, beta: ulysses_kda(q, k, v, g, beta, cp_group=group, backend="tilelang",
                                                    g_min=G_MIN, impl="torch")
    if method == "fla":
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        if P == 1:
            return lambda q, k, v, g, beta: fla_chunk_kda(q, k, v, g, beta, safe_gate=True, lower_bound=G_MIN)[0]
        from fla.ops.cp import build_cp_context

        cu = torch.tensor([0, T_total], dtype=torch.int32, device="cuda")
        ctx = build_cp_context(cu, group=group, cu_seqlens_cpu=cu.cpu())
        return lambda q, k, v, g, beta: fla_chunk_kda(q, k, v, g, beta, safe_gate=True, lower_bound=G_MIN,
                                                      cp_context=ctx)[0]
    raise ValueError(method)


def time_step(fn, members, group, repeats, warmup=2):
    """Median over repeats of the slowest member's CUDA-event time of fn(), in ms (None off-group)."""
    world = dist.group.WORLD
    rank = dist.get_rank()
    inside = rank in members
    times = []
    for i in range(warmup + repeats):
        dist.barrier(world)
        torch.cuda.synchronize()
        ms = torch.zeros(1, device="cuda")
        if inside:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms[0] = a.elapsed_time(b)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=world)
        if i >= warmup:
            times.append(ms.item())
    return statistics.median(times)


def measure(method, T_local, P, H, K, groups, repeats, T_total=None):
    rank = dist.get_rank()
    members = list(range(P))
    group = groups[P]
    res = {}
    fwd = fwd_bwd = None
    err = None
    if rank in members:
        (q, k, v, g, beta), do = inputs(T_local, H, K, seed=1000 * P + rank, requires_grad=True)
        try:
            op = make_op(method, group, P, T_total or T_local * P)
        except Exception as e:
            err = e

        def fwd():
            with torch.no_grad():
                return op(q, k, v, g, beta)

        def fwd_bwd():
            o = op(q, k, v, g, beta)
            torch.autograd.backward(o, do)
            for x in (q, k, v, g, beta):
                x.grad = None
    # a method that fails (e.g. the peer rejects a configuration) fails on every rank, never hangs
    if fwd_bwd is not None and err is None:
        try:
            fwd_bwd()
            torch.cuda.synchronize()
        except Exception as e:
            err = e
    flag = torch.tensor([0 if err is None else 1], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise RuntimeError(f"{method} failed on some rank: {err!r}" if err else f"{method} failed on another rank")
    res["fwd_ms"] = time_step(fwd, members, group, repeats)
    res["fwd_bwd_ms"] = time_step(fwd_bwd, members, group, repeats)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weak", type=int, nargs="*", default=[32768, 131072], help="T_local per GPU")
    ap.add_argument("--strong", type=int, nargs="*", default=[131072], help="T_total over the group")
    ap.add_argument("--methods", nargs="+", default=["scan", "ulysses", "fla"])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; no new measurement after it")
    ap.add_argument("--out", default="bench_scaling.json")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    Ps = [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= world]
    groups = {p: (None if p == 1 else dist.new_group(list(range(p)))) for p in Ps}
    t0 = time.time()
    H, K = args.heads, args.head_dim
    out = {"device": torch.cuda.get_device_name(), "world_size": world, "H": H, "K": K, "V": K,
           "repeats": args.repeats, "weak": [], "strong": [], "skipped": []}

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    def save():
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=2)

    methods = list(args.methods)
    if "fla" in methods:
        try:
            import fla.ops.cp  # noqa: F401
            import fla.ops.kda  # noqa: F401
        except Exception as e:  # optional peer
            log(f"fla-core not importable ({type(e).__name__}: {e}): its column is skipped")
            methods.remove("fla")
            out["skipped"].append(f"fla: {e}")

    log(f"device: {out['device']} x {world}, H={H}, K=V={K}, bf16, median of {args.repeats}")
    log("\n## Weak scaling (cp_chunk_kda, T_local tokens per GPU)\n")
    log("| T_local | P | fwd ms | fwd+bwd ms | fwd eff. | fwd+bwd eff. |")
    log("|---|---|---|---|---|---|")
    for T in args.weak:
        base = None
        for P in Ps:
            if time.time() - t0 > args.deadline:
                out["skipped"].append(f"weak T_local={T} P={P}: deadline")
                continue
            r = measure("scan", T, P, H, K, groups, args.repeats)
            base = base or r
            row = {"T_local": T, "P": P, **r, "fwd_eff": base["fwd_ms"] / r["fwd_ms"],
                   "fwd_bwd_eff": base["fwd_bwd_ms"] / r["fwd_bwd_ms"]}
            out["weak"].append(row)
            log(f"| {T} | {P} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {row['fwd_eff']:.3f} | {row['fwd_bwd_eff']:.3f} |")
            save()
            torch.cuda.empty_cache()

    log("\n## Strong scaling (T_total tokens over P GPUs)\n")
    log("| T_total | P | method | fwd ms | fwd+bwd ms | fwd speedup | fwd+bwd speedup |")
    log("|---|---|---|---|---|---|---|")
    for T in args.strong:
        for method in methods:
            base = None
            for P in Ps:
                if T % P or (method == "ulysses" and H % P):
                    continue
                if time.time() - t0 > args.deadline:
                    out["skipped"].append(f"strong T_total={T} P={P} {method}: deadline")
                    continue
                try:
                    r = measure(method, T // P, P, H, K, groups, args.repeats, T_total=T)
                except Exception as e:  # the peer may reject a configuration; report it, go on
                    out["skipped"].append(f"strong T_total={T} P={P} {method}: {type(e).__name__}: {e}")
                    log(f"| {T} | {P} | {method} | failed: {type(e).__name__}: {str(e)[:80]} | | | |")
                    continue
                base = base or r
                row = {"T_total": T, "P": P, "method": method, **r,
                       "fwd_speedup": base["fwd_ms"] / r["fwd_ms"], "fwd_bwd_speedup": base["fwd_bwd_ms"] / r["fwd_bwd_ms"]}
                out["strong"].append(row)
                log(f"| {T} | {P} | {method} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                    f"{row['fwd_speedup']:.2f} | {row['fwd_bwd_speedup']:.2f} |")
                save()
                torch.cuda.empty_cache()
    save()
    log(f"\nwrote {args.out} ({time.time() - t0:.0f} s)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
