"""scripts/_bench.py trace_gaps (bench_layer.py --gaps) on a small chrome trace: the idle gap before
each kernel with the op that launched it, and the slow CUDA API calls that explain a host wait."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _bench import trace_gaps  # noqa: E402


def test_trace_gaps_names_the_gap_and_the_host_call_behind_it():
    ev = [dict(name="STEP", ph="X", cat="user_annotation", ts=0, dur=1000),
          dict(name="aten::cat", ph="X", cat="cpu_op", ts=20, dur=30, tid=1),
          dict(name="cudaLaunchKernel", ph="X", cat="cuda_runtime", ts=30, dur=4, tid=1, args={"correlation": 6}),
          dict(name="aten::mm", ph="X", cat="cpu_op", ts=100, dur=300, tid=1),
          dict(name="cudaMalloc", ph="X", cat="cuda_runtime", ts=110, dur=250, tid=1, args={"correlation": 7}),
          dict(name="cuLaunchKernel", ph="X", cat="cuda_driver", ts=370, dur=5, tid=1, args={"correlation": 8}),
          dict(name="cat_kernel", ph="X", cat="kernel", ts=50, dur=10, args={"correlation": 6}),
          dict(name="gemm", ph="X", cat="kernel", ts=380, dur=100, args={"correlation": 8}),
          dict(name="late", ph="X", cat="kernel", ts=481, dur=9, args={"correlation": 99})]
    r = trace_gaps(ev)
    assert r["first_kernel_us"] == 50 and r["n_kernels"] == 3
    assert r["kernel_busy_us"] == 119 and r["kernel_span_us"] == 440
    assert r["top_gaps"] == [(320, "gemm", "aten::mm")]  # the 1 us gap before "late" is under 2 us
    assert r["gaps_total_us"] == 320
    assert r["host_calls"][0] == (250, "cudaMalloc", "aten::mm")
    assert [c[1] for c in r["host_calls"]] == ["cudaMalloc", "cuLaunchKernel", "cudaLaunchKernel"]
