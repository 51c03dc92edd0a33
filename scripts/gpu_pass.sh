#!/usr/bin/env bash
# The one-GPU check-and-benchmark pass: every `gpu` test of the kernels and of CP through them, the CP
# cost benchmark, and the forward/backward benchmarks side by side with fla-core (when installed).
#
#   OUT=results bash scripts/gpu_pass.sh [tests|bench|kernels|options|segments|tune|fla|layer|conv|hybrid ...]
#   (default: tests bench)
#
# "tests": pytest -m gpu on the kernel, segment and one-process CP tests; "bench": scripts/bench_cp.py;
# "kernels": bench_kernels.py (forward and CP summary at S1-S3, with fla-core's forward when installed);
# "segments": bench_kernels.py --segments (B = 1, few heads, without and with segment_len, with the peer);
# "options": bench_kernels.py --options (GVA, negative eigenvalues, the general gate, with the peer);
# "tune": tune_launches.py (each launch variant of the state passes, dv, ut, dk at S1-S3, timed and
# compared with the first); "fla": bench_backward.py with fla-core at S1 S2 S3 (its first call per shape compiles and autotunes, up to minutes);
# "layer": the layer's GPU tests, tests/ops/test_op_options_gpu.py and bench_layer.py --compiled-glue (LAYER_SHAPES,
# LAYER_PROFILE=1 for --profile; TESTS_LIMIT=0 skips the tests);
# "conv": tune_conv.py (the conv kernels' launches at L1-L3, each against the default);
# "hybrid": bench_hybrid.py (the 64k hybrid model with kda_cp's and with the peer's layer). Logs and JSON go to $OUT; one line per step
# goes to $OUT/summary.log. The peer runs its TileLang backward where tilelang and nvcc are installed;
# FLA_TILELANG=0 keeps it on Triton (the results' fla_kernels says which ran).
set -uo pipefail
OUT=${OUT:-gpu_pass_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the packing steps at the end run inside the cache directories
touch "$OUT/.started"  # what this pass adds to the TileLang cache is packed at the end
# the peer's autotuning results on disk: paid once per machine, not once per process and step;
# scripts/peer_autotune_sm90.tar.xz carries them (Triton's *.autotune.json, the timing of every config
# tried, on an H200 or an H100; the keys hash triton, the GPU target (sm_90 for both) and fla's kernel
# sources, so another version autotunes as usual; PEER_AUTOTUNE=fresh skips the restore).
# This pass's set goes to $OUT/peer_autotune.tar.xz.
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ "${PEER_AUTOTUNE:-}" != fresh ] && nvidia-smi -L | grep -qE "H100|H200" && [ -f scripts/peer_autotune_sm90.tar.xz ]; then
  tar -C "$TRITON_CACHE_DIR" -xJf scripts/peer_autotune_sm90.tar.xz
fi
# the GPU tests in PYTEST_WORKERS processes (default 8) where pytest-xdist is installed: their kernel
# builds run in parallel (one nvcc each), and the tests only compare numbers (no timings)
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}")
STEPS=${*:-tests bench}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/summary.log"
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  # SIGINT first: pytest then prints which tests passed and failed before the cut
  timeout -s INT -k 30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
}
for step in $STEPS; do
  case $step in
    tests)
      run tests ${TESTS_LIMIT:-900} python -m pytest -q -rA -m gpu $XDIST -p no:cacheprovider tests/kernels/test_kernels_gpu.py \
        tests/kernels/test_kernels_bwd_gpu.py tests/kernels/test_kernels_general_gpu.py tests/cp/test_cp_gpu.py \
        tests/ops/test_segments_gpu.py
      tail -3 "$OUT/tests.log" | tee -a "$OUT/summary.log" ;;
    bench)
      run bench_cp ${BENCH_LIMIT:-600} python scripts/bench_cp.py --t-local 8192 32768 131072 --repeats 10 --out "$OUT/bench_cp.json"
      grep "^| " "$OUT/bench_cp.log" | head -5 | tee -a "$OUT/summary.log" ;;
    options)
      run bench_options ${BENCH_LIMIT:-600} python scripts/bench_kernels.py --options --repeats 10 \
        --out "$OUT/bench_options.json"
      grep "^| " "$OUT/bench_options.log" | tee -a "$OUT/summary.log" ;;
    segments)
      run bench_segments ${BENCH_LIMIT:-600} python scripts/bench_kernels.py --segments --repeats 10 \
        --out "$OUT/bench_segments.json"
      grep "^| " "$OUT/bench_segments.log" | tee -a "$OUT/summary.log" ;;
    kernels)
      run bench_kernels ${BENCH_LIMIT:-600} python scripts/bench_kernels.py --shapes S1 S2 S3 --repeats 10 --no-torch \
        --out "$OUT/bench_kernels.json"
      grep "^| " "$OUT/bench_kernels.log" | tee -a "$OUT/summary.log" ;;
    tune)
      run tune ${BENCH_LIMIT:-600} python scripts/tune_launches.py --out "$OUT/tune_launches.json"
      grep "^| " "$OUT/tune.log" | tee -a "$OUT/summary.log" ;;
    fla)
      run bench_backward ${BENCH_LIMIT:-600} python scripts/bench_backward.py --shapes S1 S2 S3 --repeats 5 --profile \
        --out "$OUT/bench_backward.json"
      grep "^| " "$OUT/bench_backward.log" | tee -a "$OUT/summary.log" ;;
    layer)  # TESTS_LIMIT=0: the benchmark alone
      if [ "${TESTS_LIMIT:-300}" != 0 ]; then
        run layer_tests ${TESTS_LIMIT:-300} python -m pytest -q -rA -m gpu $XDIST -p no:cacheprovider tests/nn/test_layer_gpu.py \
          tests/nn/test_glue_gpu.py tests/ops/test_op_options_gpu.py tests/nn/test_interop_gpu.py
        tail -3 "$OUT/layer_tests.log" | tee -a "$OUT/summary.log"
      fi
      run bench_layer ${BENCH_LIMIT:-600} python scripts/bench_layer.py --shapes ${LAYER_SHAPES:-L1 L2 L3} --repeats 10 \
        --compiled-glue ${LAYER_PROFILE:+--profile} --out "$OUT/bench_layer.json"
      grep -E "^\| |rel RMS" "$OUT/bench_layer.log" | tee -a "$OUT/summary.log" ;;
    conv)  # its kernels first, in parallel (cache hits where they were built ahead)
      run prebuild_conv ${BENCH_LIMIT:-600} python scripts/prebuild_kernels.py --layer 2048 16 --layer 1024 8 \
        --layer 2304 32 --output-gate-rank 128 --only-layers --conv-tune --jobs ${PREBUILD_JOBS:-12}
      run tune_conv ${BENCH_LIMIT:-600} python scripts/tune_conv.py --out "$OUT/tune_conv.json"
      grep "^| " "$OUT/tune_conv.log" | tee -a "$OUT/summary.log" ;;
    hybrid)
      run bench_hybrid ${BENCH_LIMIT:-600} python scripts/bench_hybrid.py --steps ${HYBRID_STEPS:-40} \
        --workdir /tmp/bench_hybrid --out "$OUT/bench_hybrid.json"
      grep -E "^\| |x$" "$OUT/bench_hybrid.log" | tee -a "$OUT/summary.log" ;;
    *) echo "unknown step $step" | tee -a "$OUT/summary.log" ;;
  esac
done
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -cJf "$OUT/peer_autotune.tar.xz" -T -) 2>/dev/null
# TileLang kernels built on this machine (the peer's TileLang backward among them: about 45 s of
# nvcc per shape), to merge into the cache carried next time
if [ -n "${TILELANG_CACHE_DIR:-}" ] && [ -d "$TILELANG_CACHE_DIR" ]; then
  (cd "$TILELANG_CACHE_DIR" && find . -type f -newer "$OUT/.started" | tar -cJf "$OUT/tilelang_new.tar.xz" -T -) 2>/dev/null
fi
