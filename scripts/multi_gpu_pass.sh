#!/usr/bin/env bash
# The multi-GPU pass (issue 7) on one host: NCCL equivalence tests, weak/strong scaling side by side
# with Ulysses and fla-core's KDA CP, and a long-context training run of the hybrid model.
#
#   OUT=results bash scripts/multi_gpu_pass.sh [T_LOCAL_TRAIN]
#
# T_LOCAL_TRAIN (default 131072) is the training context per GPU; the run's context is N times it.
# Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-multi_gpu_out}
mkdir -p "$OUT"
N=$(python -c 'import torch; print(torch.cuda.device_count())')
T_LOCAL_TRAIN=${1:-131072}
echo "GPUs: $N" | tee "$OUT/summary.log"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
python -m pytest -q -m gpu tests/test_nccl.py -p no:cacheprovider 2>&1 | tee "$OUT/nccl_tests.log" | tail -15
python -m torch.distributed.run --nproc_per_node="$N" scripts/bench_scaling.py --out "$OUT/bench_scaling.json" --deadline 300 \
  2>&1 | tee "$OUT/bench_scaling.log" | grep -v Warning
python -m torch.distributed.run --nproc_per_node="$N" scripts/train.py +experiment=h200_hybrid_64k parallel.cp="$N" \
  data.seq_len=$((T_LOCAL_TRAIN * N)) trainer.max_steps=20 trainer.val_every=20 trainer.log_every=5 \
  trainer.checkpoint_every=0 data.val_batches=1 data.val_fraction=0.05 optim.warmup_steps=5 trainer.run_dir="/tmp/train_cp$N" \
  2>&1 | tee "$OUT/train_cp$N.log" | grep -E "INFO|Error|error" | tail -12
cp "/tmp/train_cp$N/summary.json" "$OUT/train_cp${N}_summary.json"
