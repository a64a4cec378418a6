#!/usr/bin/env bash
# The runs of this folder, on one host with 2 NVIDIA H200s: the reference config itself (Qwen3-0.6B shape, GSM8K
# prompts, 64 prompts per step over 2 ranks (GRPO 4 samples each), 512 new tokens, bf16, vLLM 0.26 with the fitted
# KV cache, batch geometry from the GPU defaults). From the project root, with the kits of the GPU machine's README
# on the path and GSM8K's jsonl files in $GSM8K_DIR:
#   bash results/reference/h200x2-20261126/session.sh grpo CASE [--set k=v ...]  # grpo-six-case CASE, 10 steps,
#        then its bare-DeepSpeed floors on the same GPUs (the first call also runs gpu.sh prep)
#   bash results/reference/h200x2-20261126/session.sh ppo CASES [--set k=v ...]  # six-case CASES likewise
#   bash results/reference/h200x2-20261126/session.sh others MATRIX CASES STEPS  # more cases, no floors
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
g=results/reference/gpu.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ ! -f /tmp/zbench-gsm8k/train.parquet ]; then
  bash $g prep > "$out/prep.log" 2>&1 || { cat "$out/prep.log"; exit 1; }
  while pgrep -f 'FusedAdamBuilder' > /dev/null; do sleep 2; done  # the ops prep compiles in the background
fi
step=${1:-}; shift || true
case $step in
grpo)
  case=$1; shift
  FLOOR=1 FLOOR_BUDGET_S=${FLOOR_BUDGET_S:-150} RUN_BUDGET_S=${RUN_BUDGET_S:-360} RUN_TAG=${case%%_*} \
    bash $g run grpo-six-case "$case" 10 --set rollout.backend=vllm "$@" 2>&1 | tee "$out/grpo-$case.log"
  ;;
ppo)
  cases=$1; shift
  FLOOR=1 FLOOR_BUDGET_S=${FLOOR_BUDGET_S:-150} RUN_BUDGET_S=${RUN_BUDGET_S:-400} \
    bash $g run six-case "$cases" 10 --set rollout.backend=vllm "$@" 2>&1 | tee "$out/ppo.log"
  ;;
others)
  matrix=$1; cases=$2; steps=$3; shift 3
  RUN_BUDGET_S=${RUN_BUDGET_S:-540} RUN_TAG=others bash $g run "$matrix" "$cases" "$steps" --set rollout.backend=vllm "$@" \
    2>&1 | tee "$out/others-$matrix.log"
  ;;
*)
  echo "unknown step $step: grpo CASE | ppo CASES | others MATRIX CASES STEPS" >&2; exit 2
  ;;
esac
