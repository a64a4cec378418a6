#!/usr/bin/env bash
# PPO ZeRO-1 and ZeRO-2 at the reference config and GPU defaults with rollout.backend=auto, 10 steps a case, on
# 2 GPUs: this tree, then ZeRO-1 with the tree of e354ef1 (in $BASE, default .base, as session.sh says), in one call.
# From the project root, DeepSpeed/Ray/Typer importable, GSM8K jsonl in $GSM8K_DIR (default .gsm8k):
#   bash results/reference/h200-prefill-20261127/ppo.sh   -> $OUT/run-*.log, run-*.tgz, env.json, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
here=results/reference/h200-prefill-20261127
base=$(realpath "${BASE:-.base}")
{ lscpu; echo; nvidia-smi; } > "$out/host.txt" 2>&1
bash results/reference/gpu.sh prep-once || exit 1
RUN_BUDGET_S=${RUN_BUDGET_S:-300} bash results/reference/gpu.sh run $here/ppo.yaml zero1_auto,zero2_auto "${STEPS:-10}"
PYTHONPATH=$base:$PYTHONPATH RUN_TAG=e354ef1 RUN_BUDGET_S=${BASE_BUDGET_S:-150} \
  bash results/reference/gpu.sh run $here/ppo.yaml zero1_auto "${STEPS:-10}"
echo "done $(date -u +%FT%TZ)"
