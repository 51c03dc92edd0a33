#!/usr/bin/env bash
# The multi-GPU pass on one host: NCCL equivalence tests, weak/strong scaling side by side
# with Ulysses and fla-core's KDA CP, and a long-context training run of the hybrid model.
#
#   OUT=results bash scripts/multi_gpu_pass.sh [T_LOCAL_TRAIN] [STEPS]
#
# Run it from the repository root in the environment that has kda_cp[gpu,train] installed.
# T_LOCAL_TRAIN (default 131072) is the training context per GPU (the run's context is N times it);
# STEPS (default 8) its steps. Logs, JSON and the run's summary/metrics go to $OUT.
set -uo pipefail
OUT=${OUT:-multi_gpu_out}
mkdir -p "$OUT"
N=$(python -c 'import torch; print(torch.cuda.device_count())')
T_LOCAL_TRAIN=${1:-131072}
STEPS=${2:-8}
echo "GPUs: $N" | tee "$OUT/summary.log"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
# compile every kernel once up front (TileLang's disk cache), not in each rank while the others wait
timeout 900 python scripts/prebuild_kernels.py --head-dim 128 > /dev/null 2>&1 || echo "prebuild failed" | tee -a "$OUT/summary.log"
timeout 900 python -m pytest -q -m gpu tests/cp/test_nccl.py -p no:cacheprovider 2>&1 | tee "$OUT/nccl_tests.log" | tail -15
timeout 1200 python -m torch.distributed.run --nproc_per_node="$N" scripts/bench_scaling.py \
  --out "$OUT/bench_scaling.json" --deadline 900 2>&1 | tee "$OUT/bench_scaling.log" | grep -v Warning
RUN=$(mktemp -d /tmp/train_cp$N.XXXX)
timeout 1800 python -m torch.distributed.run --nproc_per_node="$N" scripts/train.py +experiment=h200_hybrid_64k \
  parallel.cp="$N" data.seq_len=$((T_LOCAL_TRAIN * N)) trainer.max_steps="$STEPS" trainer.val_every="$STEPS" \
  trainer.log_every=2 data.val_batches=1 data.val_fraction=0.05 optim.warmup_steps=2 trainer.run_dir="$RUN" \
  > "$OUT/train_cp$N.log" 2>&1 && cp "$RUN/summary.json" "$OUT/train_cp${N}_summary.json" \
  && cp "$RUN/metrics.jsonl" "$OUT/train_cp${N}_metrics.jsonl" || echo "training run failed" | tee -a "$OUT/summary.log"
grep -E "final:" "$OUT/train_cp$N.log"
