#!/usr/bin/env bash
# PPO ZeRO-1 and ZeRO-2 at the reference config and GPU defaults with rollout.backend=auto, 10 steps a case, on
# 2 GPUs, then the bare-DeepSpeed floors of both cases on the same machine in the same call (FLOOR=1).
# From the project root, DeepSpeed/Ray/Typer importable, GSM8K jsonl in $GSM8K_DIR (default .gsm8k):
#   bash results/reference/shared-prefix-20261128/ppo.sh   -> $OUT/run-*.log, run-*.tgz, env.json, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
here=results/reference/shared-prefix-20261128
{ lscpu; echo; nvidia-smi; } > "$out/host.txt" 2>&1
bash results/reference/gpu.sh prep-once || exit 1
cp "$out/prep.log" "$out/prep-ppo.log" 2>/dev/null
FLOOR=1 RUN_BUDGET_S=${RUN_BUDGET_S:-270} FLOOR_BUDGET_S=${FLOOR_BUDGET_S:-200} \
  bash results/reference/gpu.sh run $here/ppo.yaml zero1_auto,zero2_auto "${STEPS:-10}"
echo "done $(date -u +%FT%TZ)"
