#!/usr/bin/env bash
# Activation checkpointing on fewer decoder layers (`model.checkpoint_layers`), on one host with 2 NVIDIA H200s, at
# the reference config (Qwen3-0.6B shape, GSM8K prompts, 64 prompts x 4 samples per step over 2 ranks, 512 new
# tokens, bf16, vLLM 0.26 with the fitted KV cache, the GPU defaults' micro-batch: 32 at ZeRO-2, 64 at ZeRO-3).
# From the project root, with the kits of the GPU machine's README on the path and GSM8K's jsonl in $GSM8K_DIR:
#   bash results/reference/h200x2-ckpt-20261126/session.sh frontier CASES [STEPS]  # checkpoint-layers.yaml's
#        CASES (globs), one after another in matrix order, STEPS each (default 6); $FRONTIER_MATRIX: another
#        matrix file of the same kind instead
#   bash results/reference/h200x2-ckpt-20261126/session.sh ref MATRIX CASES [STEPS]  # a shipped matrix at the
#        GPU defaults, STEPS each (default 10), with bare-DeepSpeed floors
# $RUN_UNTIL (epoch second, the end of the call) stops a run in time to pack it (results/reference/gpu.sh).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
g=results/reference/gpu.sh
here=results/reference/h200x2-ckpt-20261126
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
bash $g prep-once || exit 1
step=${1:-}; shift || true
case $step in
frontier)
  cases=$1; steps=${2:-6}; tag=${cases//[^a-z0-9]/}
  RUN_BUDGET_S=${RUN_BUDGET_S:-540} RUN_TAG=$tag bash $g run "${FRONTIER_MATRIX:-$here/checkpoint-layers.yaml}" "$cases" "$steps" \
    --set rollout.backend=vllm 2>&1 | tee "$out/frontier-$tag.log"
  ;;
ref)
  matrix=$1; cases=$2; steps=${3:-10}; tag=${cases//[^a-z0-9]/}
  FLOOR=${FLOOR-1} RUN_BUDGET_S=${RUN_BUDGET_S:-420} RUN_TAG=$tag bash $g run "$matrix" "$cases" "$steps" \
    --set rollout.backend=vllm 2>&1 | tee "$out/ref-$matrix-$tag.log"
  ;;
*)
  echo "unknown step $step: frontier CASES [STEPS] | ref MATRIX CASES [STEPS]" >&2; exit 2
  ;;
esac
