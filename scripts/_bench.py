"""Shared by the benchmark scripts: the benchmark shapes, their inputs and one median timer."""

import json
import os
import statistics
import tempfile
import time

import torch

#: The benchmark shapes S1-S3 (bf16, gates bounded at -5); docs/benchmarks.md reports them.
SHAPES = {
    "S1": dict(B=1, T=32768, H=32, K=128, V=128),
    "S2": dict(B=8, T=4096, H=32, K=128, V=128),
    "S3": dict(B=1, T=131072, H=16, K=128, V=128),
}


def make_inputs(B, T, H, K, V, seed=0, with_do=False):
    """bf16 q, k (L2-normalized), v; g = -5 * sigmoid(randn) (fp32, bounded at -5); beta ~ U(0, 1);
    and do ~ N(0, 1) in bf16 when ``with_do``. On CUDA, from one seeded generator."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q = r(B, T, H, K).bfloat16()
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1).bfloat16()
    v = r(B, T, H, V).bfloat16()
    g = (-5.0 * torch.sigmoid(r(B, T, H, K))).contiguous()
    beta = torch.rand(B, T, H, generator=gen, device="cuda")
    if with_do:
        return q, k, v, g, beta, r(B, T, H, V).bfloat16()
    return q, k, v, g, beta


def time_ms(fn, repeats, warmup=2, device="cuda"):
    """Median milliseconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls.

    On CUDA each call is bracketed by CUDA events (device time of the stream); on the CPU by
    time.perf_counter.
    """
    for _ in range(warmup):
        fn()
    times = []
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def stream_ms(fn, repeats, warmup=2):
    """(device ms, host ms) per call of ``repeats`` calls of fn issued back to back on CUDA, as a
    training loop issues its steps: one pair of events around them all, no sync in between. The
    host ms is the time the host takes to issue one call; when it exceeds the device ms the
    calls are launch-bound."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    a.record()
    for _ in range(repeats):
        fn()
    b.record()
    host = 1e3 * (time.perf_counter() - t) / repeats
    b.synchronize()
    return a.elapsed_time(b) / repeats, host


def kernel_launches(fn, calls=3):
    """{kernel name: [CUDA ms per call, launches per call]} from torch.profiler over ``calls`` calls
    of fn (after one warm-up), heaviest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        t = ev.cuda_time_total if t is None else t
        if t > 0:
            ms, n = out.get(ev.key, (0.0, 0))
            out[ev.key] = [ms + t / 1e3 / calls, n + ev.count / calls]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def idle_gaps(fn, calls=3):
    """:func:`trace_gaps` of ``calls`` calls of fn, each traced alone with torch.profiler (after
    two warm-up calls). The profiler lengthens host time: the gaps bound an untraced call's."""
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(calls):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            with record_function("STEP"):
                fn()
            torch.cuda.synchronize()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                out.append(trace_gaps(json.load(f)["traceEvents"]))
        finally:
            os.remove(path)
    return out


def trace_gaps(ev):
    """One call's idle time from its chrome-trace events (a "STEP" range around the call):
    first_kernel_us (call to first kernel), kernel_busy_us (summed kernel time), kernel_span_us
    (first kernel start to last kernel end), gaps_total_us (idle gaps over 2 us), the 12
    largest gaps as (us, the kernel after it, the CPU ops that launched that kernel), and
    host_calls: the 8 longest CUDA runtime/driver calls in the call as (us, API, CPU ops), which
    name what holds the host (an allocation, a sync) where a gap follows no slow op."""
    step = next(e for e in ev if e.get("name") == "STEP" and e.get("ph") == "X" and e.get("cat") == "user_annotation")
    kern = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and e.get("ph") == "X"),
                  key=lambda e: e["ts"])
    # TileLang and cuBLAS launch through the runtime API, Triton (torch.compile, the peer) the driver API
    launches = {e["args"].get("correlation"): e for e in ev
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    ops = [e for e in ev if e.get("cat") == "cpu_op" and e.get("ph") == "X"]

    def op_at(launch):  # the innermost three CPU ops open on the launching thread at the launch
        ts, tid = launch["ts"], launch.get("tid")
        inside = sorted((o for o in ops if o.get("tid") == tid and o["ts"] <= ts <= o["ts"] + o["dur"]),
                        key=lambda o: o["ts"])
        return " > ".join(o["name"] for o in inside[-3:])

    t0, t1 = step["ts"], step["ts"] + step["dur"]
    calls = sorted(((e["dur"], e["name"], op_at(e)) for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")
                    and e.get("ph") == "X" and t0 <= e["ts"] <= t1), reverse=True)[:8]
    gaps, end = [], kern[0]["ts"]
    for b in kern:  # idle time before each kernel, after every earlier one ended (any stream)
        gap = b["ts"] - end
        if gap > 2:
            launch = launches.get(b["args"].get("correlation"))
            gaps.append((gap, b["name"][:60], op_at(launch) if launch else "?"))
        end = max(end, b["ts"] + b["dur"])
    return dict(first_kernel_us=kern[0]["ts"] - step["ts"], kernel_busy_us=sum(k["dur"] for k in kern),
                kernel_span_us=end - kern[0]["ts"], gaps_total_us=sum(g[0] for g in gaps), n_kernels=len(kern),
                top_gaps=sorted(gaps, reverse=True)[:12], host_calls=calls)


def run_meta(script, with_fla=True):
    """What a benchmark ran on: device, versions (tilelang and fla when installed; fla's KDA
    kernels), date and the command line of ``script`` (scripts/NAME.py)."""
    import datetime
    import importlib.util
    import platform
    import shlex
    import sys

    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(),
            "command": shlex.join(["python", f"scripts/{script}", *sys.argv[1:]])}
    for pkg in ("tilelang", "fla") if with_fla else ("tilelang",):
        if importlib.util.find_spec(pkg) is not None:
            meta[pkg] = getattr(__import__(pkg), "__version__", "?")
    if "fla" in meta:
        meta["fla_kernels"] = peer_backends()
    return meta


def peer_backends():
    """Whether flash-linear-attention's TileLang KDA backend is enabled: "triton+tilelang" (its
    backward then runs chunk_kda_bwd_wy_dqkg_fused in TileLang where fla's per-call checks allow),
    "triton", or None without fla. fla 0.6 enables it where tilelang and nvcc are both installed,
    unless FLA_TILELANG=0; the peer's times differ between the two."""
    try:
        import fla  # noqa: F401
    except ImportError:
        return None
    try:
        from fla.ops.kda.backends import KDATileLangBackend
    except ImportError:
        return "triton"
    return "triton+tilelang" if KDATileLangBackend.can_use() else "triton"
