"""Cost of context parallelism for one rank's shard, and the bytes each rank sends per layer.

On one device this times what a middle rank of a CP group computes, against the plain local op:

    CP forward  = chunk-local half of the forward (prepare) + summary from it + scan over P gathered
                  pairs + state pass from the true state (reusing the prepared tensors)
    CP backward = what the forward kept of the prepared tensors (the rest remade, or everything
                  recomputed on a backend that keeps nothing) + state gradient (dht = 0) + reverse
                  scan + backward from the true state (state gradient and backward share them)
as cp_chunk_kda runs them on a rank that summarises its shard (kda_cp/parallel/cp.py).
    ratio       = CP time / plain local forward (or forward+backward) time

It models the all-gather exchange with the default chain of states (exchange="allgather",
scan_method="sequential"): this rank packs its pair as cp_chunk_kda does (the summary's output is
sent as it is, and in the backward G takes the spent S~ half of that buffer) and folds the
gathered buffer with cp_chunk_kda's own fold, which reads the other ranks' rows only (and writes
over some of them, as there). Those are random maps of the right shapes (the scan's cost does not
depend on their values). Communication is not timed here: its volume is tabulated (it does not
depend on T) and measured in real multi-GPU runs elsewhere.

    python scripts/bench_cp.py --out bench_cp.json                       # GPU, TileLang backend
    python scripts/bench_cp.py --t-local 8192 --profile                  # + the kernels CP adds
    python scripts/bench_cp.py --device cpu --t-local 512 2048 --heads 2 --head-dim 32   # smoke test

Prints Markdown tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from _bench import kernel_launches, time_ms

from kda_cp import scan
from kda_cp.ops import KDAOptions, get_backend
from kda_cp.parallel.cp import _fold, _packed_row, _row_in_place


def added_by_cp(plain, cp):
    """The kernels of the CP step beyond the plain step's: {name: [extra ms, extra launches]}."""
    extra = {}
    for name, (ms, n) in cp.items():
        ms0, n0 = plain.get(name, (0.0, 0))
        if n > n0 or ms - ms0 > 0.005:
            extra[name] = [ms - ms0, n - n0]
    return dict(sorted(extra.items(), key=lambda kv: -kv[1][0]))


def bench_shard(T, H, K, V, P, device, dtype, backend_name, repeats, seed=0, profile=False):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(device)

    q = rnd(1, T, H, K).to(dtype)
    k = torch.nn.functional.normalize(rnd(1, T, H, K), dim=-1).to(dtype)
    v = rnd(1, T, H, V).to(dtype)
    g = (-5 * torch.sigmoid(rnd(1, T, H, K))).float()
    beta = torch.rand(1, T, H, generator=gen).to(device).float()
    do = rnd(1, T, H, V).to(dtype)
    backend = get_backend(backend_name, q, k, v, g, beta)
    opts = KDAOptions(scale=K**-0.5, chunk_size=64)
    sdt = torch.float32
    zero = torch.zeros(1, H, K, V, device=device, dtype=sdt)
    # the all-gather's output buffer [P, 1, H, K, V + K] of packed (S, M) pairs, the other ranks' rows random
    gathered = torch.cat([rnd(P, 1, H, K, V), rnd(P, 1, H, K, K) / K], dim=-1)
    rank = P // 2

    def exclusive(M, S, reverse):
        """As cp._exclusive: this rank's row as cp_chunk_kda packs it (the gather's writes are
        communication, untimed; the fold never reads this rank's own row), then the fold."""
        _packed_row(scan.AffineMap(M, S))
        maps = scan.AffineMap(gathered[..., V:], gathered[..., :V])
        return _fold(maps, rank, "sequential", reverse, scratch=True)

    def plain_fwd():
        return backend.fwd(q, k, v, g, beta, zero, opts)

    def for_backward(kept):  # what ChunkKDAFunction / CPChunkKDAFunction hand to the backward
        return backend.restore_prepared(q, k, v, g, beta, kept, opts) if kept else None

    def plain_fwd_bwd():  # as ChunkKDAFunction runs it: the forward keeps part of its chunk-local tensors
        prepared = backend.prepare(q, k, v, g, beta, opts)
        backend.fwd(q, k, v, g, beta, zero, opts, prepared=prepared)
        kept = backend.keep_for_backward(prepared)
        del prepared
        return backend.bwd(q, k, v, g, beta, zero, do, zero, opts, prepared=for_backward(kept))

    def cp_fwd(keep=False):
        prepared = backend.prepare(q, k, v, g, beta, opts)
        M, St = backend.summary_prepared(prepared, opts, last_only=False)
        s_in = exclusive(M, St, reverse=False)
        backend.fwd(q, k, v, g, beta, s_in, opts, prepared=prepared)
        return scan.AffineMap(M, St), s_in, backend.keep_for_backward(prepared) if keep else ()

    def cp_fwd_bwd():
        pair, s_in, kept = cp_fwd(keep=True)
        prepared = for_backward(kept) or backend.prepare(q, k, v, g, beta, opts)
        G = backend.state_grad(q, k, v, g, beta, do, opts, prepared=prepared).to(sdt)
        if _row_in_place(pair) is not None:  # as CPChunkKDAFunction.backward
            G = pair.S.copy_(G)
        d_end = exclusive(pair.M, G, reverse=True)
        return backend.bwd(q, k, v, g, beta, s_in, do, d_end, opts, prepared=prepared)

    with torch.no_grad():
        res = {
            "T_local": T, "H": H, "K": K, "V": V, "P": P, "backend": backend.name,
            "plain_fwd_ms": time_ms(plain_fwd, repeats, device=device),
            "cp_fwd_ms": time_ms(cp_fwd, repeats, device=device),
        }
        # the marginal costs of the summary and of the state gradient, given the prepared tensors
        # (the forward and the backward compute them anyway)
        pre = backend.prepare(q, k, v, g, beta, opts)
        res.update({
            "summary_ms": time_ms(lambda: backend.summary_prepared(pre, opts, last_only=False), repeats,
                                  device=device),
            "state_grad_ms": time_ms(lambda: backend.state_grad(q, k, v, g, beta, do, opts, prepared=pre), repeats,
                                     device=device),
        })
        pre = None  # freed before the forward+backward timings
        res.update({
            "plain_fwd_bwd_ms": time_ms(plain_fwd_bwd, repeats, device=device),
            "cp_fwd_bwd_ms": time_ms(cp_fwd_bwd, repeats, device=device),
        })
        if profile and device.type == "cuda":
            plain, cp = kernel_launches(plain_fwd_bwd), kernel_launches(cp_fwd_bwd)
            res["profile"] = {
                "plain_kernel_ms": sum(v[0] for v in plain.values()), "plain_launches": sum(v[1] for v in plain.values()),
                "cp_kernel_ms": sum(v[0] for v in cp.values()), "cp_launches": sum(v[1] for v in cp.values()),
                "added_by_cp": added_by_cp(plain, cp),
            }
    res["fwd_ratio"] = res["cp_fwd_ms"] / res["plain_fwd_ms"]
    res["fwd_bwd_ratio"] = res["cp_fwd_bwd_ms"] / res["plain_fwd_bwd_ms"]
    return res


def bytes_per_rank(P, B, H, K, V, value_bytes=4):
    """Bytes one rank sends per layer (forward + backward) for each exchange strategy."""
    pair = B * H * K * (K + V) * value_bytes
    rounds = 1 + math.ceil(math.log2(P - 1)) if P > 1 else 0  # shift + Hillis-Steele rounds
    # ring all-gather: each rank forwards P - 1 pairs; the backward exchanges (M^T, G) the same way.
    return {"allgather": 2 * (P - 1) * pair, "p2p": 2 * rounds * pair}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--t-local", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--world-size", type=int, default=8, help="P of the simulated group")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: list the kernels the CP forward+backward runs beyond the plain one's")
    ap.add_argument("--out", default="bench_cp.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    H, K = args.heads, args.head_dim
    rows = []
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print("| T_local | plain fwd ms | CP fwd ms | ratio | summary ms | plain fwd+bwd ms | CP fwd+bwd ms | ratio "
          "| state grad ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in args.t_local:
        r = bench_shard(T, H, K, K, args.world_size, device, dtype, args.backend, args.repeats, profile=args.profile)
        rows.append(r)
        print(f"| {T} | {r['plain_fwd_ms']:.3f} | {r['cp_fwd_ms']:.3f} | {r['fwd_ratio']:.3f} | {r['summary_ms']:.3f} "
              f"| {r['plain_fwd_bwd_ms']:.3f} | {r['cp_fwd_bwd_ms']:.3f} | {r['fwd_bwd_ratio']:.3f} "
              f"| {r['state_grad_ms']:.3f} |")
    print("(summary and state grad: their marginal cost, given the prepared chunk-local tensors)")
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            print(f"\nT_local {r['T_local']}, forward+backward kernel time: plain {p['plain_kernel_ms']:.3f} ms in "
                  f"{p['plain_launches']:.0f} launches, CP {p['cp_kernel_ms']:.3f} ms in {p['cp_launches']:.0f}; added by CP:")
            for name, (ms, n) in list(p["added_by_cp"].items())[:20]:
                print(f"  {ms:7.3f} ms  {n:+5.0f} launches  {name[:90]}")
    print(f"\nBytes each rank sends per layer (B=1, H={H}, K=V={K}, fp32 pairs), any T:")
    print("| P | all-gather | p2p log-depth |")
    print("|---|---|---|")
    comm = []
    P = 2
    while P <= 1024:
        b = bytes_per_rank(P, 1, H, K, K)
        comm.append({"P": P, **b})
        print(f"| {P} | {b['allgather'] / 2**20:.1f} MiB | {b['p2p'] / 2**20:.1f} MiB |")
        P *= 2
    with open(args.out, "w") as f:
        json.dump({"device": str(device), "shards": rows, "bytes_per_rank_per_layer": comm}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
