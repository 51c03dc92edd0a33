"""scripts/ncu_sass_summary.py on a small CSV shaped like Nsight Compute's SASS source page."""
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_summary_splits_samples_by_opcode_reason_and_stretch(tmp_path):
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "L1 Wavefronts Shared",
           "stall_long_sb", "stall_barrier", "stall_long_sb (Not Issued)"]
    rows = [["0x0", "LDS R1, [R2]", "30", "8", "25", "5", "1"],
            ["0x10", "BAR.SYNC.DEFER_BLOCKING 0x0", "10", "0", "0", "10", "0"],
            ["0x20", "@!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4", "45", "24", "40", "5", "2"],
            ["0x30", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "15", "0", "0", "15", "0"]]
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "kda_test_kernel"])
        w.writerow(hdr)
        w.writerows(rows)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_sass_summary.py"), str(path), "--top", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert "4 instructions, 100 stall samples, 32 shared wavefronts" in out
    assert "HMMA 45.0%" in out and "LDS 30.0%" in out and "BAR 10.0%" in out  # predicates dropped
    assert "long_sb 65.0%" in out and "barrier 35.0%" in out  # not-issued columns not counted twice
    # two stretches: [0..1] closes at the barrier (40% of samples, 25% of wavefronts), [2..3] at the wait
    assert " 40.0%   25.0%  [    0..    1]" in out and " 60.0%   75.0%  [    2..    3]" in out
    top = out.split("most-stalled lines")[1].splitlines()[1:]
    assert len(top) == 2 and "HMMA" in top[0] and "LDS" in top[1]
