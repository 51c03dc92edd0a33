"""End to end: the h200_hybrid_64k model trained with kda_cp's KDA layer and with
flash-linear-attention's, in one run, on one GPU.

Usage:
    python scripts/bench_hybrid.py --out bench_hybrid.json [--steps 40] [--impls kda_cp fla]
        [-- extra train.py overrides]

Each implementation runs ``scripts/train.py +experiment=h200_hybrid_64k model.kda_impl=IMPL
model.kda.output_gate_rank=128`` (the peer's low-rank output gate, so both models have the same
parameters and FLOPs) for --steps steps with validation and checkpoints off, in a fresh run
directory under --workdir. Reported from each run's summary.json: median tokens/s, median MFU
(train FLOPs per token from kda_cp.model.train_flops_per_token over 989 TFLOP/s) and peak memory,
and the ratio kda_cp / fla. Prints a markdown table and writes JSON to --out, with the device,
versions, date and command under "meta", after each run (a run cut short keeps what it measured).
Without flash-linear-attention the fla run is skipped with a message.
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def run_one(impl, steps, workdir, extra):
    run_dir = Path(workdir) / f"hybrid-{impl}"
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "+experiment=h200_hybrid_64k",
           f"model.kda_impl={impl}", "model.kda.output_gate_rank=128", f"trainer.max_steps={steps}",
           f"trainer.val_every={10 * steps}", f"trainer.checkpoint_every={10 * steps}", "trainer.plot=false",
           f"trainer.run_dir={run_dir}", *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-5000:], sep="\n")
        raise SystemExit(f"{impl}: train.py exited {proc.returncode}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["wall_s_with_startup"] = time.time() - t0
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--impls", nargs="+", default=["kda_cp", "fla"], choices=["kda_cp", "fla"])
    ap.add_argument("--workdir", default=None, help="where the run directories go (default: a temporary one)")
    ap.add_argument("--out", default="bench_hybrid.json")
    ap.add_argument("extra", nargs="*", help="more train.py overrides (after --)")
    args = ap.parse_args()
    impls = list(dict.fromkeys(args.impls))
    if "fla" in impls and importlib.util.find_spec("fla") is None:
        print("flash-linear-attention is not installed: skipping its run (pip install flash-linear-attention==0.6.0)")
        impls.remove("fla")
    if not impls:
        raise SystemExit("nothing to run: --impls named only fla, which is not installed")
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_hybrid-")
    from _bench import run_meta

    meta, rows = run_meta("bench_hybrid.py"), {}

    def write():
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "steps": args.steps, "extra": args.extra, "rows": rows}, f, indent=2)

    for impl in impls:
        s = run_one(impl, args.steps, workdir, args.extra)
        rows[impl] = {k: s[k] for k in ("median_tokens_per_s", "median_mfu", "peak_memory_gib", "params",
                                        "train_flops_per_token", "steps", "wall_s_with_startup")}
        print(json.dumps({impl: rows[impl]}), flush=True)
        write()
    print("\n| KDA layer | tokens/s | MFU | peak GiB |")
    print("|---|---|---|---|")
    for impl, r in rows.items():
        mfu = f"{100 * r['median_mfu']:.1f}%" if r["median_mfu"] is not None else "-"
        print(f"| {impl} | {r['median_tokens_per_s']:.0f} | {mfu} | {r['peak_memory_gib']:.2f} |")
    if {"kda_cp", "fla"} <= rows.keys():
        ratio = rows["kda_cp"]["median_tokens_per_s"] / rows["fla"]["median_tokens_per_s"]
        print(f"kda_cp / fla tokens/s: {ratio:.2f}x")
        rows["tokens_per_s_ratio"] = ratio
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
