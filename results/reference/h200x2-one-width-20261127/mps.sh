#!/usr/bin/env bash
# PPO ZeRO-1 with zbench's CUDA-graph decode loop, the critic's update beside the rollout through a private MPS
# server (its kernels capped at 50 % or 25 % of the SMs) or in time slices, 8 steps a case, one run on one host.
# From the project root, with the GPU machine's kits on the path and GSM8K jsonl in $GSM8K_DIR (default .gsm8k):
#   bash results/reference/h200x2-one-width-20261127/mps.sh   -> $OUT/run-*.log, run-*.tgz, env.json, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
here=results/reference/h200x2-one-width-20261127
{ lscpu; echo; nvidia-smi; nvidia-smi -q -d CLOCK,PERFORMANCE,POWER; } > "$out/host.txt" 2>&1
bash results/reference/gpu.sh prep-once || exit 1
RUN_BUDGET_S=${RUN_BUDGET_S:-450} bash results/reference/gpu.sh run $here/mps.yaml \
  zero1_graph_mps50,zero1_graph_slices,zero1_graph_mps25 "${STEPS:-8}"
echo "done $(date -u +%FT%TZ)"
