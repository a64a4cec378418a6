#!/usr/bin/env bash
# PPO ZeRO-1 and ZeRO-2 at the reference config and GPU defaults, 10 steps a case, the rollout by zbench's CUDA-graph
# decode loop (one prompt width a run) or by vLLM, the four cases in one run on one host. From the project root,
# with the GPU machine's kits on the path and GSM8K jsonl in $GSM8K_DIR (default .gsm8k):
#   bash results/reference/h200x2-one-width-20261127/session.sh   -> $OUT/run-*.log, run-*.tgz, env.json, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
here=results/reference/h200x2-one-width-20261127
{ lscpu; echo; nvidia-smi; nvidia-smi -q -d CLOCK,PERFORMANCE,POWER; } > "$out/host.txt" 2>&1
bash results/reference/gpu.sh prep-once || exit 1
RUN_BUDGET_S=${RUN_BUDGET_S:-900} bash results/reference/gpu.sh run $here/ppo.yaml \
  zero1_graph,zero1_vllm,zero2_graph,zero2_vllm "${STEPS:-10}"
echo "done $(date -u +%FT%TZ)"
