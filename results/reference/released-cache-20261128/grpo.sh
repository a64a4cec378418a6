#!/usr/bin/env bash
# GRPO ZeRO-2 and ZeRO-3 at the reference config and GPU defaults, 10 steps a case on 2 GPUs, the cases named in
# $1 (default: both graph-loop cases), then their bare-DeepSpeed floors on the same machine (FLOOR=1, unless
# FLOOR= is given empty). From the project root, DeepSpeed/Ray/Typer (and for the vllm cases vLLM) importable,
# GSM8K jsonl in $GSM8K_DIR (default .gsm8k):
#   bash results/reference/released-cache-20261128/grpo.sh [CASES]   -> $OUT/run-*.log, run-*.tgz, env.json, host.txt
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
here=results/reference/released-cache-20261128
{ lscpu; echo; nvidia-smi; } > "$out/host.txt" 2>&1
bash results/reference/gpu.sh prep-once || exit 1
FLOOR=${FLOOR-1} RUN_TAG=${RUN_TAG:-} RUN_BUDGET_S=${RUN_BUDGET_S:-360} FLOOR_BUDGET_S=${FLOOR_BUDGET_S:-150} \
  bash results/reference/gpu.sh run $here/grpo.yaml "${1:-zero2_graph,zero3_graph}" "${STEPS:-10}"
echo "done $(date -u +%FT%TZ)"
