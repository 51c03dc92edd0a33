"""Summarise Nsight Compute's per-instruction (SASS) source page of one kernel: where its warps
stall, by opcode, by stall reason, by stretch of code between barriers, and the top lines, with
the shared-memory wavefronts of each stretch.

    ncu --clock-control none --kernel-name regex:kda_ --launch-skip 2 --launch-count 2 --set full \
        --import-source yes -o rep python <a script calling kernels.chunk_kda_fwd twice>
    ncu -i rep.ncu-rep --page source --csv --print-source sass --kernel-name regex:kda_intra_fwd > intra.csv
    python scripts/ncu_sass_summary.py intra.csv [--top 25]

(`OUT=... bash scripts/profile_kernels.sh sass` runs all three for the forward's two kernels at S1.) Stall samples are time: a stretch with 20% of the samples took about 20% of the
warps' time. Runs anywhere (no GPU needed): it only reads the CSV.
"""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output of one kernel")
    ap.add_argument("--top", type=int, default=25, help="how many of the most-stalled lines to list")
    ap.add_argument("--min-share", type=float, default=0.02, help="list stretches with at least this share")
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    start = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    hdr, data = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
    col = {h: i for i, h in enumerate(hdr)}
    samples = col["Warp Stall Sampling (All Samples)"]
    waves = col.get("L1 Wavefronts Shared")
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, c: int(r[c] or 0) if c is not None and r[c] not in ("", "-") else 0  # noqa: E731
    total = sum(num(r, samples) for r in data) or 1
    total_waves = sum(num(r, waves) for r in data) or 1
    print(f"{a.csv}: {len(data)} instructions, {total} stall samples, {total_waves} shared wavefronts")

    by_op, by_reason = collections.Counter(), collections.Counter()
    for r in data:
        words = [w for w in r[col["Source"]].split() if not w.startswith("@")]
        by_op[words[0].split(".")[0] if words else "?"] += num(r, samples)
        for h in reasons:
            by_reason[h[len("stall_"):]] += num(r, col[h])
    print("by opcode:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(14)))
    print("by reason:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(8)))

    print(f"stretches between barriers / MMA waits with >= {100 * a.min_share:.0f}% of the samples "
          "(samples %, shared wavefronts %, instruction range, closing instruction):")
    acc = acc_w = first = 0
    for i, r in enumerate(data):
        acc += num(r, samples)
        acc_w += num(r, waves)
        src = r[col["Source"]]
        if any(m in src for m in ("BAR.", "SYNCS.", "WARPGROUP.DEPBAR")) or i == len(data) - 1:
            if acc >= a.min_share * total:
                print(f"  {100 * acc / total:5.1f}%  {100 * acc_w / total_waves:5.1f}%  [{first:5d}..{i:5d}]  "
                      f"{src.strip()[:60]}")
            acc = acc_w = 0
            first = i + 1

    print("most-stalled lines (index, samples %, instruction, two main reasons):")
    for i, r in sorted(enumerate(data), key=lambda x: -num(x[1], samples))[:a.top]:
        top2 = sorted(((num(r, col[h]), h[len("stall_"):]) for h in reasons), reverse=True)[:2]
        print(f"  {i:5d} {100 * num(r, samples) / total:5.1f}%  {r[col['Source']].strip()[:60]:60s} {top2}")


if __name__ == "__main__":
    main()
