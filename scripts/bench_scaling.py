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
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from kda_cp.parallel import cp_chunk_kda
from kda_cp.parallel.layers.ulysses import ulysses_kda

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


def time_step(fn, members, repeats, warmup=2):
    """Median over repeats of the slowest member's CUDA-event time of fn(), in ms.

    Every rank takes part in each repeat's barrier and all-reduce (ranks outside ``members`` only
    wait), so a failure on any rank ends the measurement on every rank at the same repeat.
    """
    rank = dist.get_rank()
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        torch.cuda.synchronize()
        stat = torch.zeros(2, device="cuda")  # [ms, failed]
        if rank in members:
            try:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                stat[0] = a.elapsed_time(b)
            except Exception as e:  # reported below, after every rank has joined
                print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
                stat[1] = 1
        dist.all_reduce(stat, op=dist.ReduceOp.MAX)
        if stat[1].item():
            raise RuntimeError("failed on at least one rank (see its message above)")
        if i >= warmup:
            times.append(stat[0].item())
    return statistics.median(times)


def measure(method, T_local, P, H, K, groups, repeats, T_total=None):
    """{"fwd_ms", "fwd_bwd_ms"} of ``method`` on ranks 0..P-1; RuntimeError on every rank if it fails."""
    rank = dist.get_rank()
    members = list(range(P))
    state = {}

    def setup():  # inputs and the op, inside the timed protocol so that failures are collective
        (q, k, v, g, beta), do = inputs(T_local, H, K, seed=1000 * P + rank, requires_grad=True)
        state.update(x=(q, k, v, g, beta), do=do, op=make_op(method, groups[P], P, T_total or T_local * P))

    def fwd():
        with torch.no_grad():
            return state["op"](*state["x"])

    def fwd_bwd():
        o = state["op"](*state["x"])
        torch.autograd.backward(o, state["do"])
        for x in state["x"]:
            x.grad = None

    time_step(setup, members, repeats=1, warmup=0)
    res = {"fwd_ms": time_step(fwd, members, repeats), "fwd_bwd_ms": time_step(fwd_bwd, members, repeats)}
    state.clear()
    return res


def fmt(x):
    return "n/a" if x is None else f"{x:.3f}"


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
    # a rank stuck in a collective (a peer failed inside one) gives up after this, not 10 minutes
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                            timeout=datetime.timedelta(seconds=180))
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

    def past_deadline():  # rank 0's clock decides for everyone: the ranks never diverge
        flag = torch.tensor([float(time.time() - t0 > args.deadline)], device="cuda")
        dist.broadcast(flag, src=0)
        return bool(flag.item())

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
            if past_deadline():
                out["skipped"].append(f"weak T_local={T} P={P}: deadline")
                continue
            try:
                r = measure("scan", T, P, H, K, groups, args.repeats)
            except RuntimeError as e:
                out["skipped"].append(f"weak T_local={T} P={P}: {e}")
                log(f"| {T} | {P} | failed | | | |")
                continue
            if P == 1:
                base = r
            eff = (lambda key: base[key] / r[key]) if base else (lambda key: None)
            row = {"T_local": T, "P": P, **r, "fwd_eff": eff("fwd_ms"), "fwd_bwd_eff": eff("fwd_bwd_ms")}
            out["weak"].append(row)
            log(f"| {T} | {P} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {fmt(row['fwd_eff'])} | "
                f"{fmt(row['fwd_bwd_eff'])} |")
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
                if past_deadline():
                    out["skipped"].append(f"strong T_total={T} P={P} {method}: deadline")
                    continue
                try:
                    r = measure(method, T // P, P, H, K, groups, args.repeats, T_total=T)
                except RuntimeError as e:  # the peer may reject a configuration; report it, go on
                    out["skipped"].append(f"strong T_total={T} P={P} {method}: {e}")
                    log(f"| {T} | {P} | {method} | failed | | | |")
                    continue
                if P == 1:
                    base = r
                sp = (lambda key: base[key] / r[key]) if base else (lambda key: None)
                row = {"T_total": T, "P": P, "method": method, **r,
                       "fwd_speedup": sp("fwd_ms"), "fwd_bwd_speedup": sp("fwd_bwd_ms")}
                out["strong"].append(row)
                log(f"| {T} | {P} | {method} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                    f"{fmt(row['fwd_speedup'])} | {fmt(row['fwd_bwd_speedup'])} |")
                save()
                torch.cuda.empty_cache()
    save()
    log(f"\nwrote {args.out} ({time.time() - t0:.0f} s)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
